//! Copies of CPython's object allocator that the compiler inlined into
//! their callers.
//!
//! A build with profile-guided optimisation (Debian's python3.11) turns
//! `_PyObject.malloc(_PyObject.ctx, size)`, a call through the allocator's
//! function pointer, into a guard and a copy of pymalloc: `cmp
//! $_PyObject_Malloc, %reg; jne <call *%reg>`, then the allocator's body
//! in place. Most object allocations of such an interpreter run those
//! copies and never enter a probed function. Each guard is found here by
//! its immediate (the address of the static `_PyObject_Malloc`, read from
//! the guard in the exported `PyObject_Malloc`), and probed on its branch
//! (an emulated instruction): the BPF program counts the call when the zero
//! flag says the copy runs. The size is where the call through the pointer
//! would pass it: the register or constant that ends up in `rsi` on the
//! branch's other path, followed from the branch to the indirect call.

//!
//! The module is split by concern: `text.rs` (the object's code and its
//! PLT slots of the C library's allocator), `guard.rs` (the guards and the
//! targets they name), `find.rs` (the sweep for guards and what each one's
//! probe reads), `size.rs` (where a copy's size is), `blocks.rs` (where a
//! copy of malloc's block is, for live mode). They match patterns on the
//! data flow that `crate::asm` follows.

mod blocks;
mod find;
mod guard;
mod size;
#[cfg(test)]
mod tests;
mod text;

pub use find::{find, guards_of};
pub use guard::{guard_of, targets, Exported};
pub use text::{function_extent, Text};

use tracer_common::{Role, COOKIE_ARGS_SHIFT, COOKIE_INLINE_SIZE_SHIFT, COOKIE_ROLE_SHIFT};

/// Where an inlined copy's size is when its guard's branch is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizeAt {
    /// In a register: its code in `tracer_common::ARG_REGS` (from 1).
    Reg(u64),
    /// A constant the compiler folded into the copy.
    Const(u64),
    /// The product of two registers (a copy of calloc: count and size).
    Product(u64, u64),
    /// A copy of realloc: the block's register (0: not known; count mode
    /// does not read it) and the new size's, or the size as a constant.
    Resize { ptr: u64, size: u64, fixed: u64 },
    /// A copy of free: the block's register.
    Block(u64),
    /// A copy of free: the block is in the stack, this many bytes above
    /// the stack pointer at the guard (in the cookie plus one, as
    /// `args::block_arg` reads it).
    StackBlock(u64),
}

/// Where a copy of malloc's (calloc's) block is, for live mode: the first address
/// its path shares with the call through the pointer's, and the register
/// (its code in `tracer_common::ARG_REGS`) that holds the block there on
/// both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockAt {
    /// Where the probe goes: the meeting place, or past it the first
    /// instruction the kernel emulates before anything moves the block
    /// (a single-stepped probe costs a second trap, a debug exception).
    pub vaddr: u64,
    pub file_offset: u64,
    /// The meeting place itself.
    pub met: u64,
    pub reg: u64,
    /// Not 0: the block is in memory, this less 1 bytes past the register
    /// `reg` names (0: the stack pointer).
    pub at_disp: u64,
}

/// One guard's branch, to probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InlineSite {
    pub vaddr: u64,
    pub file_offset: u64,
    pub size: SizeAt,
    /// A copy of malloc or calloc: where its block is known, on each of
    /// its ways (none found: empty).
    pub blocks: Vec<BlockAt>,
}

impl SizeAt {
    /// A copy of free's (its block's place, not a size).
    pub fn frees(&self) -> bool {
        matches!(self, SizeAt::Block(_) | SizeAt::StackBlock(_))
    }
}

impl InlineSite {
    /// The attach cookie's bits that say where the size is and the role
    /// that reads it (the function's index is the row's).
    pub fn cookie_bits(&self) -> u64 {
        let size = (Role::Size as u64) << COOKIE_ROLE_SHIFT;
        match self.size {
            SizeAt::Reg(code) => code << COOKIE_ARGS_SHIFT | size,
            SizeAt::Const(n) => n << COOKIE_INLINE_SIZE_SHIFT | size,
            SizeAt::Product(a, b) => {
                (a | b << 4) << COOKIE_ARGS_SHIFT | (Role::CountSize as u64) << COOKIE_ROLE_SHIFT
            }
            SizeAt::Resize { ptr, size, fixed } => {
                (ptr | size << 4) << COOKIE_ARGS_SHIFT
                    | fixed << COOKIE_INLINE_SIZE_SHIFT
                    | (Role::Resize as u64) << COOKIE_ROLE_SHIFT
            }
            SizeAt::Block(code) => {
                code << COOKIE_ARGS_SHIFT | (Role::Free as u64) << COOKIE_ROLE_SHIFT
            }
            SizeAt::StackBlock(offset) => {
                (offset + 1) << COOKIE_INLINE_SIZE_SHIFT | (Role::Free as u64) << COOKIE_ROLE_SHIFT
            }
        }
    }
}

/// The copies of one exported function to look for: the static function
/// its guards compare with and the slot they load the pointer from.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// The probe site (row) the copies are counted as.
    pub row: usize,
    pub function: u64,
    pub slot: u64,
    pub kind: Kind,
}

/// Which function a target copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Malloc,
    /// The size is count times size.
    Calloc,
    /// `(ptr, size)`: counted at its guard whatever the size, the calls
    /// the copy makes to the C library's allocator (and those the static
    /// `_PyObject_Malloc` it calls makes) being the same call (see
    /// [`Inlined::nested`]).
    Realloc,
    /// `(ptr)`: live mode's frees (and count mode's when frees are
    /// counted).
    Free,
}

/// The guards found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inlined {
    /// Each with the row of the [`Target`] it copies.
    pub sites: Vec<(usize, InlineSite)>,
    /// Guards on a target's slot not probed: their size could not be
    /// followed.
    pub missed: usize,
    /// Guards on a pointer read from elsewhere, not probed: a hook's call
    /// of the allocator it wraps (tracemalloc's, the debug hooks'), which
    /// would count again a call counted at an exported function's entry.
    pub hooks: usize,
    /// Where calls made inside the copies of realloc return to: calls of
    /// the C library's allocator (through its PLT), which are the copy's
    /// own call.
    pub nested: Vec<u64>,
    /// The same for the copies of free: their calls of the C library's
    /// `free` free the block the copy was called for.
    pub nested_frees: Vec<u64>,
}

/// The largest number the cookie's bits 40 to 51 hold (the copy's number
/// is above them): a copy of realloc's constant new size, or a block's
/// displacement plus one.
const MAX_FIXED: u64 = 0xfff;
