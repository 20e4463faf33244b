//! The tracee: the traced process as /proc shows it ([`proc`]), starting
//! it under mtrace ([`launch`], as another user: [`RunAs`]), holding it
//! at exit until its probes are read ([`ExitHold`]), both through the
//! one ptrace follower (`ptrace/`), and the record of its
//! address space that symbolization needs after it is gone
//! ([`AddressSpace`]).

mod address_space;
pub mod cgroup;
mod exit_hold;
pub mod launch;
mod linkmap;
pub mod perf_map;
pub mod proc;
pub mod ptrace;
mod run_as;

pub use address_space::{build_id, AddressSpace};
pub use exit_hold::ExitHold;
pub use linkmap::{is_dynamic_linker, DynamicLinker, Mem, RT_CONSISTENT};
pub use proc::*;
pub use run_as::RunAs;
