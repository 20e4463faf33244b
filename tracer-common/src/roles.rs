//! Roles: what a probe reads at the allocator function's entry and return.
//!
//! `malloc`, `valloc`, `operator new` and `mi_malloc` all take the size in
//! the first argument and return the block, so they share [`Role::Size`].
//! Which function fired, and its role, are in the probe's attach cookie:
//! an index into the run's function table that the tracer builds (symbol
//! -> role -> display name), and the role, which one entry program reads
//! to find the size.

/// Most functions one run probes (the width of the per-function counters).
pub const MAX_FUNCS: u32 = 64;

/// The attach cookie: the function's index in the run's table in the low
/// bits, and from bit [`COOKIE_ARGS_SHIFT`] four bits per argument (the
/// first four, `rdi`, `rsi`, `rdx`, `rcx`) saying where the probe finds
/// it: 0 in its own register, else in register `ARG_REGS[v - 1]`. A probe
/// placed after a prologue that moved an argument (mimalloc's `malloc`
/// begins `mov %rdi,%rsi; mov %fs:..,%rdi`) reads it where it went.
pub const COOKIE_ARGS_SHIFT: u32 = 16;

/// The cookie's bits from 32 on: the function's [`Role`] (one entry
/// program serves every allocating role).
pub const COOKIE_ROLE_SHIFT: u32 = 32;

/// Registers an argument can be found in (see [`COOKIE_ARGS_SHIFT`]): the
/// scratch registers an entry probe's prologue can move it to, then the
/// callee-saved ones, where a copy of CPython's object allocator inlined
/// into its caller finds its size (see [`COOKIE_INLINE_SIZE_SHIFT`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgReg {
    Rdi,
    Rsi,
    Rdx,
    Rcx,
    R8,
    R9,
    Rax,
    R10,
    R11,
    Rbx,
    Rbp,
    R12,
    R13,
    R14,
    R15,
}

pub const ARG_REGS: [ArgReg; 15] = [
    ArgReg::Rdi,
    ArgReg::Rsi,
    ArgReg::Rdx,
    ArgReg::Rcx,
    ArgReg::R8,
    ArgReg::R9,
    ArgReg::Rax,
    ArgReg::R10,
    ArgReg::R11,
    ArgReg::Rbx,
    ArgReg::Rbp,
    ArgReg::R12,
    ArgReg::R13,
    ArgReg::R14,
    ArgReg::R15,
];

/// An inlined copy of CPython's object allocator (`alloc_inline`, see
/// `tracer-ebpf`): the cookie's bits from 40 on hold the size the copy
/// allocates when the compiler made it a constant, else 0 and the size is
/// argument 0 where the argument bits say.
pub const COOKIE_INLINE_SIZE_SHIFT: u32 = 40;

/// The constant size's bits (from [`COOKIE_INLINE_SIZE_SHIFT`]).
pub const COOKIE_INLINE_SIZE_MASK: u64 = 0xfff;

/// An inlined copy's number in live mode, from bit 52 (never 0), in the
/// cookies of its guard and of the place its block is known: the second
/// takes up the call the first began only if it is the same copy's.
pub const COOKIE_INLINE_ID_SHIFT: u32 = 52;

/// The largest request CPython's object allocator (pymalloc) serves itself
/// (`SMALL_REQUEST_THRESHOLD`); a larger one, or 0, falls through to
/// `malloc`, which counts it.
pub const PYMALLOC_MAX: u64 = 512;

#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// `f(size)` returns the block: malloc, valloc, pvalloc.
    Size = 0,
    /// `f(n, size)` returns `n * size` bytes: calloc.
    CountSize = 1,
    /// `f(align, size)` returns the block: memalign, aligned_alloc.
    AlignSize = 2,
    /// `f(ptr, size)` resizes `ptr`: realloc.
    Resize = 3,
    /// `f(ptr, n, size)` resizes `ptr` to `n * size`: reallocarray.
    ResizeArray = 4,
    /// `f(&ptr, align, size)` returns 0 and writes the block: posix_memalign.
    PosixMemalign = 5,
    /// `f(ptr)` releases `ptr`: free, operator delete, mi_free.
    Free = 6,
    /// `f(ptr, size, ...)` resizes `ptr` in place and returns a size, not a
    /// block: jemalloc's xallocx. Counted as a call; live mode does not
    /// probe it (the block keeps its address).
    ResizeInPlace = 7,
    /// `f(ptr, old_size, align, new_size)` resizes `ptr`: Rust's
    /// `__rust_realloc`.
    ResizeRust = 8,
}

impl Role {
    pub const ALL: [Role; 9] = [
        Role::Size,
        Role::CountSize,
        Role::AlignSize,
        Role::Resize,
        Role::ResizeArray,
        Role::PosixMemalign,
        Role::Free,
        Role::ResizeInPlace,
        Role::ResizeRust,
    ];

    /// The entry program of this role: one for every role that
    /// allocates (the role is in the cookie), one for releasing.
    pub const fn program(self) -> &'static str {
        match self {
            Role::Free => "release",
            _ => "alloc",
        }
    }

    /// Live mode: the return program, `None` for a function that only
    /// releases.
    pub const fn return_program(self) -> Option<&'static str> {
        match self {
            Role::Size | Role::CountSize | Role::AlignSize => Some("alloc_ret"),
            Role::Resize | Role::ResizeArray | Role::ResizeRust => Some("resize_ret"),
            Role::PosixMemalign => Some("posix_memalign_ret"),
            Role::Free | Role::ResizeInPlace => None,
        }
    }

    /// Does a call of this role allocate (count as an allocation call)?
    pub const fn allocates(self) -> bool {
        !matches!(self, Role::Free)
    }
}
