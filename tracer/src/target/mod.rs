//! The target: the traced process as /proc shows it ([`proc`]), starting
//! it under mtrace ([`launch`]), and the record of its address space that
//! symbolization needs after it is gone ([`AddressSpace`]).

mod address_space;
pub mod launch;
pub mod proc;

pub use address_space::AddressSpace;
pub use proc::*;
