//! Run-time settings the tracer writes into the BPF object before loading.

use crate::{PythonLayout, EXP_TABLE_LEN, WEIGHT_TABLE_LEN};

/// Maximum number of allocator body ranges the nesting check compares
/// (a power of two: the BPF side searches them by halving).
pub const MAX_BODY_RANGES: usize = 64;

/// Most ranges of [`ProcessConfig::free_bodies`].
pub const MAX_FREE_BODIES: usize = MAX_BODY_RANGES;

/// Address range `[start, end)` of an allocator function in the target.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BodyRange {
    pub start: u64,
    pub end: u64,
}

/// Run-time settings the tracer writes into the BPF object before loading.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Non-zero: key the aggregation by thread id.
    pub per_thread: u32,
    /// Non-zero: live mode (track every block until it is freed).
    pub live: u32,
    /// `SAMPLE_NONE`, `SAMPLE_BYTES` or `SAMPLE_EVERY`.
    pub sample_mode: u32,
    /// Most frames a walk keeps above the direct caller (`--max-stack`,
    /// at most `MAX_FRAMES`); 0: the direct caller only, no walk.
    pub max_frames: u32,
    /// Mean bytes between samples, or N of one-in-N.
    pub sample_param: u64,
    /// One-in-N: `-1 / ln(1 - 1/N)` in 16.16, the scale that turns an
    /// exponential draw `E` into the geometric gap `floor(scale * E) + 1`
    /// between sampled calls (0 for N = 1: every call).
    pub sample_scale: u64,
    /// `-ln((i + 0.5) / EXP_TABLE_LEN)` in 16.16 (bytes sampling).
    pub exp_table: [u32; EXP_TABLE_LEN],
    /// `1 / (1 - exp(-x))` in 16.16 for `x = (WEIGHT_TABLE_START + i) / 256`.
    pub weight_table: [u32; WEIGHT_TABLE_LEN],
    /// Where the kernel keeps the return addresses its return probes hid.
    pub kernel: KernelOffsets,
    /// Where it keeps a mapping's file (the host scope's callers).
    pub vma: crate::VmaOffsets,
    /// Non-zero: the host scope counts each process's program runs
    /// (`HOST_RUNS`, for the windows policy).
    pub host_runs: u32,
    /// Which callers the host scope counts: [`SCOPE_ALL`], [`SCOPE_TREE`]
    /// or [`SCOPE_CGROUP`].
    pub host_scope: u32,
    /// Non-zero: every process the programs walk in is followed by the
    /// tracer with ptrace (launch mode), so a thread whose walk's copy
    /// finds a quarter of the ring of walks taken is sent [`THROTTLE_SIGNAL`] and
    /// its tracer holds it until the ring is drained, rather than the
    /// next copies being lost. Zero where a process is not followed (by
    /// pid, a cgroup, the host): the signal would reach the program.
    pub throttle: u32,
    pub _pad: u32,
}

/// The signal a throttled thread is stopped with (see
/// [`Config::throttle`]): its default action is to be ignored, should it
/// ever reach the program.
pub const THROTTLE_SIGNAL: u32 = 23; // SIGURG

/// The host scope counts every process.
pub const SCOPE_ALL: u32 = 0;
/// The host scope counts the processes of `HOST_SCOPE_PIDS` only.
pub const SCOPE_TREE: u32 = 1;
/// The host scope counts the processes of the cgroups of
/// `HOST_SCOPE_CGROUPS` and their descendants only.
pub const SCOPE_CGROUP: u32 = 2;

/// Deepest cgroup level below a scope's cgroup that the programs look
/// up (a process deeper is out of scope, and counted).
pub const SCOPE_CGROUP_LEVELS: u32 = 32;

/// Byte offsets in the running kernel's structures (from its BTF) of what
/// leads from the current task to the return addresses a uretprobe
/// replaced with the kernel's trampoline: `task_struct.utask`,
/// `uprobe_task.return_instances`, each `return_instance`'s `stack` (the
/// stack slot it replaced), `orig_ret_vaddr` and `next`; and the
/// trampoline's address, `task_struct.mm` -> `mm_struct.uprobes_state.
/// xol_area` -> `xol_area.vaddr`. `known` is 0 when the kernel's BTF does
/// not have them all: hidden return addresses then end the walk. Beside
/// them, `task_struct.blocked` (see `task_blocked`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    pub known: u32,
    pub task_utask: u32,
    pub task_mm: u32,
    pub mm_xol_area: u32,
    pub xol_vaddr: u32,
    pub utask_returns: u32,
    pub return_stack: u32,
    pub return_orig: u32,
    pub return_next: u32,
    /// `task_struct.blocked` (the thread's blocked signals), 0 when not
    /// known: read whatever `known` says.
    pub task_blocked: u32,
}

/// What the programs know of the process they serve, written by the
/// tracer before its probes go in: in a map, not in [`Config`], since a
/// loaded object serves one process after another.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessConfig {
    /// The main thread's stack pointer at exec (its frames lie below it;
    /// above are its arguments, environment and a random gap of up to 8
    /// KiB): where a walk's copy of the main thread's stack may end. 0:
    /// unknown.
    pub stack_start: u64,
    /// How many entries of `bodies` and `free_bodies` are valid.
    pub n_bodies: u32,
    pub n_free_bodies: u32,
    /// Bodies of the probed allocator functions in the target's address
    /// space: a call whose return address lies in one is the allocator
    /// calling itself (realloc -> malloc) and is not counted again.
    pub bodies: [BodyRange; MAX_BODY_RANGES],
    /// Bodies of probed releasing functions whose own free is the free
    /// they were called for (CPython's `PyObject_Free` -> free): that
    /// free is not counted again.
    pub free_bodies: [BodyRange; MAX_FREE_BODIES],
    /// Its CPython interpreter, when it runs one the programs can read.
    pub python: PythonLayout,
}

impl Default for ProcessConfig {
    fn default() -> Self {
        ProcessConfig {
            stack_start: 0,
            n_bodies: 0,
            n_free_bodies: 0,
            bodies: [BodyRange::default(); MAX_BODY_RANGES],
            free_bodies: [BodyRange::default(); MAX_FREE_BODIES],
            python: PythonLayout::default(),
        }
    }
}
