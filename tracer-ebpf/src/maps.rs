//! Every map of the programs, the `CONFIG` global the tracer writes
//! before load, and the task storage map type aya-ebpf lacks.

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC},
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, Queue, RingBuf},
};
use tracer_common::{
    counter, CachedRule, Comm, Config, CountKey, CountValue, EntryMark, HostBodies, HostFileId,
    HostFunc, HostKey, HostMark, HostName, HostProcess, HostValue, HostVma, HostVmaKey,
    KernelOffsets, LostAlloc, LostFree, Pending, ProcessConfig, PyCodeKey, PyThreadSeen,
    PythonLayout, StackFrames, UnwindRule, VmaOffsets, WalkMemo, WalkScratch, EXP_TABLE_LEN,
    MARK_SLOTS, MAX_FRAMES, MAX_HOST_FILES, MAX_HOST_FUNCS, MAX_HOST_TAGS, MEMO_ENTRIES,
    RULE_CACHE_SLOTS, SAMPLE_NONE, SCOPE_ALL, VMA_COPY, WALK_LEVELS, WEIGHT_TABLE_LEN,
};

/// Written by the tracer before load (`EbpfLoader::set_global`).
#[no_mangle]
pub(crate) static CONFIG: Config = Config {
    per_thread: 0,
    live: 0,
    sample_mode: SAMPLE_NONE,
    max_frames: MAX_FRAMES as u32,
    sample_param: 0,
    sample_scale: 0,
    exp_table: [0; EXP_TABLE_LEN],
    weight_table: [0; WEIGHT_TABLE_LEN],
    kernel: KernelOffsets {
        known: 0,
        task_utask: 0,
        task_mm: 0,
        mm_xol_area: 0,
        xol_vaddr: 0,
        utask_returns: 0,
        return_stack: 0,
        return_orig: 0,
        return_next: 0,
        task_blocked: 0,
    },
    vma: VmaOffsets {
        known: 0,
        vm_start: 0,
        vm_pgoff: 0,
        vm_file: 0,
        file_inode: 0,
        inode_ino: 0,
        inode_sb: 0,
        sb_dev: 0,
        binprm_filename: 0,
        mm_start_stack: 0,
        task_tgid: 0,
        mm_start_code: 0,
        task_real_parent: 0,
        vm_flags: 0,
        task_signal: 0,
        signal_live: 0,
    },
    host_runs: 0,
    host_scope: SCOPE_ALL,
    throttle: 0,
    _pad: 0,
};

/// A `u32` field of [`CONFIG`], read from the global at run time (the
/// compiler would otherwise fold in the placeholder the source holds).
#[inline(always)]
pub(crate) fn config_u32(field: &u32) -> u32 {
    unsafe { core::ptr::read_volatile(field) }
}

/// The process the programs serve ([`ProcessConfig`]), written by the
/// tracer before its probes go in.
#[map]
pub(crate) static PROCESS: Array<ProcessConfig> = Array::with_max_entries(1, 0);

/// Sizes are placeholders: the tracer sets them before load. Not
/// preallocated, so that its memory grows with the keys in use, and not
/// per CPU: a per-CPU entry's values are allocated from the kernel's
/// per-CPU allocator when its key first comes and freed when the object
/// is emptied, which for a short process cost more than all its calls.
/// A CPU's repeated calls of a stack mostly add to its remembered walk
/// ([`MEMO`]), not here, so CPUs seldom share an entry's cache line.
#[map]
pub(crate) static COUNTS: HashMap<CountKey, CountValue> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// Every distinct stack, once, under its hash. Inserted only when a new
/// aggregation key appears, so not preallocated.
#[map]
pub(crate) static STACKS: HashMap<u64, StackFrames> =
    HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

/// Scratch space of the stack walk, per CPU: a program takes the first
/// level whose flag in [`OWNER`] is free (a uprobe program can be
/// preempted mid-walk by another thread's on the same CPU) and holds it
/// until it returns.
#[map]
pub(crate) static WALK: PerCpuArray<WalkScratch> = PerCpuArray::with_max_entries(WALK_LEVELS, 0);

/// The threads' last counted allocator entries ([`EntryMark`]), slot by a
/// hash of the thread. Two threads whose hashes meet share a slot; each
/// CPU's last mark ([`CPU_MARK`]) covers the thread that finds its slot
/// taken, unless it also moved to another CPU in between. Mappable, so
/// that the tracer zeroes it for the next process in one write.
#[map]
pub(crate) static MARKS: Array<EntryMark> = Array::with_max_entries(MARK_SLOTS, BPF_F_MMAPABLE);

/// The last entry mark made on each CPU.
#[map]
pub(crate) static CPU_MARK: PerCpuArray<EntryMark> = PerCpuArray::with_max_entries(1, 0);

/// Remembered walks ([`WalkMemo`]), per CPU: a call whose stack holds the
/// words an earlier walk from the same place read is not walked again.
#[map]
pub(crate) static MEMO: PerCpuArray<WalkMemo> = PerCpuArray::with_max_entries(MEMO_ENTRIES + 1, 0);

/// The [`MEMO`] entry a walk that remembers nothing writes its notes in
/// (never read).
pub(crate) const MEMO_NOWHERE: u32 = MEMO_ENTRIES;

/// Unwind rules by return address, filled by the tracer (size set by the
/// tracer). Not preallocated: a process uses a few hundred of its 65,536
/// entries, and each traced process of a tree has its own (5 MiB each when
/// preallocated); a lookup costs the same.
#[map]
pub(crate) static UNWIND_RULES: HashMap<u64, UnwindRule> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// A direct-mapped cache in front of `UNWIND_RULES`, filled by the tracer
/// (slot [`rule_slot`] of the return address, when free).
#[map]
pub(crate) static RULE_CACHE: Array<CachedRule> = Array::with_max_entries(RULE_CACHE_SLOTS, 0);

/// Walks the tracer finishes (size set by the tracer).
#[map]
pub(crate) static UNWIND_MISSES: RingBuf = RingBuf::with_byte_size(1 << 22, 0);

/// Set by the tracer when `UNWIND_RULES` is full: walks that miss a rule
/// then end there instead of being handed over, again and again.
#[map]
pub(crate) static UNWIND_FULL: Array<u64> = Array::with_max_entries(1, 0);

/// Threads sent the throttle signal, not yet held by the tracer (see
/// `Config::throttle`); one signal a thread at a time.
#[map]
pub(crate) static THROTTLED: HashMap<u32, u32> = HashMap::with_max_entries(1024, 0);

/// Set by the tracer once every probe is attached, cleared when tracing
/// ends: by pid the probes go in one after the other while the target
/// runs, and without the flag `malloc` would count calls whose `free` is
/// not probed yet.
#[map]
static ENABLED: Array<u32> = Array::with_max_entries(1, 0);

/// Whether [`ENABLED`] is set: the programs count nothing until it is.
#[inline(always)]
pub(crate) fn enabled() -> bool {
    ENABLED.get(0).is_some_and(|e| *e != 0)
}

/// Two halves: `[0, N)` updated with plain adds by the program that owns
/// its CPU (see [`OWNER`]), `[N, 2N)` with atomic adds by everything
/// else; the tracer adds the halves.
#[map]
pub(crate) static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(2 * counter::N, 0);

/// Per CPU and level of [`WALK`]: 1 while a program holds the level. The
/// program at level 0 owns its CPU's counts and updates them with plain
/// adds. A uprobe program can be preempted, by another thread that runs
/// the same program on the same CPU: that one takes a higher level and
/// adds atomically to counts of its own, so no plain read-modify-write is
/// ever interleaved with another on the same word.
#[map]
pub(crate) static OWNER: PerCpuArray<u32> = PerCpuArray::with_max_entries(WALK_LEVELS, 0);

/// Per-thread mode: each thread's name (`comm`), under its thread id, once
/// it has a key of its own (or a walk handed over).
#[map]
pub(crate) static THREAD_NAMES: HashMap<u32, Comm> =
    HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

/// Sampled by bytes: bytes left until the next sample, per CPU. The byte
/// stream of each CPU is sampled as a Poisson process; a thread that moves
/// between CPUs just continues another CPU's countdown, which the
/// memorylessness of exponential intervals makes harmless.
#[map]
pub(crate) static COUNTDOWN: PerCpuArray<i64> = PerCpuArray::with_max_entries(1, 0);

/// Live mode: the thread's allocating call between its entry and its
/// return, in task-local storage (no shared hash map on the hot path).
#[unsafe(link_section = ".maps")]
#[unsafe(export_name = "PENDING")]
pub(crate) static PENDING: TaskStorage<Pending> = TaskStorage::new();

/// Live mode: a thread's call of an inlined copy of CPython's allocator,
/// from its guard to where its block is known (`memptr` holds the copy's
/// number). Apart from [`PENDING`]: a copy left another way (a failed
/// allocation) leaves an entry no later call is taken for nested in.
#[unsafe(link_section = ".maps")]
#[unsafe(export_name = "INLINE_PENDING")]
pub(crate) static INLINE_PENDING: TaskStorage<Pending> = TaskStorage::new();

/// A Python process's threads: each one's Python thread state, found once
/// and checked at each call, or the mark that it has none
/// ([`PyThreadSeen`]). Task-local: it goes with the thread.
#[unsafe(link_section = ".maps")]
#[unsafe(export_name = "PY_THREADS")]
pub(crate) static PY_THREADS: TaskStorage<PyThreadSeen> = TaskStorage::new();

/// Host scope: per (process, function, caller's place in its file), calls
/// and bytes, shared by the CPUs and added to atomically (a per-CPU entry
/// takes its values from the kernel's per-CPU allocator at each new key,
/// which every new process makes). Not preallocated (size set by the
/// tracer).
#[map]
pub(crate) static HOST_COUNTS: HashMap<HostKey, HostValue> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// Host scope: exact calls (`[f]`) and bytes (`[MAX_HOST_FUNCS + f]`) per
/// function-table row, kept apart from `HOST_COUNTS` so that they stay
/// exact when it is full.
#[map]
pub(crate) static HOST_TOTALS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(2 * MAX_HOST_FUNCS, 0);

/// Host scope: the function table, filled by the tracer before each
/// file's probes go in.
#[map]
pub(crate) static HOST_FUNCS: Array<HostFunc> = Array::with_max_entries(MAX_HOST_FUNCS, 0);

/// Host scope: each file's allocator bodies, by the index its functions
/// name.
#[map]
pub(crate) static HOST_BODIES: Array<HostBodies> = Array::with_max_entries(MAX_HOST_FILES, 0);

/// Host scope: each process's name (`comm`) when its first key was made.
#[map]
pub(crate) static HOST_NAMES: HashMap<HostProcess, HostName> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// Host scope: each process's runs of the allocation program (every trap
/// taken, nested calls included), by process id: what the windows policy
/// weighs each process's cost by.
#[map]
pub(crate) static HOST_RUNS: HashMap<u32, u64> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// Host scope: processes that exec'd, for the tracer.
#[map]
pub(crate) static HOST_EXECS: RingBuf = RingBuf::with_byte_size(1 << 18, 0);

/// Host scope: the tracer's own process id (its allocations are not the
/// host's).
#[map]
pub(crate) static HOST_SELF: Array<u32> = Array::with_max_entries(1, 0);

/// Host scope: each stack's frames ([`tracer_common::host_frame`]s), by
/// its key (size set by the tracer).
#[map]
pub(crate) static HOST_STACKS: HashMap<u64, StackFrames> =
    HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

/// Host scope: unwind rules by file and offset (a `host_frame`), filled
/// by the tracer, shared by every process that maps the file (size set by
/// the tracer).
#[map]
pub(crate) static HOST_RULES: HashMap<u64, UnwindRule> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// The code objects whose copy went to the tracer (`PyCodeSnap`), by
/// process, address and check: copied once each while they are met.
#[map]
pub(crate) static PY_CODES_SENT: LruHashMap<PyCodeKey, u8> = LruHashMap::with_max_entries(8192, 0);

/// Host scope: the file mappings walks met, by process incarnation and
/// 64 KiB window (size set by the tracer).
#[map]
pub(crate) static HOST_VMAS: LruHashMap<HostVmaKey, HostVma> =
    LruHashMap::with_max_entries(16384, 0);

/// Host scope: each file's tag.
#[map]
pub(crate) static HOST_FILE_TAGS: HashMap<HostFileId, u32> =
    HashMap::with_max_entries(MAX_HOST_TAGS, BPF_F_NO_PREALLOC);

/// Host scope: each tag's file (written before the tag is given out).
#[map]
pub(crate) static HOST_TAG_FILES: Array<HostFileId> = Array::with_max_entries(MAX_HOST_TAGS, 0);

/// Host scope: each process's incarnation (a number never given twice),
/// by process id: what keeps one process's mappings from another's that
/// reused its id.
#[map]
pub(crate) static HOST_GENS: HashMap<u32, u64> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// Host scope narrowed to a process tree: its process ids (size set by
/// the tracer).
#[map]
pub(crate) static HOST_SCOPE_PIDS: HashMap<u32, u32> =
    HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// Host scope narrowed to cgroups: their cgroup v2 ids (value 1), and
/// under key 0 (no cgroup's id) the levels below the root they lie at,
/// one bit per level.
#[map]
pub(crate) static HOST_SCOPE_CGROUPS: HashMap<u64, u32> = HashMap::with_max_entries(64, 0);

/// Host scope: the interpreter layout of each process that runs CPython,
/// by process id (put in by the tracer; an exec or the process's end
/// takes it out).
#[map]
pub(crate) static HOST_PYTHON: HashMap<u32, PythonLayout> =
    HashMap::with_max_entries(4096, BPF_F_NO_PREALLOC);

/// Host scope: the interpreter layout each tagged file holds, `runtime`
/// from the file's code mapping's base (put in by the tracer).
#[map]
pub(crate) static HOST_PY_FILES: HashMap<u32, PythonLayout> = HashMap::with_max_entries(256, 0);

/// Host scope: the next incarnation, the next tag and the interpreter
/// epoch (`tracer_common::HOST_NEXT_GEN`, ...).
#[map]
pub(crate) static HOST_NEXT: Array<u64> =
    Array::with_max_entries(tracer_common::HOST_NEXT_SLOTS, 0);

/// Host scope: the start of a `vm_area_struct`, copied by `bpf_find_vma`'s
/// callback for the walk at each scratch level.
#[map]
pub(crate) static HOST_VMA_COPY: PerCpuArray<VmaCopy> =
    PerCpuArray::with_max_entries(WALK_LEVELS, 0);

/// A copy of the start of a `vm_area_struct` (`found` 0: none made).
#[repr(C)]
pub(crate) struct VmaCopy {
    pub vma: [u8; VMA_COPY],
    pub found: u64,
}

/// Host scope: each thread's last counted entry.
#[unsafe(link_section = ".maps")]
#[unsafe(export_name = "HOST_MARKS")]
pub(crate) static HOST_MARKS: TaskStorage<HostMark> = TaskStorage::new();

/// A BTF-defined task storage map (aya-ebpf 0.2.1 has none): one value per
/// thread, created on first use.
#[repr(C)]
pub(crate) struct TaskStorage<T> {
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
    pub(crate) fn current(&self, create: bool) -> Option<&mut T> {
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
/// target's hot path). One ring per CPU (modulo `EVENT_RINGS`), so that
/// threads on different CPUs do not contend for one ring.
/// Submitted without waking the tracer (a wake-up per event would cost
/// the target a context switch): the tracer drains the rings on a timer.
/// Sizes are set by the tracer.
macro_rules! event_rings {
    ($($name:ident),*) => {
        $(
            #[map]
            pub(crate) static $name: RingBuf = RingBuf::with_byte_size(4096, 0);
        )*
    };
}

event_rings!(EVENTS0, EVENTS1, EVENTS2, EVENTS3, EVENTS4, EVENTS5, EVENTS6, EVENTS7);

/// Live mode: frees whose event found the ring full (see `LostFree`), in
/// order; sized by the tracer.
#[map]
pub(crate) static LOST_FREES: Queue<LostFree> = Queue::with_max_entries(1, 0);

/// Live mode: blocks whose allocation event found the ring full (see
/// `LostAlloc`), in order; sized by the tracer.
#[map]
pub(crate) static LOST_ALLOCS: Queue<LostAlloc> = Queue::with_max_entries(1, 0);
