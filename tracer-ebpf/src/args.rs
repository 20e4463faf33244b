//! Attach cookies and call arguments: which function a probe is on, its
//! role, and where the probe finds the size and the block.

use aya_ebpf::{
    bindings::pt_regs, helpers::bpf_probe_read_kernel, programs::ProbeContext, EbpfContext,
};
use tracer_common::{
    Role, COOKIE_ARGS_SHIFT, COOKIE_INLINE_SIZE_MASK, COOKIE_INLINE_SIZE_SHIFT, COOKIE_ROLE_SHIFT,
    MAX_FUNCS,
};

/// What an entry probe passes on to the return probe in live mode.
#[derive(Clone, Copy, Default)]
pub(crate) struct ReturnArgs {
    pub(crate) old_ptr: u64,
    pub(crate) memptr: u64,
}

impl ReturnArgs {
    /// What a call that releases or resizes `ptr` passes on.
    #[inline(always)]
    pub(crate) fn resizing(ptr: u64) -> ReturnArgs {
        ReturnArgs {
            old_ptr: ptr,
            memptr: 0,
        }
    }
}

/// Argument `n` (0: `rdi`, 1: `rsi`, 2: `rdx`, 3: `rcx`) where the probe
/// finds it: in its own register unless the cookie says the prologue
/// before the probe moved it (see `COOKIE_ARGS_SHIFT`).
#[inline(always)]
pub(crate) fn probe_arg(ctx: &ProbeContext, cookie: u64, n: usize) -> u64 {
    let at = (cookie >> (COOKIE_ARGS_SHIFT as usize + 4 * n)) & 0xf;
    if at == 0 {
        return ctx.arg::<u64>(n).unwrap_or(0);
    }
    // Which saved register: a variable offset into the context, which the
    // verifier lets a program read only through the helper (a direct load
    // at a computed offset is refused). Taken from a table, not a `match`:
    // the verifier would follow each arm on its own.
    let offset = REGISTER_OFFSETS[(at & 0xf) as usize] as u64;
    let at = (ctx.regs as u64).wrapping_add(offset) as *const u64;
    // SAFETY: the helper checks the read.
    unsafe { bpf_probe_read_kernel(at) }.unwrap_or(0)
}

/// Where each register code of `COOKIE_ARGS_SHIFT` (1 to 15) is saved in
/// the probe's registers.
static REGISTER_OFFSETS: [u16; 16] = [
    0,
    core::mem::offset_of!(pt_regs, rdi) as u16,
    core::mem::offset_of!(pt_regs, rsi) as u16,
    core::mem::offset_of!(pt_regs, rdx) as u16,
    core::mem::offset_of!(pt_regs, rcx) as u16,
    core::mem::offset_of!(pt_regs, r8) as u16,
    core::mem::offset_of!(pt_regs, r9) as u16,
    core::mem::offset_of!(pt_regs, rax) as u16,
    core::mem::offset_of!(pt_regs, r10) as u16,
    core::mem::offset_of!(pt_regs, r11) as u16,
    core::mem::offset_of!(pt_regs, rbx) as u16,
    core::mem::offset_of!(pt_regs, rbp) as u16,
    core::mem::offset_of!(pt_regs, r12) as u16,
    core::mem::offset_of!(pt_regs, r13) as u16,
    core::mem::offset_of!(pt_regs, r14) as u16,
    core::mem::offset_of!(pt_regs, r15) as u16,
];

/// The block an inlined copy's probe reads: argument 0 where the cookie
/// says, or when the cookie's bits from `COOKIE_INLINE_SIZE_SHIFT` are
/// not 0, in memory that many bytes less 1 past that register (code 0:
/// the stack pointer).
#[inline(always)]
pub(crate) fn block_arg(ctx: &ProbeContext, cookie: u64) -> u64 {
    let at = (cookie >> COOKIE_INLINE_SIZE_SHIFT) & COOKIE_INLINE_SIZE_MASK;
    if at == 0 {
        return probe_arg(ctx, cookie, 0);
    }
    let base = if (cookie >> COOKIE_ARGS_SHIFT) & 0xf == 0 {
        unsafe { (*ctx.regs).rsp }
    } else {
        probe_arg(ctx, cookie, 0)
    };
    let addr = base.wrapping_add(at - 1);
    unsafe { aya_ebpf::helpers::bpf_probe_read_user(addr as *const u64) }.unwrap_or(0)
}

/// The probe's attach cookie: the function's index in the run's function
/// table, its role and where the probe finds its arguments.
#[inline(always)]
pub(crate) fn attach_cookie(ctx: &ProbeContext) -> u64 {
    unsafe { aya_ebpf::helpers::generated::bpf_get_attach_cookie(ctx.as_ptr()) }
}

/// No cookie taken yet (a real one is far smaller).
pub(crate) const NO_COOKIE: u64 = u64::MAX;

/// `cookie`, or the probe's when that is [`NO_COOKIE`].
#[inline(always)]
pub(crate) fn cookie_or(cookie: u64, ctx: &ProbeContext) -> u64 {
    if cookie != NO_COOKIE {
        cookie
    } else {
        attach_cookie(ctx)
    }
}

/// The size an allocating call asks for and what it passes on to its
/// return probe, by its role (see `COOKIE_ROLE_SHIFT`).
#[inline(always)]
pub(crate) fn call_args(ctx: &ProbeContext, cookie: u64) -> (u64, ReturnArgs) {
    let role = (cookie >> COOKIE_ROLE_SHIFT) & 0xff;
    // An inlined copy of CPython's object allocator whose size the
    // compiler made a constant.
    let fixed = (cookie >> COOKIE_INLINE_SIZE_SHIFT) & COOKIE_INLINE_SIZE_MASK;
    if fixed != 0 && cookie != NO_COOKIE {
        let extra = if role == Role::Resize as u64 {
            ReturnArgs::resizing(probe_arg(ctx, cookie, 0))
        } else {
            ReturnArgs::default()
        };
        (fixed, extra)
    } else if role == Role::CountSize as u64 {
        // `f(n, size)`: calloc.
        (
            saturating_product(probe_arg(ctx, cookie, 0), probe_arg(ctx, cookie, 1)),
            ReturnArgs::default(),
        )
    } else if role == Role::AlignSize as u64 {
        // `f(align, size)`: memalign, aligned_alloc.
        (probe_arg(ctx, cookie, 1), ReturnArgs::default())
    } else if role == Role::Resize as u64 {
        // `f(ptr, size)`: realloc.
        (
            probe_arg(ctx, cookie, 1),
            ReturnArgs::resizing(probe_arg(ctx, cookie, 0)),
        )
    } else if role == Role::ResizeArray as u64 {
        // `f(ptr, n, size)`: reallocarray.
        (
            saturating_product(probe_arg(ctx, cookie, 1), probe_arg(ctx, cookie, 2)),
            ReturnArgs::resizing(probe_arg(ctx, cookie, 0)),
        )
    } else if role == Role::PosixMemalign as u64 {
        // `f(&ptr, align, size)`: posix_memalign.
        let extra = ReturnArgs {
            old_ptr: 0,
            memptr: probe_arg(ctx, cookie, 0),
        };
        (probe_arg(ctx, cookie, 2), extra)
    } else if role == Role::ResizeInPlace as u64 {
        // `f(ptr, size, ...)` resizing in place: jemalloc's xallocx
        // (count and sampled modes only).
        (probe_arg(ctx, cookie, 1), ReturnArgs::default())
    } else if role == Role::ResizeRust as u64 {
        // `f(ptr, old_size, align, new_size)`: Rust's __rust_realloc.
        (
            probe_arg(ctx, cookie, 3),
            ReturnArgs::resizing(probe_arg(ctx, cookie, 0)),
        )
    } else {
        // `f(size)`: malloc, valloc, pvalloc, operator new, ...
        (probe_arg(ctx, cookie, 0), ReturnArgs::default())
    }
}

/// `n * m`, saturating. Done on 32-bit halves: LLVM turns the usual
/// overflow checks into a 128-bit multiply, which the BPF target lacks.
#[inline(always)]
fn saturating_product(n: u64, m: u64) -> u64 {
    let (n_hi, n_lo) = (n >> 32, n & 0xffff_ffff);
    let (m_hi, m_lo) = (m >> 32, m & 0xffff_ffff);
    if n_hi != 0 && m_hi != 0 {
        return u64::MAX;
    }
    let cross = n_hi * m_lo + n_lo * m_hi;
    if cross >> 32 != 0 {
        return u64::MAX;
    }
    let low = n_lo * m_lo;
    let sum = low.wrapping_add(cross << 32);
    if sum < low {
        u64::MAX
    } else {
        sum
    }
}

/// The probed function's index in the run's function table: the probe's
/// attach cookie (masked, so that it always indexes the counters).
#[inline(always)]
pub(crate) fn cookie_func(ctx: *mut core::ffi::c_void) -> u32 {
    (unsafe { aya_ebpf::helpers::generated::bpf_get_attach_cookie(ctx) } as u32) & (MAX_FUNCS - 1)
}
