//! Unwinding without frame pointers: the rules the BPF walk follows, why a
//! walk stops, the stack hash both sides compute, and the event that hands
//! a walk to the tracer when a rule is missing.
//!
//! The tracer compiles the call-frame information (`.eh_frame`,
//! `.debug_frame`) of every return address the probes meet into an
//! [`UnwindRule`] in the `UNWIND_RULES` map, keyed by the return address. A
//! walk that meets an address with no rule yet copies the stack from there
//! into a [`MissEvent`]; the tracer finishes that walk in user space, adds
//! the rules it used, and counts the call itself, so no call loses its
//! stack while the rules fill in.

use crate::MAX_FRAMES;

/// How to get from a frame to its caller, for the caller's code at one
/// return address (its CFI row at `ra - 1`). 8 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct UnwindRule {
    /// [`UnwindRule::CFA_RSP`], [`UnwindRule::CFA_RBP`], ...
    pub kind: u8,
    /// [`UnwindRule::RBP_SAME`], [`UnwindRule::RBP_AT`] or
    /// [`UnwindRule::RBP_UNDEF`].
    pub rbp: u8,
    /// With `RBP_AT`: the caller's rbp is saved at `CFA + rbp_off`.
    pub rbp_off: i16,
    /// `CFA = base + cfa_off`, base being rsp or rbp according to `kind`.
    pub cfa_off: i32,
}

impl UnwindRule {
    /// No usable CFI: none covers the address, or its CFA is a DWARF
    /// expression or based on another register. 0, so that a zeroed value
    /// means "stop".
    pub const UNSUPPORTED: u8 = 0;
    /// `CFA = rsp + cfa_off`, rsp being the CFA of the frame below.
    pub const CFA_RSP: u8 = 1;
    /// `CFA = rbp + cfa_off`.
    pub const CFA_RBP: u8 = 2;
    /// The return-address column is undefined: the thread's outermost frame
    /// (`_start`, the thread entry of `clone3`).
    pub const END: u8 = 3;
    /// A signal trampoline (`__restore_rt`): the frame is the kernel's
    /// `rt_sigframe` (see [`UnwindRule::SIGFRAME_RSP`]).
    pub const SIGNAL: u8 = 4;
    /// The address lies in no executable mapping of the target: not a
    /// return address, the stack is corrupt or the walk went wrong.
    pub const NOT_CODE: u8 = 5;

    /// Offsets in `struct ucontext` (x86-64): `uc_mcontext` at 40, then
    /// `gregs[REG_RBP = 10]`, `gregs[REG_RSP = 15]`, `gregs[REG_RIP = 16]`.
    pub const SIGFRAME_RBP: u64 = 40 + 10 * 8;
    pub const SIGFRAME_RSP: u64 = 40 + 15 * 8;
    pub const SIGFRAME_RIP: u64 = 40 + 16 * 8;

    /// rbp is unchanged in the caller (also for registers the CFI does not
    /// mention).
    pub const RBP_SAME: u8 = 0;
    /// The caller's rbp is saved at `CFA + rbp_off`.
    pub const RBP_AT: u8 = 1;
    /// The caller's rbp cannot be recovered; fatal only if a later rule is
    /// `CFA_RBP`.
    pub const RBP_UNDEF: u8 = 2;

    pub const fn of_kind(kind: u8) -> UnwindRule {
        UnwindRule {
            kind,
            rbp: UnwindRule::RBP_UNDEF,
            rbp_off: 0,
            cfa_off: 0,
        }
    }

    pub const fn unsupported() -> UnwindRule {
        UnwindRule::of_kind(UnwindRule::UNSUPPORTED)
    }

    pub const fn signal() -> UnwindRule {
        UnwindRule::of_kind(UnwindRule::SIGNAL)
    }

    pub const fn end() -> UnwindRule {
        UnwindRule::of_kind(UnwindRule::END)
    }

    pub const fn not_code() -> UnwindRule {
        UnwindRule::of_kind(UnwindRule::NOT_CODE)
    }
}

const _: () = assert!(core::mem::size_of::<UnwindRule>() == 8);

/// A slot of the direct-mapped rule cache (`RULE_CACHE`): an array lookup
/// is much cheaper for the walk than a hash-map lookup, once per frame.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CachedRule {
    /// The return address, 0 for a free slot.
    pub ra: u64,
    pub rule: UnwindRule,
}

/// Slots of the rule cache (16 bytes each).
pub const RULE_CACHE_SLOTS: u32 = 1 << 16;

/// The cache slot of return address `ra` (Fibonacci hashing).
#[inline(always)]
pub const fn rule_slot(ra: u64) -> u32 {
    (ra.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 48) as u32
}

/// Why a walk ended: [`StackFrames::stop`](crate::StackFrames::stop).
pub mod stop {
    /// The thread's outermost frame was reached: the stack is whole.
    pub const END: u32 = 1;
    /// A frame's code has no usable call-frame information (JIT code,
    /// assembly without CFI, a DWARF-expression rule).
    pub const NO_CFI: u32 = 2;
    /// [`MAX_FRAMES`](crate::MAX_FRAMES) frames were kept.
    pub const MAX_FRAMES: u32 = 3;
    /// A caller's frame did not lie above its callee's, or a return address
    /// lay in no executable mapping: a corrupt stack or a wrong rule.
    pub const BAD_FRAME: u32 = 4;
    /// The target's stack could not be read (or the copy sent to the
    /// tracer ended before the stack did).
    pub const READ_FAILED: u32 = 5;
    /// A rule was missing and the stack copy could not be sent to the
    /// tracer (its ring was full).
    pub const COPY_LOST: u32 = 6;
    /// Internal to the BPF walk: a rule is missing (never stored).
    pub const MISS: u32 = 7;
    /// A rule was missing and the kernel's map of rules is full
    /// (`--unwind-rules-size`): no more walks are handed to the tracer.
    pub const RULES_FULL: u32 = 8;
    /// The host scope: a walk handed to the tracer whose process was gone
    /// (its mappings with it) before the tracer took it up.
    pub const GONE: u32 = 9;
    pub const N: usize = 10;
}

/// Start of the stack hash.
pub const STACK_HASH_SEED: u64 = 0xcbf2_9ce4_8422_2325;
const STACK_HASH_PRIME: u64 = 0x0000_0100_0000_01b3;

/// One return address into the stack hash (FNV-1a over words).
#[inline(always)]
pub const fn stack_hash_step(hash: u64, ra: u64) -> u64 {
    (hash ^ ra).wrapping_mul(STACK_HASH_PRIME)
}

/// The stack's key in `STACKS` and `CountKey::stack`: the frames' hash and
/// why the walk stopped. Its low two bits are `10`, never a reserved value.
#[inline(always)]
pub const fn stack_hash_finish(hash: u64, stop: u32) -> u64 {
    (stack_hash_step(hash, stop as u64) & !3) | 2
}

/// Live mode: `CountKey::stack` of a call whose walk the tracer finishes
/// (low bits `11`, the rest a sequence number matched with its
/// [`MissEvent`]).
pub const fn miss_stack_id(seq: u64) -> u64 {
    (seq << 2) | 3
}

pub const fn is_miss_stack_id(stack: u64) -> bool {
    stack & 3 == 3
}

/// Most bytes of the target's stack a [`MissEvent`] carries (from the
/// frame where the rule was missing): enough for the deep stacks of
/// compilers and interpreters (the sizes measured are in
/// docs/design/0017-deep-stack-copies.md). A stack deeper than that is
/// copied in two parts: its first `STACK_COPY - STACK_COPY_TAIL` bytes
/// and its last [`STACK_COPY_TAIL`] (the outermost frames), so that a
/// walk whose frames only skip over what lies between (the inside of a
/// large frame, as a compiler thread's) still ends whole. A walk that
/// needs a word between runs out of copy (`read_failed`). At most 64
/// pages, one bit each in `MissEvent::holes`.
pub const STACK_COPY: usize = 256 * 1024;

/// The bytes at the end of a [`STACK_COPY`] that hold the top of a stack
/// deeper than the copy (a multiple of the page).
pub const STACK_COPY_TAIL: usize = 128 * 1024;

/// Most return addresses hidden by return probes (see `MissEvent::hidden`)
/// a [`MissEvent`] carries.
pub const MAX_HIDDEN: usize = 8;

/// A walk the BPF side could not finish for want of a rule, with a copy of
/// the stack from there up. The tracer finishes the walk, adds the rules,
/// and counts the call under its whole stack.
///
/// The BPF side sends the smallest of [`MISS_COPY_SIZES`] that holds the
/// stack up to the end of its mapping (`MissEvent<N>`): a record is the
/// header, the same for every `N`, and `N` bytes of copy. The tracer reads
/// any of them into the largest.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MissEvent<const N: usize = STACK_COPY> {
    /// [`miss_stack_id`]: what live mode's events carry as the stack.
    pub stack_id: u64,
    pub func: u32,
    /// Thread id when split per thread, else 0.
    pub tid: u32,
    /// The direct caller (`CountKey::caller`).
    pub caller: u64,
    /// What the call adds to its stack's counts (16.16 when sampled).
    pub calls: u64,
    pub bytes: u64,
    /// Frames walked so far (above the caller), the last being `ra`, or
    /// none when `ra` is the caller.
    pub n: u32,
    /// Bytes of `copy` that hold the stack (from the start of the page of
    /// `sp - 8`), holes included.
    pub copied: u32,
    /// Where `sp - 8` is in `copy`: the copy starts at the beginning of its
    /// page, so that it can be read a page at a time.
    pub skip: u32,
    /// Bytes of `copy` read from the start of the page of `sp - 8`; the
    /// rest of `copied` (a stack deeper than the copy: its last
    /// [`STACK_COPY_TAIL`] bytes) from `tail_at`.
    pub head: u32,
    /// Bit `i`: page `i` of the copy could not be read (a page of the stack
    /// never touched, under a large local buffer; zeroes in `copy`).
    pub holes: u64,
    /// Where the copy's tail was read from (0: no tail).
    pub tail_at: u64,
    /// The return address without a rule, the CFA of the frame below it
    /// (the stack pointer of `ra`'s frame) and rbp there.
    pub ra: u64,
    pub sp: u64,
    pub bp: u64,
    /// Non-zero when `bp` is known.
    pub bp_ok: u64,
    /// The host scope: the calling process and its address space (0 for a
    /// traced process's walk), whose `frames` are [`crate::host_frame`]s.
    pub tgid: u64,
    pub mm: u64,
    /// The host scope: `ra` as a [`crate::host_frame`] (its file and
    /// offset, as the kernel found them).
    pub ra_frame: u64,
    /// The host scope: the direct caller as a [`crate::host_frame`] (its
    /// row's place when the process is gone before the tracer reads its
    /// mappings).
    pub caller_frame: u64,
    /// The host scope: the process's incarnation, the probed function's
    /// address and an address in the executable's code (0: unknown). The
    /// kernel remembers the mappings of these, of `ra` and of `caller` in
    /// `HOST_VMAS` under the incarnation, so that a walk whose process is
    /// gone is finished in the files those mappings name.
    pub gen: u64,
    pub ip: u64,
    pub exe: u64,
    /// The kernel's return-probe trampoline in this process, and each
    /// pending return probe's stack slot with the return address it hid
    /// there (`[0, 0]`: none): where `copy` holds the trampoline at such a
    /// slot, the walk goes on from the hidden address.
    pub trampoline: u64,
    pub hidden: [[u64; 2]; MAX_HIDDEN],
    pub frames: [u64; MAX_FRAMES],
    /// The thread's Python frames (`py_n` words, see
    /// [`crate::py_frame_words`]), to follow the native ones once the walk
    /// is finished.
    pub py_n: u32,
    /// The host scope's: 1 when the kernel knew no interpreter of the
    /// process at the call (its Python frames not looked for).
    pub python_unread: u32,
    pub py: [u64; 2 * crate::PY_MAX_FRAMES],
    /// The target's stack from the page of `sp - 8` (where `ra` itself is,
    /// `skip` bytes in) up.
    pub copy: [u8; N],
}

impl<const N: usize> MissEvent<N> {
    /// Where the stack's word at `addr` is in `copy`; `None` when it was
    /// not copied.
    pub fn copy_offset(&self, addr: u64) -> Option<usize> {
        let copied = (self.copied as usize).min(N) as u64;
        let head = (self.head as u64).min(copied);
        let base = self.sp.wrapping_sub(8) & !4095;
        if let Some(d) = addr.checked_sub(base) {
            if d < head && head - d >= 8 {
                return Some(d as usize);
            }
        }
        let tail = copied - head;
        match addr.checked_sub(self.tail_at) {
            Some(d) if self.tail_at != 0 && d < tail && tail - d >= 8 => Some((head + d) as usize),
            _ => None,
        }
    }
}

/// The sizes of stack copy a [`MissEvent`] comes in: most stacks at a
/// malloc fit in a few KiB, and a ring of 32 KiB records held ~120 walks
/// a MiB; the largest are for the few threads whose stacks are deeper.
pub const MISS_COPY_SIZES: [usize; 7] = [4096, 8192, 16384, 32768, 65536, 131072, STACK_COPY];

const _: () = assert!(STACK_COPY / 4096 <= 64);
const _: () = assert!(STACK_COPY_TAIL & 4095 == 0 && STACK_COPY_TAIL < STACK_COPY);

/// Bytes of a [`MissEvent`] before its copy.
pub const MISS_HEADER_BYTES: usize = core::mem::offset_of!(MissEvent, copy);

const _: () = assert!(MISS_HEADER_BYTES & 7 == 0);
// A record shorter than a miss's header is a Python notice.
const _: () = assert!(core::mem::size_of::<crate::PyNotice>() < MISS_HEADER_BYTES);
const _: () = assert!(
    core::mem::size_of::<MissEvent<4096>>() == MISS_HEADER_BYTES + 4096
        && core::mem::offset_of!(MissEvent<4096>, copy) == MISS_HEADER_BYTES
);
