//! mtrace's BPF programs: one uprobe program for every allocating entry
//! point and one for the releasing ones, attached with an attach cookie
//! that holds the function's index in the run's function table, its role
//! (what its arguments mean, see `tracer_common::Role`) and where the
//! probe finds the arguments.
//!
//! Count mode aggregates in the kernel: per (user stack, direct caller,
//! function, thread) the number of calls and requested bytes, with atomic
//! adds so the counts stay exact on a multi-threaded target. Nothing is sent
//! to user space per event. Exact per-function totals and every way a sample
//! can lose its stack live in the per-CPU `COUNTERS` array.
#![no_std]
#![no_main]
// The intrinsics lower to the BPF atomic add and exchange instructions
// (the object is built for BPF CPU v3).
#![allow(internal_features)]
#![feature(core_intrinsics)]

use core::intrinsics::{atomic_xadd, atomic_xchg, AtomicOrdering};

use aya_ebpf::{
    bindings::{pt_regs, BPF_F_NO_PREALLOC, BPF_NOEXIST, BPF_RB_NO_WAKEUP},
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_prandom_u32, bpf_ktime_get_ns,
        bpf_probe_read_kernel, bpf_probe_read_user,
    },
    macros::{map, uprobe, uretprobe},
    maps::{Array, HashMap, PerCpuArray, PerCpuHashMap, Queue, RingBuf},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext,
};
use tracer_common::{
    counter, miss_stack_id, rule_slot, MISS_COPY_SIZES, CachedRule, RULE_CACHE_SLOTS, stack_hash_finish, stack_hash_step, stop, AllocEvent, Comm, Config,
    CountKey, CountValue, EntryMark, FreeEvent, LostFree, MissEvent, Pending, Role, StackFrames,
    UnwindRule, WalkMemo, WalkScratch, MARK_SLOTS, WALK_LEVELS, EVENT_ALLOC, MEMO_ENTRIES, MEMO_WORDS, EVENT_FREE, EVENT_RINGS, EXP_TABLE_LEN,
    COOKIE_ARGS_SHIFT, COOKIE_ROLE_SHIFT, MAX_BODY_RANGES, MAX_FRAMES, MAX_FUNCS, SAMPLE_BYTES, SAMPLE_EVERY, SAMPLE_NONE, STACK_CHUNK,
    STACK_COPY, STACK_HASH_SEED, STACK_NONE, WEIGHT_ONE, WEIGHT_TABLE_LEN,
    WEIGHT_TABLE_START,
};

const EEXIST: i32 = 17;

/// Written by the tracer before load (`EbpfLoader::set_global`).
#[no_mangle]
static CONFIG: Config = Config {
    per_thread: 0,
    live: 0,
    sample_mode: SAMPLE_NONE,
    max_frames: MAX_FRAMES as u32,
    sample_param: 0,
    sample_scale: 0,
    stack_start: 0,
    n_bodies: 0,
    _pad: 0,
    bodies: [tracer_common::BodyRange { start: 0, end: 0 }; MAX_BODY_RANGES],
    exp_table: [0; EXP_TABLE_LEN],
    weight_table: [0; WEIGHT_TABLE_LEN],
};

/// Sizes are placeholders: the tracer sets them before load. Per CPU, so
/// that threads on different CPUs counting the same stack do not fight
/// over one cache line; not preallocated, so that its memory grows with the
/// keys in use rather than with keys times CPUs.
#[map]
static COUNTS: PerCpuHashMap<CountKey, CountValue> =
    PerCpuHashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// Every distinct stack, once, under its hash. Inserted only when a new
/// aggregation key appears, so not preallocated.
#[map]
static STACKS: HashMap<u64, StackFrames> = HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

/// Scratch space of the stack walk, per CPU: a program takes the first
/// level whose flag in [`OWNER`] is free (a uprobe program can be
/// preempted mid-walk by another thread's on the same CPU) and holds it
/// until it returns.
#[map]
static WALK: PerCpuArray<WalkScratch> = PerCpuArray::with_max_entries(WALK_LEVELS, 0);

/// The threads' last counted allocator entries ([`EntryMark`]), slot by a
/// hash of the thread. Two threads whose hashes meet share a slot; each
/// CPU's last mark ([`CPU_MARK`]) covers the thread that finds its slot
/// taken, unless it also moved to another CPU in between.
#[map]
static MARKS: Array<EntryMark> = Array::with_max_entries(MARK_SLOTS, 0);

/// The last entry mark made on each CPU.
#[map]
static CPU_MARK: PerCpuArray<EntryMark> = PerCpuArray::with_max_entries(1, 0);

/// Remembered walks ([`WalkMemo`]), per CPU: a call whose stack holds the
/// words an earlier walk from the same place read is not walked again.
#[map]
static MEMO: PerCpuArray<WalkMemo> = PerCpuArray::with_max_entries(MEMO_ENTRIES + 1, 0);

/// The [`MEMO`] entry a walk that remembers nothing writes its notes in
/// (never read).
const MEMO_NOWHERE: u32 = MEMO_ENTRIES;

/// Unwind rules by return address, filled by the tracer (size set by the
/// tracer). Not preallocated: a process uses a few hundred of its 65,536
/// entries, and each traced process of a tree has its own (5 MiB each when
/// preallocated); a lookup costs the same.
#[map]
static UNWIND_RULES: HashMap<u64, UnwindRule> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// A direct-mapped cache in front of `UNWIND_RULES`, filled by the tracer
/// (slot [`rule_slot`] of the return address, when free).
#[map]
static RULE_CACHE: Array<CachedRule> = Array::with_max_entries(RULE_CACHE_SLOTS, 0);

/// Walks the tracer finishes (size set by the tracer).
#[map]
static UNWIND_MISSES: RingBuf = RingBuf::with_byte_size(1 << 22, 0);

/// Set by the tracer when `UNWIND_RULES` is full: walks that miss a rule
/// then end there instead of being handed over, again and again.
#[map]
static UNWIND_FULL: Array<u64> = Array::with_max_entries(1, 0);

/// Set by the tracer once every probe is attached, cleared when tracing
/// ends: by pid the probes go in one after the other while the target
/// runs, and without the flag `malloc` would count calls whose `free` is
/// not probed yet.
#[map]
static ENABLED: Array<u32> = Array::with_max_entries(1, 0);

#[inline(always)]
fn enabled() -> bool {
    ENABLED.get(0).is_some_and(|e| *e != 0)
}

/// Two halves: `[0, N)` updated with plain adds by the program that owns
/// its CPU (see [`OWNER`]), `[N, 2N)` with atomic adds by everything
/// else; the tracer adds the halves.
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(2 * counter::N, 0);

/// Per CPU and level of [`WALK`]: 1 while a program holds the level. The
/// program at level 0 owns its CPU's counts and updates them with plain
/// adds. A uprobe program can be preempted, by another thread that runs
/// the same program on the same CPU: that one takes a higher level and
/// adds atomically to counts of its own, so no plain read-modify-write is
/// ever interleaved with another on the same word. (An atomic add cost ~3
/// ns with one thread and ~18 ns with two on this VM; a hot call made
/// four.)
#[map]
static OWNER: PerCpuArray<u32> = PerCpuArray::with_max_entries(WALK_LEVELS, 0);

/// Takes the first free level of this CPU's walk scratch for a call from
/// the thread whose context is `ctx` ([`give_back`] must follow).
#[inline(always)]
fn take_scratch(ctx: &ProbeContext) -> Option<*mut WalkScratch> {
    let level = if take_level(0) { 0 } else { take_higher_level() };
    let w = WALK.get_ptr_mut(level)?;
    unsafe {
        core::ptr::write_volatile(&mut (*w).level, level as u64);
        core::ptr::write_volatile(&mut (*w).owned, (level == 0) as u64);
        // The context's address as a number: stored and read back (the
        // verifier allows no arithmetic on it).
        core::ptr::write_volatile(&mut (*w).me, ctx.regs as u64);
        // The thread id where the keys are split by thread, else 0 (a
        // helper call less).
        let tid = if config_u32(&CONFIG.per_thread) != 0 { bpf_get_current_pid_tgid() as u32 } else { 0 };
        core::ptr::write_volatile(&mut (*w).tid, tid as u64);
    }
    Some(w)
}

/// Takes level `level` of this CPU's walk scratch if it is free.
#[inline(always)]
fn take_level(level: u32) -> bool {
    OWNER
        .get_ptr_mut(level)
        .is_some_and(|flag| unsafe { atomic_xchg::<u32, { AtomicOrdering::Relaxed }>(flag, 1) } == 0)
}

/// The first free level above 0 (the program that holds level 0 was
/// preempted on this CPU), `WALK_LEVELS` when none is.
#[inline(never)]
fn take_higher_level() -> u32 {
    let mut level = 1;
    while level < WALK_LEVELS {
        if take_level(level) {
            return level;
        }
        level += 1;
    }
    WALK_LEVELS
}

/// Gives back the level [`take_scratch`] took.
#[inline(always)]
fn give_back(scratch: Option<*mut WalkScratch>) {
    if let Some(w) = scratch {
        let level = unsafe { core::ptr::read_volatile(&(*w).level) } as u32;
        if let Some(flag) = OWNER.get_ptr_mut(level) {
            unsafe { core::ptr::write_volatile(flag, 0) };
        }
    }
}

/// Whether the walk in `scratch` holds level 0 (owns the CPU's counts).
#[inline(always)]
fn owns_cpu(scratch: Option<*mut WalkScratch>) -> bool {
    scratch.is_some_and(|w| unsafe { core::ptr::read_volatile(&(*w).owned) } != 0)
}

/// Counts a call of `func` in the per-function totals and, given its key,
/// in the aggregation map (false when the key has no entry yet), with
/// plain adds when the program owns the CPU ([`OWNER`]).
#[inline(always)]
fn count_call(func: u32, calls: u64, bytes: u64, key: Option<&CountKey>, owned: bool) -> bool {
    bump_owned(counter::CALLS + func, calls, owned);
    bump_owned(counter::BYTES + func, bytes, owned);
    key.is_none_or(|k| add_to(k, calls, bytes, owned))
}

/// Adds to counter `index`: plainly when this program owns the CPU.
#[inline(always)]
fn bump_owned(index: u32, by: u64, owned: bool) {
    if !owned {
        return bump(index, by);
    }
    if let Some(p) = COUNTERS.get_ptr_mut(index) {
        unsafe { core::ptr::write_volatile(p, core::ptr::read_volatile(p) + by) };
    }
}


#[map]
static THREAD_NAMES: HashMap<u32, Comm> = HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

/// Sampled by bytes: bytes left until the next sample, per CPU. The byte
/// stream of each CPU is sampled as a Poisson process; a thread that moves
/// between CPUs just continues another CPU's countdown, which the
/// memorylessness of exponential intervals makes harmless.
#[map]
static COUNTDOWN: PerCpuArray<i64> = PerCpuArray::with_max_entries(1, 0);

/// Live mode: the thread's allocating call between its entry and its
/// return, in task-local storage (no shared hash map on the hot path).
#[unsafe(link_section = ".maps")]
#[unsafe(export_name = "PENDING")]
static PENDING: TaskStorage<Pending> = TaskStorage::new();

/// A BTF-defined task storage map (aya-ebpf 0.2.1 has none): one value per
/// thread, created on first use.
#[repr(C)]
struct TaskStorage<T> {
    r#type: *const [i32; aya_ebpf::bindings::bpf_map_type::BPF_MAP_TYPE_TASK_STORAGE as usize],
    key: *const i32,
    value: *const T,
    max_entries: *const [i32; 0],
    map_flags: *const [i32; BPF_F_NO_PREALLOC as usize],
}

// SAFETY: placeholders the loader reads from BTF; never dereferenced.
unsafe impl<T> Sync for TaskStorage<T> {}

impl<T> TaskStorage<T> {
    const fn new() -> Self {
        TaskStorage {
            r#type: core::ptr::null(),
            key: core::ptr::null(),
            value: core::ptr::null(),
            max_entries: core::ptr::null(),
            map_flags: core::ptr::null(),
        }
    }

    /// The current thread's value, created zeroed when `create`.
    #[inline(always)]
    fn current(&self, create: bool) -> Option<&mut T> {
        let p = unsafe {
            aya_ebpf::helpers::generated::bpf_task_storage_get(
                self as *const Self as *mut core::ffi::c_void,
                aya_ebpf::helpers::generated::bpf_get_current_task_btf(),
                core::ptr::null_mut(),
                if create {
                    aya_ebpf::bindings::BPF_LOCAL_STORAGE_GET_F_CREATE as u64
                } else {
                    0
                },
            )
        } as *mut T;
        unsafe { p.as_mut() }
    }
}

/// Live mode: allocation and free events for the tracer, which keeps the
/// table of outstanding blocks (no shared map updated per block on the
/// target's hot path). One ring per CPU (modulo `EVENT_RINGS`): a single
/// ring shared by all CPUs made two threads pay for each other's events.
/// Submitted without waking the tracer (a wake-up per event would cost
/// the target a context switch): the tracer drains the rings on a timer.
/// Sizes are set by the tracer.
macro_rules! event_rings {
    ($($name:ident),*) => {
        $(
            #[map]
            static $name: RingBuf = RingBuf::with_byte_size(4096, 0);
        )*
    };
}
event_rings!(EVENTS0, EVENTS1, EVENTS2, EVENTS3, EVENTS4, EVENTS5, EVENTS6, EVENTS7);

/// Live mode: frees whose event found the ring full (see `LostFree`), in
/// order; sized by the tracer.
#[map]
static LOST_FREES: Queue<LostFree> = Queue::with_max_entries(1, 0);

/// Sends one event on this CPU's ring; the time stamp is taken once the
/// space is reserved (see `AllocEvent::ts`). False when the ring is full.
#[inline(always)]
fn send<T: 'static>(make: impl Fn(u64) -> T) -> bool {
    let cpu = unsafe { aya_ebpf::helpers::bpf_get_smp_processor_id() } % EVENT_RINGS;
    // One call site per ring: the verifier wants each reservation's map
    // known.
    let entry = match cpu {
        0 => EVENTS0.reserve::<T>(0),
        1 => EVENTS1.reserve::<T>(0),
        2 => EVENTS2.reserve::<T>(0),
        3 => EVENTS3.reserve::<T>(0),
        4 => EVENTS4.reserve::<T>(0),
        5 => EVENTS5.reserve::<T>(0),
        6 => EVENTS6.reserve::<T>(0),
        _ => EVENTS7.reserve::<T>(0),
    };
    match entry {
        Some(mut entry) => {
            entry.write(make(now_ns()));
            entry.submit(BPF_RB_NO_WAKEUP as u64);
            true
        }
        None => {
            bump(counter::EVENTS_LOST, 1);
            false
        }
    }
}

/// A free (or the block a resize released, if born by `born_by`) that the
/// ring had no room for: kept for the tracer, which applies it in its time
/// order. It is queued before the allocator can hand the block out again,
/// so the tracer, reading the queue after the rings, never sees the block's
/// next allocation without it.
#[inline(always)]
fn keep_free(ptr: u64, born_by: Option<u64>) {
    let ts = now_ns();
    let kept = LostFree {
        ptr,
        ts,
        born_by: born_by.unwrap_or(ts),
    };
    if LOST_FREES.push(&kept, 0).is_ok() {
        bump(counter::FREES_KEPT, 1);
    } else {
        bump(counter::FREES_LOST, 1);
    }
}

#[inline(always)]
fn bump(index: u32, by: u64) {
    if let Some(p) = COUNTERS.get_ptr_mut(index + counter::N) {
        // Per-CPU, but a uprobe program can be preempted: stay atomic.
        atomic_add(p, by);
    }
}

#[inline(always)]
fn atomic_add(p: *mut u64, by: u64) {
    unsafe {
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, by);
    }
}

#[inline(always)]
fn now_ns() -> u64 {
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
fn config_u32(field: &u32) -> u32 {
    unsafe { core::ptr::read_volatile(field) }
}

/// Is `addr` inside one of the probed allocator functions? Then this call
/// is the allocator calling itself and was counted by the outer call.
#[inline(always)]
fn in_allocator_body(addr: u64) -> bool {
    // The ranges are sorted and do not overlap: the last one starting at or
    // below `addr` is the only candidate. Six halvings cover 64.
    let n = config_u32(&CONFIG.n_bodies) as usize;
    let (mut lo, mut hi) = (0usize, n.min(MAX_BODY_RANGES));
    let mut step = 0;
    while step < 7 {
        if lo >= hi {
            break;
        }
        let mid = ((lo + hi) / 2) & (MAX_BODY_RANGES - 1);
        let start = unsafe { core::ptr::read_volatile(&CONFIG.bodies[mid].start) };
        if addr < start {
            hi = mid;
        } else {
            lo = mid + 1;
        }
        step += 1;
    }
    if lo == 0 {
        return false;
    }
    let r = unsafe { core::ptr::read_volatile(&CONFIG.bodies[(lo - 1) & (MAX_BODY_RANGES - 1)]) };
    addr >= r.start && addr < r.end
}

/// What an entry probe passes on to the return probe in live mode.
#[derive(Clone, Copy, Default)]
struct Extra {
    old_ptr: u64,
    memptr: u64,
}

/// Sampling: `None` to skip this call, else its weight in 16.16 (one
/// without sampling). An unsampled call costs a countdown, nothing more.
#[inline(always)]
fn sample_weight(size: u64) -> Option<u64> {
    let mode = config_u32(&CONFIG.sample_mode);
    if mode == SAMPLE_NONE {
        return Some(WEIGHT_ONE);
    }
    let rate = unsafe { core::ptr::read_volatile(&CONFIG.sample_param) };
    if rate == 0 {
        return Some(WEIGHT_ONE);
    }
    if mode != SAMPLE_EVERY && mode != SAMPLE_BYTES {
        return Some(WEIGHT_ONE);
    }
    // What is left until the next sample on this CPU: calls (one-in-N) or
    // bytes. A countdown costs an unsampled call a load and a store; a
    // random number and a division per call cost more.
    let left = COUNTDOWN.get_ptr_mut(0)?;
    let used = if mode == SAMPLE_EVERY { 1 } else { size as i64 };
    let remaining = unsafe { *left } - used;
    if remaining > 0 {
        unsafe { *left = remaining };
        return None;
    }
    let i = (unsafe { bpf_get_prandom_u32() } as usize) & (EXP_TABLE_LEN - 1);
    let e = unsafe { core::ptr::read_volatile(&CONFIG.exp_table[i]) } as u64;
    if mode == SAMPLE_EVERY {
        // The next geometric gap: floor(scale * E) + 1 calls.
        let scale = unsafe { core::ptr::read_volatile(&CONFIG.sample_scale) };
        unsafe { *left = (weighted_bytes(scale, e) >> 16) as i64 + 1 };
        return Some(rate << 16);
    }
    // Sampled: the next exponential interval of bytes.
    unsafe { *left = ((rate.wrapping_mul(e)) >> 16) as i64 + 1 };
    Some(bytes_weight(size, rate))
}

/// Weight of a block of `size` bytes sampled at one per `rate` bytes:
/// `1 / (1 - exp(-size / rate))`, the inverse of its chance to be sampled,
/// which makes calls and bytes estimates unbiased.
#[inline(always)]
fn bytes_weight(size: u64, rate: u64) -> u64 {
    if size == 0 {
        return WEIGHT_ONE;
    }
    // checked_div: a division the compiler cannot prove safe would leave a
    // panic path, which the verifier rejects.
    let x256 = (size << 8).checked_div(rate).unwrap_or(u64::MAX);
    if x256 < WEIGHT_TABLE_START {
        // x < 1/2: 1/x + 1/2 + x/12, within 2e-5.
        return (rate << 16).checked_div(size).unwrap_or(0)
            + WEIGHT_ONE / 2
            + (size << 16).checked_div(rate.wrapping_mul(12)).unwrap_or(0);
    }
    let i = (x256 - WEIGHT_TABLE_START) as usize;
    if i >= WEIGHT_TABLE_LEN {
        return WEIGHT_ONE;
    }
    unsafe { core::ptr::read_volatile(&CONFIG.weight_table[i]) as u64 }
}

/// `size * weight >> 16` without overflowing.
#[inline(always)]
fn weighted_bytes(size: u64, weight: u64) -> u64 {
    (size >> 16).wrapping_mul(weight) + (((size & 0xffff) * weight) >> 16)
}

/// Is this call a tail call from another allocator function that was
/// just counted? It arrives with the same stack pointer and return address
/// (glibc's reallocarray -> realloc -> malloc; operator delete -> free).
/// The mark stays, so a chain of tail calls is counted once; the next
/// counted call replaces it. The thread's mark is in its slot of
/// [`MARKS`] unless another thread took the slot since: then in its CPU's
/// last mark, unless another thread counted a call there since too.
#[inline(always)]
fn tail_called(scratch: Option<*mut WalkScratch>, sp: u64, ret: u64, ip: u64) -> bool {
    let Some(w) = scratch else {
        return false;
    };
    let me = unsafe { core::ptr::read_volatile(&(*w).me) };
    let slot = ((me >> 14).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52) as u32 & (MARK_SLOTS - 1);
    let (Some(mine), Some(cpu)) = (MARKS.get_ptr_mut(slot), CPU_MARK.get_ptr_mut(0)) else {
        return false;
    };
    let last = unsafe {
        if (*mine).me == me {
            *mine
        } else {
            *cpu
        }
    };
    if last.me == me && last.sp == sp && last.ret == ret && last.ip != ip {
        return true;
    }
    let mark = EntryMark { me, ip, sp, ret };
    unsafe {
        *mine = mark;
        *cpu = mark;
    }
    false
}

/// A call of a releasing function (`ptr` is the block). It needs no stack
/// and no nesting check: a free the allocator makes itself, as
/// realloc(p, 0) does, is a free all the same. Count mode wants the number
/// of frees; live mode, which block went when. Sampled, frees are not
/// counted at all. Only a tail call from another release function
/// (operator delete jumping to free) is the same free again.
#[inline(always)]
fn record_free(ctx: &ProbeContext, cookie: u64, ptr: u64) -> u32 {
    if !enabled() {
        return 0;
    }
    let func = (cookie as u32) & (MAX_FUNCS - 1);
    let (sp, ip) = unsafe { ((*ctx.regs).rsp, (*ctx.regs).rip) };
    let ret = unsafe { bpf_probe_read_user(sp as *const u64) }.unwrap_or(0);
    // (Without a scratch level, all four taken on this CPU, the tail-call
    // check cannot run.)
    let scratch = take_scratch(ctx);
    let tail = tail_called(scratch, sp, ret, ip);
    give_back(scratch);
    if tail {
        bump(counter::NESTED, 1);
        return 0;
    }
    if config_u32(&CONFIG.sample_mode) == SAMPLE_NONE {
        bump(counter::CALLS + func, 1);
    }
    if config_u32(&CONFIG.live) != 0 && ptr != 0 {
        send_free(ptr);
    }
    0
}

/// A call of an allocating function. Its attach cookie (which function,
/// where its size is) is taken late: a call that takes a remembered walk
/// finds it in the walk's entry, a helper call less. Sampled, the size
/// decides first whether the call is taken at all.
#[inline(always)]
fn record(ctx: &ProbeContext) -> u32 {
    if !enabled() {
        return 0;
    }
    let sampled = config_u32(&CONFIG.sample_mode) != SAMPLE_NONE;
    let (mut early, mut weight) = (NO_COOKIE, WEIGHT_ONE);
    if sampled {
        let cookie = attach_cookie(ctx);
        let Some(w) = sample_weight(call_args(ctx, cookie).0) else {
            return 0;
        };
        (early, weight) = (cookie, w);
    }
    let scratch = take_scratch(ctx);
    record_in(ctx, scratch, early, weight);
    give_back(scratch);
    0
}

/// [`record`] with a scratch level taken.
#[inline(always)]
fn record_in(ctx: &ProbeContext, scratch: Option<*mut WalkScratch>, early: u64, weight: u64) {
    let sampled = config_u32(&CONFIG.sample_mode) != SAMPLE_NONE;
    let live = config_u32(&CONFIG.live) != 0;
    let (sp, ip) = unsafe { ((*ctx.regs).rsp, (*ctx.regs).rip) };
    // The direct caller's return address is at [rsp]. Read the stack from
    // there a chunk at a time: the same read usually holds the first
    // frames of the walk too (without a walk, the caller alone).
    let walks = config_u32(&CONFIG.max_frames) != 0;
    let caller = match scratch {
        Some(w) if walks && load_chunk(unsafe { &mut *w }, sp) => unsafe { (*w).chunk[0] },
        Some(_) if !walks => unsafe { bpf_probe_read_user(sp as *const u64) }.unwrap_or(0),
        _ => 0,
    };
    if caller == 0 {
        bump(counter::CALLER_READ_FAILED, 1);
    }
    // A remembered walk from here, looked for first: a call from the same
    // place passed the nesting check before.
    let remembered = match scratch {
        Some(w) => unsafe {
            let bp = (*ctx.regs).rbp;
            start_walk(&mut *w, caller, sp, bp, ip);
            caller != 0 && (*w).limit != 0 && memo_find(w, caller, sp, bp, ip)
        },
        None => false,
    };
    // In live mode the pending entry below is the nesting check.
    if !live && caller != 0 && !remembered && in_allocator_body(caller) {
        bump(counter::NESTED, 1);
        return;
    }
    let mut pending = None;
    if live {
        // In live mode the outer call's pending entry says exactly when the
        // thread is inside the allocator (the return probes have replaced
        // return addresses, so the marks below would not match).
        pending = PENDING.current(true);
        match &pending {
            Some(p) if p.active != 0 && sp <= p.sp => {
                bump(counter::NESTED, 1);
                return;
            }
            Some(_) => {}
            None => bump(counter::PENDING_FULL, 1),
        }
    } else if tail_called(scratch, sp, caller, ip) {
        bump(counter::NESTED, 1);
        return;
    }
    let per_thread = config_u32(&CONFIG.per_thread) != 0;
    let tid = match scratch {
        Some(w) => unsafe { core::ptr::read_volatile(&(*w).tid) as u32 },
        None if per_thread => bpf_get_current_pid_tgid() as u32,
        None => 0,
    };
    let key_tid = tid;
    let (stack, walk, cookie) = walk_stack(ctx, scratch, caller, key_tid, early);
    let func = (cookie as u32) & (MAX_FUNCS - 1);
    let (size, extra) = call_args(ctx, cookie);
    let (calls_inc, bytes_inc) = if sampled {
        bump(counter::SAMPLES, 1);
        (weight, weighted_bytes(size, weight))
    } else {
        (1, size)
    };
    let owned = owns_cpu(walk);
    // A walk that met a return address without a rule goes to the tracer
    // with a copy of the stack; the tracer counts the call (under the same
    // key the walk would have made) and adds the missing rules.
    let stack = match walk {
        Some(w) if unsafe { (*w).stack.stop } == stop::MISS => {
            match send_miss(unsafe { &mut *w }, func, key_tid, caller, calls_inc, bytes_inc) {
                Some(id) => {
                    count_call(func, calls_inc, bytes_inc, None, owned);
                    if let Some(p) = pending {
                        set_pending(p, caller, id, func, key_tid, size, extra, sp);
                    }
                    return;
                }
                None => {
                    let why = match unsafe { (*w).stack.stop } {
                        stop::RULES_FULL => stop::RULES_FULL,
                        _ => stop::COPY_LOST,
                    };
                    finish_hash(unsafe { &mut *w }, why)
                }
            }
        }
        _ => stack,
    };
    let key = CountKey {
        stack,
        func,
        tid: key_tid,
        caller,
    };
    if let Some(p) = pending {
        set_pending(p, caller, stack, func, key_tid, size, extra, sp);
    }
    // A remembered walk of this key counts the call itself; else the map.
    let in_memo = owned
        && matches!(walk, Some(w) if unsafe { (*w).memo_hit } != 0 && memo_count(w, func, key_tid, calls_inc, bytes_inc));
    let counted = count_call(func, calls_inc, bytes_inc, (!in_memo).then_some(&key), owned);
    if !counted && insert_count(&key, calls_inc, bytes_inc, 1) {
        if per_thread {
            name_thread(tid);
        }
        // A new key: make sure its stack is stored (once per stack). A
        // remembered walk has no frames: walk again for them.
        let walk = match walk {
            Some(w) if unsafe { (*w).memo_hit } != 0 => {
                if memo_frames(w) {
                    Some(w)
                } else {
                    bump(counter::STACK_WALK_FAILED, 1);
                    None
                }
            }
            other => other,
        };
        if let Some(w) = walk {
            if let Err(e) = STACKS.insert(&stack, unsafe { &(*w).stack }, BPF_NOEXIST as u64) {
                if e != -EEXIST {
                    bump(counter::STACK_MAP_FULL, 1);
                }
            }
        }
    }
}

/// Live mode: the call is in flight until its return probe.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn set_pending(
    p: &mut Pending,
    caller: u64,
    stack: u64,
    func: u32,
    tid: u32,
    size: u64,
    extra: Extra,
    sp: u64,
) {
    *p = Pending {
        key: CountKey {
            stack,
            func,
            tid,
            caller,
        },
        size,
        old_ptr: extra.old_ptr,
        memptr: extra.memptr,
        // Only a resize needs to know when it began.
        entry_ts: if extra.old_ptr != 0 { now_ns() } else { 0 },
        sp,
        active: 1,
    };
}

/// One `bpf_loop` step of the walk: up to `FRAMES_PER_STEP` frames (a
/// callback call per frame cost more than the frame).
#[inline(never)]
extern "C" fn unwind_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    // The entry the walk notes its stack words in (looked up once a step).
    let Some(e) = MEMO.get_ptr_mut(w.check_slot as u32) else {
        return 1;
    };
    let mut k = 0;
    while k < FRAMES_PER_STEP {
        if unwind_frame(w, e) != 0 {
            return 1;
        }
        k += 1;
    }
    0
}

const FRAMES_PER_STEP: usize = 8;

/// The rule of return address `ra`: from the direct-mapped cache (an array
/// lookup the verifier inlines), else from the hash map.
#[inline(always)]
fn rule_of(ra: u64) -> Option<UnwindRule> {
    if let Some(slot) = RULE_CACHE.get(rule_slot(ra)) {
        // The tracer fills a slot while the target runs, the rule first
        // and its address after (two updates): the address is read first,
        // so a slot that names `ra` holds its whole rule.
        let cached = unsafe { core::ptr::read_volatile(&slot.ra) };
        if cached == ra {
            // One 8-byte load (a volatile struct read is one per field).
            let bits = unsafe { core::ptr::read_volatile(&slot.rule as *const UnwindRule as *const u64) };
            return Some(unsafe { core::mem::transmute::<u64, UnwindRule>(bits) });
        }
    }
    unsafe { UNWIND_RULES.get(&ra) }.copied()
}

/// One frame of the walk: finds the rule of the current return address,
/// computes the caller's frame from it, and reads the next return address
/// (and a saved rbp) from the chunk of stack in the scratch, reading a new
/// chunk when the frame lies outside it. Returns 1 when the walk is over
/// (`stack.stop` says why), 0 to go on.
#[inline(always)]
fn unwind_frame(w: &mut WalkScratch, e: *mut WalkMemo) -> i64 {
    let ra = w.ra;
    let Some(rule) = rule_of(ra) else {
        w.stack.stop = stop::MISS;
        return 1;
    };
    let base = match rule.kind {
        UnwindRule::CFA_RSP => w.sp,
        UnwindRule::CFA_RBP if w.bp_ok != 0 => {
            // The walk depends on rbp: on the entry's register, or on the
            // stack word it was read from.
            if w.memo_bp_at == 0 {
                w.memo_uses_bp = 1;
            } else {
                memo_note(w, e, w.memo_bp_at, w.bp, 0);
            }
            w.bp
        }
        UnwindRule::END => return end(w, stop::END),
        UnwindRule::NOT_CODE => return end(w, stop::BAD_FRAME),
        _ => return end(w, stop::NO_CFI),
    };
    let cfa = base.wrapping_add(rule.cfa_off as i64 as u64);
    // Each caller's frame lies above its callee's: what makes the walk end
    // on garbage.
    if cfa <= w.sp || cfa & 7 != 0 {
        return end(w, stop::BAD_FRAME);
    }
    // The slots to read: the return address at CFA - 8 and, below it, a
    // saved rbp.
    let saves_bp = rule.rbp == UnwindRule::RBP_AT;
    let rbp_off = rule.rbp_off as i64;
    let low_off: i64 = if saves_bp && rbp_off < -8 { rbp_off } else { -8 };
    let low = cfa.wrapping_add(low_off as u64);
    let covered = low >= w.base && w.valid >= 8 && cfa - w.base <= w.valid;
    if !covered && !load_chunk(w, low) {
        return end(w, stop::READ_FAILED);
    }
    let base = w.base;
    let valid = w.valid;
    if cfa < base + 8 || cfa - base > valid {
        return end(w, stop::READ_FAILED);
    }
    let next = w.chunk[(((cfa - 8 - base) / 8) as usize) & (STACK_CHUNK / 8 - 1)];
    memo_note(w, e, cfa - 8, next, 1);
    if saves_bp {
        let at = cfa.wrapping_add(rbp_off as u64);
        if at < base || at & 7 != 0 || at + 8 > base + valid {
            return end(w, stop::READ_FAILED);
        }
        w.bp = w.chunk[(((at - base) / 8) as usize) & (STACK_CHUNK / 8 - 1)];
        w.bp_ok = 1;
        w.memo_bp_at = at;
    } else if rule.rbp != UnwindRule::RBP_SAME {
        w.bp_ok = 0;
    }
    if next == 0 {
        return end(w, stop::END);
    }
    // The count is read afresh and masked, so that the verifier sees the
    // slot's bounds.
    let n = (unsafe { core::ptr::read_volatile(&w.stack.len) } as usize) & 127;
    if n >= MAX_FRAMES || n as u64 >= w.limit {
        return end(w, stop::MAX_FRAMES);
    }
    w.stack.frames[n] = next;
    unsafe { core::ptr::write_volatile(&mut w.stack.len, n as u32 + 1) };
    w.hash = stack_hash_step(w.hash, next);
    w.ra = next;
    w.sp = cfa;
    0
}

#[inline(always)]
fn end(w: &mut WalkScratch, why: u32) -> i64 {
    w.stack.stop = why;
    1
}

/// The walk's key: its frames and why it ended.
#[inline(always)]
fn finish_hash(w: &mut WalkScratch, why: u32) -> u64 {
    w.stack.stop = why;
    stack_hash_finish(w.hash, why)
}

/// Reads the target's stack at `addr` into the scratch: `STACK_CHUNK`
/// bytes, or near the top of the stack (where that read fails) 16. False
/// when nothing could be read.
#[inline(always)]
fn load_chunk(w: &mut WalkScratch, addr: u64) -> bool {
    let bytes =
        unsafe { core::slice::from_raw_parts_mut(w.chunk.as_mut_ptr() as *mut u8, STACK_CHUNK) };
    if unsafe { aya_ebpf::helpers::bpf_probe_read_user_buf(addr as *const u8, bytes) }.is_ok() {
        w.valid = STACK_CHUNK as u64;
    } else {
        // The chunk ran into a page that cannot be read (past the top of
        // the stack, or never touched under a large local buffer): the
        // rest of this page, else one frame's 16 bytes, or the last 8.
        let rest = (4096 - (addr & 4095)) & (STACK_CHUNK as u64 - 8);
        let frame = unsafe { core::slice::from_raw_parts_mut(w.chunk.as_mut_ptr() as *mut u8, 16) };
        if rest > 16
            && unsafe {
                aya_ebpf::helpers::generated::bpf_probe_read_user(
                    w.chunk.as_mut_ptr() as *mut core::ffi::c_void,
                    rest as u32,
                    addr as *const core::ffi::c_void,
                )
            } == 0
        {
            w.valid = rest;
        } else if unsafe { aya_ebpf::helpers::bpf_probe_read_user_buf(addr as *const u8, frame) }.is_ok() {
            w.valid = 16;
        } else {
            let word = unsafe { core::slice::from_raw_parts_mut(w.chunk.as_mut_ptr() as *mut u8, 8) };
            if unsafe { aya_ebpf::helpers::bpf_probe_read_user_buf(addr as *const u8, word) }.is_err() {
                w.valid = 0;
                return false;
            }
            w.valid = 8;
        }
    }
    w.base = addr;
    true
}

/// Walks the target's stack from the probe (where `[rsp]` is the direct
/// caller and rbp the caller's) by the unwind rule of each return address,
/// one `bpf_loop` step per frame. Returns the stack's key and the scratch
/// holding the frames; with `stack.stop == MISS` the walk stopped at an
/// address without a rule and the key is not final.
#[inline(always)]
fn walk_stack(
    ctx: &ProbeContext,
    scratch: Option<*mut WalkScratch>,
    caller: u64,
    tid: u32,
    cookie: u64,
) -> (u64, Option<*mut WalkScratch>, u64) {
    let Some(w) = scratch else {
        bump(counter::STACK_WALK_FAILED, 1);
        return (STACK_NONE, None, cookie_or(cookie, ctx));
    };
    unsafe {
        // Set off (and checked against the memo) by `record_in`.
        let (sp, bp) = ((*ctx.regs).rsp, (*ctx.regs).rbp);
        if caller != 0 && (*w).limit != 0 {
            if (*w).memo_hit != 0 {
                // Taken before (sampled), else the entry's, else the probe's.
                let cookie = cookie_or(if cookie != NO_COOKIE { cookie } else { (*w).cookie }, ctx);
                return ((*w).hit_key, Some(w), cookie);
            }
            let cookie = cookie_or(cookie, ctx);
            bump(counter::WALKS, 1);
            if core::ptr::read_volatile(&(*w).owned) != 0 {
                memo_claim(&mut *w, caller, sp, cookie, tid as u64);
            }
            run_walk(w);
            let why = (*w).stack.stop;
            if why == stop::MISS {
                memo_release(&mut *w, None);
                return (0, Some(w), cookie);
            }
            let key = finish_hash(&mut *w, why);
            // A walk that could not read the stack may do better next time.
            let done = (why != stop::READ_FAILED).then_some((caller, sp, bp, key));
            memo_release(&mut *w, done);
            return (key, Some(w), cookie);
        }
        let why = (*w).stack.stop;
        (finish_hash(&mut *w, why), Some(w), cookie_or(cookie, ctx))
    }
}

/// Sets the walk off from the probe: `[rsp]` is the direct caller, rbp the
/// caller's.
#[inline(always)]
fn start_walk(w: &mut WalkScratch, caller: u64, sp: u64, bp: u64, ip: u64) {
    w.ip = ip;
    w.ra = caller;
    w.sp = sp + 8;
    w.bp = bp;
    w.bp_ok = 1;
    w.hash = STACK_HASH_SEED;
    w.stack.len = 0;
    w.stack.stop = if caller == 0 { stop::READ_FAILED } else { stop::MAX_FRAMES };
    // 0 (--max-stack 0): the direct caller only.
    w.limit = config_u32(&CONFIG.max_frames) as u64;
    w.origin = sp;
    w.check_slot = MEMO_NOWHERE as u64;
    // Volatile: LLVM would merge the zeroes into a call of a memset that
    // goes a byte at a time.
    unsafe {
        core::ptr::write_volatile(&mut w.memo_hit, 0);
        core::ptr::write_volatile(&mut w.memo_n, 0);
        core::ptr::write_volatile(&mut w.memo_span, 0);
        core::ptr::write_volatile(&mut w.memo_over, 0);
        core::ptr::write_volatile(&mut w.memo_bp_at, 0);
        core::ptr::write_volatile(&mut w.memo_uses_bp, 0);
        core::ptr::write_volatile(&mut w.noting, 0);
    }
}

/// Walks frame by frame until the walk ends (`stack.stop` says why).
#[inline(always)]
fn run_walk(mut w: *mut WalkScratch) {
    unsafe {
        aya_ebpf::helpers::generated::bpf_loop(
            (MAX_FRAMES / FRAMES_PER_STEP + 1) as u32,
            unwind_step as *mut core::ffi::c_void,
            &mut w as *mut *mut WalkScratch as *mut core::ffi::c_void,
            0,
        );
    }
}

/// After a remembered walk, its frames (a new aggregation key stores its
/// stack): the return addresses among the words the entry holds. False
/// when the entry changed meanwhile (the call then goes under no stack).
#[inline(always)]
fn memo_frames(mut w: *mut WalkScratch) -> bool {
    unsafe {
        let Some(e) = MEMO.get_ptr((*w).check_slot as u32) else {
            return false;
        };
        // The entry the call's key came from, unchanged since.
        let seq = (*w).hit_seq;
        if core::ptr::read_volatile(&(*e).seq) != seq {
            return false;
        }
        (*w).stack.len = 0;
        (*w).stack.stop = core::ptr::read_volatile(&(*e).stop) as u32;
        (*w).check_i = 0;
        aya_ebpf::helpers::generated::bpf_loop(
            (MEMO_WORDS / MEMO_PER_STEP + 1) as u32,
            memo_frames_step as *mut core::ffi::c_void,
            &mut w as *mut *mut WalkScratch as *mut core::ffi::c_void,
            0,
        );
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
        core::ptr::read_volatile(&(*e).seq) == seq
    }
}

/// One `bpf_loop` step of [`memo_frames`].
#[inline(never)]
extern "C" fn memo_frames_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let Some(e) = MEMO.get_ptr(w.check_slot as u32) else {
        return 1;
    };
    let mut k = 0;
    while k < MEMO_PER_STEP {
        let i = w.check_i;
        if i >= w.check_n {
            return 1;
        }
        let word = unsafe { core::ptr::read_volatile(&(*e).words[(i as usize) & (MEMO_WORDS - 1)]) };
        if word >> 63 != 0 {
            let n = (unsafe { core::ptr::read_volatile(&w.stack.len) } as usize) & 127;
            if n >= MAX_FRAMES {
                return 1;
            }
            w.stack.frames[n] = word & ((1 << 48) - 1);
            unsafe { core::ptr::write_volatile(&mut w.stack.len, n as u32 + 1) };
        }
        w.check_i = i + 1;
        k += 1;
    }
    0
}

/// The [`MEMO`] entry of a call from `caller` with stack pointer `sp`.
#[inline(always)]
fn memo_slot(caller: u64, sp: u64) -> u32 {
    ((caller ^ sp.rotate_left(20)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as u32 & (MEMO_ENTRIES - 1)
}

/// Takes the [`MEMO`] entry of a walk from `caller` at `sp` for the walk
/// about to run, which writes the stack words it reads into it (unless
/// another program on this CPU is writing the entry: then the walk is not
/// remembered). Not inlined: the verifier would follow the walk once per
/// way through.
#[inline(never)]
fn memo_claim(w: &mut WalkScratch, caller: u64, sp: u64, cookie: u64, tid: u64) {
    if sp & 7 != 0 {
        return;
    }
    let slot = memo_slot(caller, sp);
    let Some(e) = MEMO.get_ptr_mut(slot) else {
        return;
    };
    let seq = unsafe { core::ptr::read_volatile(&(*e).seq) };
    if seq & 1 != 0 {
        return;
    }
    // Odd while written; only the program that made it odd writes.
    let (_, won) = unsafe {
        core::intrinsics::atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
            &mut (*e).seq,
            seq,
            seq + 1,
        )
    };
    if won {
        memo_flush(e);
        unsafe {
            (*e).func = (cookie & (MAX_FUNCS as u64 - 1)) as u64;
            (*e).tid = tid;
            (*e).ip = w.ip;
            (*e).cookie = cookie;
        }
        w.check_slot = slot as u64;
        w.claim_seq = seq;
        w.noting = 1;
    }
}

/// Moves the calls a remembered walk counted into the aggregation map.
/// The entry is claimed (its sequence is odd): the tracer, which adds what
/// entries hold to the map's counts, reads again when it finds a claimed
/// entry that holds calls.
#[inline(always)]
fn memo_flush(e: *mut WalkMemo) {
    let (hits, calls, bytes) = unsafe { ((*e).hits, (*e).calls, (*e).bytes) };
    if hits == 0 {
        return;
    }
    let key = unsafe {
        CountKey {
            stack: (*e).key,
            func: (*e).func as u32,
            tid: (*e).tid as u32,
            caller: (*e).caller,
        }
    };
    if !add_to(&key, calls, bytes, true) {
        insert_count(&key, calls, bytes, hits);
    }
    // Counted between the move and the zeroing: a read of the map and
    // then of the entries that a move tore either sees the number change
    // or finds the entry still holding its calls while claimed.
    bump(counter::MEMO_FLUSHES, 1);
    unsafe {
        core::ptr::write_volatile(&mut (*e).hits, 0);
        core::ptr::write_volatile(&mut (*e).calls, 0);
        core::ptr::write_volatile(&mut (*e).bytes, 0);
    }
}

/// Counts a call that took a remembered walk in the walk's entry, if the
/// entry (still the one the walk came from) is of the same function and
/// thread. Only the CPU's owner calls this.
#[inline(always)]
fn memo_count(w: *mut WalkScratch, func: u32, tid: u32, calls: u64, bytes: u64) -> bool {
    unsafe {
        let Some(e) = MEMO.get_ptr_mut((*w).check_slot as u32) else {
            return false;
        };
        if core::ptr::read_volatile(&(*e).seq) != (*w).hit_seq || (*e).func != func as u64 || (*e).tid != tid as u64 {
            return false;
        }
        (*e).hits += 1;
        (*e).calls += calls;
        (*e).bytes += bytes;
        true
    }
}

/// Notes in the claimed entry that the walk read `value` from the stack
/// word at `addr` (a return address, the next frame, when `frame` is 1).
#[inline(always)]
fn memo_note(w: &mut WalkScratch, e: *mut WalkMemo, addr: u64, value: u64, frame: u64) {
    let off = addr.wrapping_sub(w.origin) / 8;
    let n = unsafe { core::ptr::read_volatile(&w.memo_n) };
    if n >= MEMO_WORDS as u64 || off >= 1 << 15 || value >= 1 << 48 {
        w.memo_over = 1;
        return;
    }
    unsafe { (*e).words[(n as usize) & (MEMO_WORDS - 1)] = (frame << 63) | (off << 48) | value };
    w.memo_n = n + 1;
    if off >= w.memo_span {
        w.memo_span = off + 1;
    }
}

/// Gives the claimed entry back: remembering the walk, given `done`
/// (caller, stack pointer, rbp, key) and that its words fit, else empty.
/// Not inlined: the verifier would follow the rest of the program once per
/// way through.
#[inline(never)]
fn memo_release(w: &mut WalkScratch, done: Option<(u64, u64, u64, u64)>) {
    if w.noting == 0 {
        return;
    }
    w.noting = 0;
    let Some(e) = MEMO.get_ptr_mut(w.check_slot as u32) else {
        return;
    };
    unsafe {
        match done {
            Some((caller, sp, bp, key)) if w.memo_over == 0 => {
                (*e).caller = caller;
                (*e).sp = sp;
                (*e).bp = bp;
                (*e).uses_bp = w.memo_uses_bp;
                (*e).key = key;
                (*e).stop = w.stack.stop as u64;
                (*e).n = w.memo_n;
                (*e).span = w.memo_span;
            }
            _ => {
                (*e).caller = 0;
                (*e).n = 0;
            }
        }
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
        core::ptr::write_volatile(&mut (*e).seq, w.claim_seq + 2);
    }
}

/// Whether a walk from `caller` at `sp` is remembered and the stack still
/// holds every word that walk read (so that walking would give the same):
/// then the scratch has its key (`hit_key`), entry (`check_slot`, with
/// `hit_seq`) and, for a call through the same probe, cookie.
#[inline(always)]
fn memo_find(w: *mut WalkScratch, caller: u64, sp: u64, bp: u64, ip: u64) -> bool {
    let found = memo_lookup(w, caller, sp, bp, ip);
    unsafe {
        match found {
            Some(key) => {
                (*w).hit_key = key;
                (*w).memo_hit = 1;
            }
            // The walk that follows notes nowhere unless it claims an
            // entry (a walk whose program does not own the CPU must not
            // write into the entry the check looked at).
            None => (*w).check_slot = MEMO_NOWHERE as u64,
        }
    }
    found.is_some()
}

/// [`memo_find`]'s check: the remembered key, if any.
#[inline(always)]
fn memo_lookup(w: *mut WalkScratch, caller: u64, sp: u64, bp: u64, ip: u64) -> Option<u64> {
    let slot = memo_slot(caller, sp);
    let e = MEMO.get_ptr(slot)?;
    unsafe {
        let seq = core::ptr::read_volatile(&(*e).seq);
        if seq & 1 != 0
            || core::ptr::read_volatile(&(*e).caller) != caller
            || core::ptr::read_volatile(&(*e).sp) != sp
            || (core::ptr::read_volatile(&(*e).uses_bp) != 0 && core::ptr::read_volatile(&(*e).bp) != bp)
        {
            return None;
        }
        let key = core::ptr::read_volatile(&(*e).key);
        let n = core::ptr::read_volatile(&(*e).n);
        // The cookie of the walk's call, when this call is through the
        // same probe.
        let cookie = if core::ptr::read_volatile(&(*e).ip) == ip { core::ptr::read_volatile(&(*e).cookie) } else { NO_COOKIE };
        (*w).check_slot = slot as u64;
        // Every word in the chunk read at `sp` (the usual case): compared
        // without a bounds check per word.
        let span = core::ptr::read_volatile(&(*e).span);
        let i = if n <= MEMO_INLINE && (*w).base == sp && span * 8 <= (*w).valid {
            if memo_compare_chunk(w, e, n) {
                n
            } else {
                u64::MAX
            }
        } else {
            memo_compare(w, e, sp, n)
        };
        if i > n {
            return None;
        }
        if i < n {
            // The rest a step at a time, reading the stack as needed.
            (*w).origin = sp;
            (*w).check_i = i;
            (*w).check_n = n;
            (*w).check_same = 0;
            let mut wp = w;
            aya_ebpf::helpers::generated::bpf_loop(
                (MEMO_WORDS / MEMO_PER_STEP + 1) as u32,
                memo_step as *mut core::ffi::c_void,
                &mut wp as *mut *mut WalkScratch as *mut core::ffi::c_void,
                0,
            );
            if core::ptr::read_volatile(&(*w).check_same) == 0 {
                return None;
            }
        }
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
        if core::ptr::read_volatile(&(*e).seq) != seq {
            return None;
        }
        (*w).hit_seq = seq;
        (*w).cookie = cookie;
        Some(key)
    }
}

const MEMO_PER_STEP: usize = 8;

/// Compares the first remembered words of `e` that lie in the chunk
/// already read with the stack there, without `bpf_loop`: a helper call,
/// and each of its steps an indirect call, which retpolines and safe
/// returns make dear (AMD Zen 4 host: the bench loop's deepest site took
/// four). Returns how many matched before a word beyond the chunk or
/// beyond the first `MEMO_INLINE`, or more than `n` at a mismatch. For a
/// walk whose words are not all in the first chunk (a walk that fits takes
/// [`memo_compare_chunk`]). Not inlined: the verifier would follow the
/// loop once per way to it (39,500 instructions verified as a subprogram,
/// 54,800 inline).
#[inline(never)]
fn memo_compare(w: *mut WalkScratch, e: *const WalkMemo, sp: u64, n: u64) -> u64 {
    unsafe {
        let (base, valid) = ((*w).base, (*w).valid);
        let mut i = 0u64;
        while i < MEMO_INLINE {
            if i >= n {
                break;
            }
            let word = core::ptr::read_volatile(&(*e).words[(i as usize) & (MEMO_WORDS - 1)]);
            let addr = sp + ((word >> 45) & (0x7fff << 3));
            if addr < base || addr + 8 > base + valid {
                break;
            }
            if (*w).chunk[(((addr - base) / 8) as usize) & (STACK_CHUNK / 8 - 1)] != word & ((1 << 48) - 1) {
                return u64::MAX;
            }
            i += 1;
        }
        i
    }
}

/// Compares the `n` (at most `MEMO_INLINE`) remembered words of `e` with
/// the chunk, which holds all of them (read at the entry's stack pointer,
/// and as long as the entry's span): no bounds check per word, and inline
/// (a BPF subprogram call costs ~25 ns on the AMD host: its return goes
/// through the safe-RET thunk).
#[inline(always)]
fn memo_compare_chunk(w: *mut WalkScratch, e: *const WalkMemo, n: u64) -> bool {
    unsafe {
        let mut i = 0u64;
        while i < MEMO_INLINE {
            if i >= n {
                return true;
            }
            let word = core::ptr::read_volatile(&(*e).words[(i as usize) & (MEMO_WORDS - 1)]);
            if (*w).chunk[((word >> 48) as usize) & (STACK_CHUNK / 8 - 1)] != word & ((1 << 48) - 1) {
                return false;
            }
            i += 1;
        }
        true
    }
}

/// Remembered words [`memo_find`] compares without `bpf_loop`.
const MEMO_INLINE: u64 = 64;

/// One `bpf_loop` step of [`memo_find`]: compares up to `MEMO_PER_STEP`
/// remembered words with the stack, reading chunks of it as needed.
#[inline(never)]
extern "C" fn memo_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    let w = unsafe { &mut **(ctx as *mut *mut WalkScratch) };
    let Some(e) = MEMO.get_ptr(w.check_slot as u32) else {
        return 1;
    };
    // In registers for the step (the scratch is written only on a read).
    let (n, origin) = (w.check_n, w.origin);
    let mut i = w.check_i;
    let mut base = w.base;
    let mut end = base + w.valid;
    let mut k = 0;
    while k < MEMO_PER_STEP {
        if i >= n {
            w.check_same = 1;
            return 1;
        }
        let word = unsafe { core::ptr::read_volatile(&(*e).words[(i as usize) & (MEMO_WORDS - 1)]) };
        let addr = origin + ((word >> 45) & (0x7fff << 3));
        if addr < base || addr + 8 > end {
            if !load_chunk(w, addr) {
                return 1;
            }
            base = w.base;
            end = base + w.valid;
        }
        if w.chunk[(((addr - base) / 8) as usize) & (STACK_CHUNK / 8 - 1)] != word & ((1 << 48) - 1) {
            return 1;
        }
        i += 1;
        k += 1;
    }
    w.check_i = i;
    0
}

/// Hands a walk that met an address without a rule to the tracer: where it
/// stopped and a copy of the stack from there. Returns the call's stack id
/// (live mode's events carry it), `None` when the ring had no room.
#[inline(always)]
fn send_miss(
    w: &mut WalkScratch,
    func: u32,
    tid: u32,
    caller: u64,
    calls: u64,
    bytes: u64,
) -> Option<u64> {
    if UNWIND_FULL.get(0).is_some_and(|f| *f != 0) {
        finish_hash(w, stop::RULES_FULL);
        return None;
    }
    bump(counter::UNWIND_MISSES, 1);
    if tid != 0 {
        // Per thread: the kernel may never count this thread's calls
        // itself (where its name is recorded otherwise).
        if let Ok(comm) = bpf_get_current_comm() {
            let _ = THREAD_NAMES.insert(&tid, &comm, BPF_NOEXIST as u64);
        }
    }
    // Unique: a CPU copies one stack at a time, each taking microseconds.
    // (The BPF target here has no fetch-and-add for a counter.)
    let cpu = unsafe { aya_ebpf::helpers::bpf_get_smp_processor_id() } as u64;
    let id = miss_stack_id(((now_ns() & ((1 << 52) - 1)) << 8) | (cpu & 0xff));
    // The copy goes from the page of the return address's slot to the end
    // of the stack's mapping (the thread's outermost frame lies below it),
    // or on the main thread to where its frames end, in the smallest
    // record that holds it.
    let from = w.sp - 8;
    let base = from & !4095;
    let end = mapping_end(from);
    let mut top = if end > from { end } else { base + STACK_COPY as u64 };
    let start = unsafe { core::ptr::read_volatile(&CONFIG.stack_start) };
    if start > from && start < top {
        top = start + 64;
    }
    let total = top - base;
    let head = (id, func, tid, caller, calls, bytes);
    let sent = if total <= MISS_COPY_SIZES[0] as u64 {
        send_copy::<{ MISS_COPY_SIZES[0] }>(w, head, base, total)
    } else if total <= MISS_COPY_SIZES[1] as u64 {
        send_copy::<{ MISS_COPY_SIZES[1] }>(w, head, base, total)
    } else if total <= MISS_COPY_SIZES[2] as u64 {
        send_copy::<{ MISS_COPY_SIZES[2] }>(w, head, base, total)
    } else if total <= MISS_COPY_SIZES[3] as u64 {
        send_copy::<{ MISS_COPY_SIZES[3] }>(w, head, base, total)
    } else {
        send_copy::<STACK_COPY>(w, head, base, total)
    };
    if !sent {
        bump(counter::UNWIND_MISSES_LOST, 1);
        return None;
    }
    Some(id)
}

/// The end of the target's mapping that holds `addr`, 0 when it cannot be
/// found (another thread holds the address space's lock, say).
#[inline(always)]
fn mapping_end(addr: u64) -> u64 {
    let mut end: u64 = 0;
    unsafe {
        aya_ebpf::helpers::generated::bpf_find_vma(
            aya_ebpf::helpers::generated::bpf_get_current_task_btf(),
            addr,
            vma_end as *mut core::ffi::c_void,
            &mut end as *mut u64 as *mut core::ffi::c_void,
            0,
        );
    }
    end
}

/// `bpf_find_vma`'s callback: the mapping's `vm_end` (the second word of
/// `struct vm_area_struct`, after `vm_start`).
#[inline(never)]
extern "C" fn vma_end(
    _task: *mut core::ffi::c_void,
    vma: *mut core::ffi::c_void,
    end: *mut core::ffi::c_void,
) -> i64 {
    unsafe { *(end as *mut u64) = core::ptr::read_volatile((vma as *const u64).add(1)) };
    0
}

/// One [`MissEvent`] with `N` bytes of copy: the walk so far and the
/// target's stack from `base` (a page boundary), `total` bytes of it (at
/// most `N`) in one read; where that fails (a page never touched under a
/// large local buffer), a page at a time, the pages that cannot be read
/// marked as holes. False when the ring is full.
#[inline(always)]
fn send_copy<const N: usize>(
    w: &mut WalkScratch,
    (id, func, tid, caller, calls, bytes): (u64, u32, u32, u64, u64, u64),
    base: u64,
    total: u64,
) -> bool {
    let Some(mut entry) = UNWIND_MISSES.reserve::<MissEvent<N>>(0) else {
        return false;
    };
    let ev = entry.as_mut_ptr();
    unsafe {
        (*ev).stack_id = id;
        (*ev).func = func;
        (*ev).tid = tid;
        (*ev).caller = caller;
        (*ev).calls = calls;
        (*ev).bytes = bytes;
        (*ev).n = w.stack.len;
        (*ev).ra = w.ra;
        (*ev).sp = w.sp;
        (*ev).bp = w.bp;
        (*ev).bp_ok = w.bp_ok;
        (*ev).skip = ((w.sp - 8) & 4095) as u32;
        aya_ebpf::helpers::generated::bpf_probe_read_kernel(
            (*ev).frames.as_mut_ptr() as *mut core::ffi::c_void,
            (MAX_FRAMES * 8) as u32,
            w.stack.frames.as_ptr() as *const core::ffi::c_void,
        );
        let len = if total < N as u64 { total as u32 } else { N as u32 };
        (*ev).copied = len;
        (*ev).holes = 0;
        if aya_ebpf::helpers::generated::bpf_probe_read_user(
            (*ev).copy.as_mut_ptr() as *mut core::ffi::c_void,
            len,
            base as *const core::ffi::c_void,
        ) != 0
        {
            // A page that cannot be read is zeroed by the helper.
            let mut holes = 0u32;
            let mut page = 0usize;
            while page < N / 4096 {
                let at = page * 4096;
                if at as u32 >= len {
                    break;
                }
                if aya_ebpf::helpers::generated::bpf_probe_read_user(
                    (*ev).copy.as_mut_ptr().add(at) as *mut core::ffi::c_void,
                    4096,
                    (base + at as u64) as *const core::ffi::c_void,
                ) != 0
                {
                    holes |= 1 << page;
                }
                page += 1;
            }
            (*ev).holes = holes;
        }
    }
    // Wake the tracer: the sooner it adds the rules, the fewer copies.
    entry.submit(0);
    true
}

/// Inserts a new aggregation key with its first counts; true when this
/// call created it. `hits` is the number of calls the counts stand for,
/// lost (and counted so) when the map is full.
#[inline(always)]
fn insert_count(key: &CountKey, calls: u64, bytes: u64, hits: u64) -> bool {
    let first = CountValue {
        calls,
        bytes,
        calls_shared: 0,
        bytes_shared: 0,
    };
    match COUNTS.insert(key, &first, BPF_NOEXIST as u64) {
        Ok(()) => true,
        // Another CPU inserted the key between our lookup and insert.
        Err(e) if e == -EEXIST => {
            if !add_to(key, calls, bytes, false) {
                bump(counter::MAP_FULL, hits);
            }
            false
        }
        Err(_) => {
            bump(counter::MAP_FULL, hits);
            false
        }
    }
}

/// Per-thread mode: the name of a thread with a new key.
#[inline(always)]
fn name_thread(tid: u32) {
    if let Ok(comm) = bpf_get_current_comm() {
        if THREAD_NAMES.insert(&tid, &comm, 0).is_err() {
            bump(counter::THREAD_NAMES_FULL, 1);
        }
    }
}

/// Live mode: the return of an allocating call. Only the outermost call
/// of a thread completes: a nested call (realloc -> malloc) returns with
/// the outer call's pending entry, which names another function.
#[inline(always)]
fn complete(ctx: &RetProbeContext, role: Role) -> u32 {
    let func = cookie_func(ctx.as_ptr());
    let pending = match PENDING.current(false) {
        Some(p) if p.active != 0 && p.key.func == func => {
            p.active = 0;
            *p
        }
        _ => return 0,
    };
    let ret: u64 = ctx.ret();
    let ptr = if role == Role::PosixMemalign {
        if ret as u32 == 0 {
            unsafe { bpf_probe_read_user(pending.memptr as *const u64) }.unwrap_or(0)
        } else {
            0
        }
    } else {
        ret
    };
    let resizes = role == Role::Resize || role == Role::ResizeArray;
    // The old block is gone when the call moved it, or freed it
    // (realloc(p, 0)); a failed resize leaves it.
    let released = if resizes && (ptr != 0 || pending.size == 0) {
        pending.old_ptr
    } else {
        0
    };
    if ptr == 0 && !(resizes && pending.size == 0) {
        bump(counter::FAILED, 1);
    }
    if ptr == 0 && released == 0 {
        return 0;
    }
    let sent = send(|ts| AllocEvent {
        kind: EVENT_ALLOC,
        _pad: 0,
        ts,
        ptr,
        size: pending.size,
        key: pending.key,
        old_ptr: released,
        entry_ts: pending.entry_ts,
    });
    // The new block goes untracked; the old one must not stay live.
    if !sent && released != 0 {
        keep_free(released, Some(pending.entry_ts));
    }
    0
}

/// Live mode: `ptr` was freed.
#[inline(always)]
fn send_free(ptr: u64) {
    let sent = send(|ts| FreeEvent {
        kind: EVENT_FREE,
        _pad: 0,
        ts,
        ptr,
    });
    if !sent {
        keep_free(ptr, None);
    }
}

/// Adds a call to the count of `key`, if it has one: plainly when this
/// program owns the CPU, else atomically to the value's second half.
#[inline(always)]
fn add_to(key: &CountKey, calls: u64, bytes: u64, owned: bool) -> bool {
    match COUNTS.get_ptr_mut(key) {
        Some(v) => {
            unsafe {
                if owned {
                    (*v).calls += calls;
                    (*v).bytes += bytes;
                } else {
                    atomic_add(&raw mut (*v).calls_shared, calls);
                    atomic_add(&raw mut (*v).bytes_shared, bytes);
                }
            }
            true
        }
        None => false,
    }
}

/// Argument `n` (0: `rdi`, 1: `rsi`, 2: `rdx`, 3: `rcx`) where the probe
/// finds it: in its own register unless the cookie says the prologue
/// before the probe moved it (see `COOKIE_ARGS_SHIFT`).
#[inline(always)]
fn arg(ctx: &ProbeContext, cookie: u64, n: usize) -> u64 {
    let at = (cookie >> (COOKIE_ARGS_SHIFT as usize + 4 * n)) & 0xf;
    if at == 0 {
        return ctx.arg::<u64>(n).unwrap_or(0);
    }
    // Which saved register: a variable offset into the context, which the
    // verifier lets a program read only through the helper (a direct load
    // at a computed offset is refused).
    let offset = match at {
        1 => core::mem::offset_of!(pt_regs, rdi),
        2 => core::mem::offset_of!(pt_regs, rsi),
        3 => core::mem::offset_of!(pt_regs, rdx),
        4 => core::mem::offset_of!(pt_regs, rcx),
        5 => core::mem::offset_of!(pt_regs, r8),
        6 => core::mem::offset_of!(pt_regs, r9),
        7 => core::mem::offset_of!(pt_regs, rax),
        8 => core::mem::offset_of!(pt_regs, r10),
        9 => core::mem::offset_of!(pt_regs, r11),
        _ => return 0,
    };
    let at = (ctx.regs as *const u8).wrapping_add(offset) as *const u64;
    // SAFETY: the helper checks the read.
    unsafe { bpf_probe_read_kernel(at) }.unwrap_or(0)
}

/// The probe's attach cookie: the function's index in the run's function
/// table, its role and where the probe finds its arguments.
#[inline(always)]
fn attach_cookie(ctx: &ProbeContext) -> u64 {
    unsafe { aya_ebpf::helpers::generated::bpf_get_attach_cookie(ctx.as_ptr()) }
}

/// No cookie taken yet (a real one is far smaller).
const NO_COOKIE: u64 = u64::MAX;

/// `cookie`, or the probe's when that is [`NO_COOKIE`].
#[inline(always)]
fn cookie_or(cookie: u64, ctx: &ProbeContext) -> u64 {
    if cookie != NO_COOKIE {
        cookie
    } else {
        attach_cookie(ctx)
    }
}

/// The size an allocating call asks for and what it passes on to its
/// return probe, by its role (see `COOKIE_ROLE_SHIFT`).
#[inline(always)]
fn call_args(ctx: &ProbeContext, cookie: u64) -> (u64, Extra) {
    let role = (cookie >> COOKIE_ROLE_SHIFT) & 0xff;
    if role == Role::CountSize as u64 {
        // `f(n, size)`: calloc.
        (product(arg(ctx, cookie, 0), arg(ctx, cookie, 1)), Extra::default())
    } else if role == Role::AlignSize as u64 {
        // `f(align, size)`: memalign, aligned_alloc.
        (arg(ctx, cookie, 1), Extra::default())
    } else if role == Role::Resize as u64 {
        // `f(ptr, size)`: realloc.
        (arg(ctx, cookie, 1), of_block(arg(ctx, cookie, 0)))
    } else if role == Role::ResizeArray as u64 {
        // `f(ptr, n, size)`: reallocarray.
        (product(arg(ctx, cookie, 1), arg(ctx, cookie, 2)), of_block(arg(ctx, cookie, 0)))
    } else if role == Role::PosixMemalign as u64 {
        // `f(&ptr, align, size)`: posix_memalign.
        let extra = Extra {
            old_ptr: 0,
            memptr: arg(ctx, cookie, 0),
        };
        (arg(ctx, cookie, 2), extra)
    } else if role == Role::ResizeInPlace as u64 {
        // `f(ptr, size, ...)` resizing in place: jemalloc's xallocx
        // (count and sampled modes only).
        (arg(ctx, cookie, 1), Extra::default())
    } else if role == Role::ResizeRust as u64 {
        // `f(ptr, old_size, align, new_size)`: Rust's __rust_realloc.
        (arg(ctx, cookie, 3), of_block(arg(ctx, cookie, 0)))
    } else {
        // `f(size)`: malloc, valloc, pvalloc, operator new, ...
        (arg(ctx, cookie, 0), Extra::default())
    }
}

/// `n * m`, saturating. Done on 32-bit halves: LLVM turns the usual
/// overflow checks into a 128-bit multiply, which the BPF target lacks.
#[inline(always)]
fn product(n: u64, m: u64) -> u64 {
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
fn cookie_func(ctx: *mut core::ffi::c_void) -> u32 {
    (unsafe { aya_ebpf::helpers::generated::bpf_get_attach_cookie(ctx) } as u32) & (MAX_FUNCS - 1)
}

/// What a call that releases or resizes `ptr` passes on.
#[inline(always)]
fn of_block(ptr: u64) -> Extra {
    Extra {
        old_ptr: ptr,
        memptr: 0,
    }
}

/// Every allocating entry point, whatever its role (the cookie says which:
/// see `COOKIE_ROLE_SHIFT`): the role only decides where the size and the
/// block are, and one program for all of them is one program for the
/// kernel to verify per traced process instead of one per role (about
/// 27 ms each here, the bulk of what a new process waits for its probes).
#[uprobe]
pub fn alloc(ctx: ProbeContext) -> u32 {
    record(&ctx)
}

/// `f(ptr)`: free.
#[uprobe]
pub fn release(ctx: ProbeContext) -> u32 {
    let cookie = attach_cookie(&ctx);
    record_free(&ctx, cookie, arg(&ctx, cookie, 0))
}

/// The benchmark's floor: attached where the real probes go, does nothing.
/// What mtrace costs beyond it is ours to cut.
#[uprobe]
pub fn floor(_ctx: ProbeContext) -> u32 {
    0
}

/// The floor of live mode's return probes.
#[uretprobe]
pub fn floor_ret(_ctx: RetProbeContext) -> u32 {
    0
}

/// Live mode: the return of `alloc_size`, `alloc_count_size` and
/// `alloc_align_size` functions.
#[uretprobe]
pub fn alloc_ret(ctx: RetProbeContext) -> u32 {
    complete(&ctx, Role::Size)
}

/// Live mode: the return of a resize.
#[uretprobe]
pub fn resize_ret(ctx: RetProbeContext) -> u32 {
    complete(&ctx, Role::Resize)
}

/// Live mode: the return of posix_memalign.
#[uretprobe]
pub fn posix_memalign_ret(ctx: RetProbeContext) -> u32 {
    complete(&ctx, Role::PosixMemalign)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
