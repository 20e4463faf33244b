//! x86-64 machine code, read with iced-x86: the one place that decodes.
//!
//! The probes' placement (`allocators::placement`), the search for
//! inlined copies of CPython's allocator (`allocators::inlined`), the
//! unwinder's check of a return address (`unwind`) and the Go runtime's
//! stripped addresses (`golang::binary`) all read code through this
//! module. `decode` turns bytes into instructions, one or all of them;
//! `text` holds an object's executable sections, addressed by virtual
//! address; `regs` says which registers an instruction writes and how the
//! attach cookie names a register; `flow` follows values through
//! registers and stack slots along the paths of a function; `uprobe` says
//! which instructions the kernel emulates when probed.

mod decode;
pub mod flow;
mod regs;
mod text;
mod uprobe;

pub use decode::{first, instructions, is_call, jump_target};
pub use regs::{arg_code, callee_saved, writes, written};
pub use text::Sections;
pub use uprobe::kernel_emulates;

pub use iced_x86::{
    Code, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpKind, Register,
};
