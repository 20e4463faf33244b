//! Types and names shared by the BPF programs (`tracer-ebpf`) and the
//! tracer: the contract between the two sides.
//!
//! Everything here is `#[repr(C)]` plain data: the BPF side writes it into
//! maps, the tracer reads the same bytes back. Map and program names are
//! in [`maps`] and [`roles`].
#![no_std]

mod config;
mod counters;
mod events;
mod host;
pub mod maps;
mod python;
mod roles;
mod sampling;
mod stack;
mod unwind;

pub use config::*;
pub use counters::*;
pub use events::*;
pub use host::*;
pub use python::*;
pub use roles::*;
pub use sampling::*;
pub use stack::*;
pub use unwind::*;

#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for CountKey {}
    unsafe impl aya::Pod for CountValue {}
    unsafe impl aya::Pod for BodyRange {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for ProcessConfig {}
    unsafe impl aya::Pod for Pending {}
    unsafe impl aya::Pod for StackFrames {}
    unsafe impl aya::Pod for UnwindRule {}
    unsafe impl aya::Pod for CachedRule {}
    unsafe impl aya::Pod for MissEvent {}
    unsafe impl aya::Pod for LostFree {}
    unsafe impl aya::Pod for LostAlloc {}
    unsafe impl aya::Pod for WalkMemo {}
    unsafe impl aya::Pod for PyNotice {}
    unsafe impl aya::Pod for PyCodeSnap {}
    unsafe impl aya::Pod for PyCodeKey {}
    unsafe impl aya::Pod for PythonLayout {}
    unsafe impl aya::Pod for HostKey {}
    unsafe impl aya::Pod for HostValue {}
    unsafe impl aya::Pod for HostFunc {}
    unsafe impl aya::Pod for HostBodies {}
    unsafe impl aya::Pod for HostExec {}
    unsafe impl aya::Pod for HostProcess {}
    unsafe impl aya::Pod for HostName {}
    unsafe impl aya::Pod for HostFileId {}
    unsafe impl aya::Pod for HostVmaKey {}
    unsafe impl aya::Pod for HostVma {}
}
