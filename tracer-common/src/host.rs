//! The host scope (`--all`): programs attached file-wide, in every process
//! that maps an allocator, aggregating by process and by the direct
//! caller's place in its file (device, inode, file offset), which stays
//! meaningful after the process is gone.

use crate::BodyRange;

/// Rows of the host's function table (probe sites of every allocator file
/// on the host); the attach cookie's function bits.
pub const MAX_HOST_FUNCS: u32 = 1024;

/// Files whose allocator bodies the host's nesting check knows.
pub const MAX_HOST_FILES: u32 = 256;

/// Body ranges (file offsets) kept per file: as many as a traced
/// process's (the programs search both alike).
pub const MAX_HOST_BODIES: usize = crate::MAX_BODY_RANGES;

/// Aggregation key of the host scope: one allocating function of one
/// process, called from one return address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HostKey {
    pub tgid: u32,
    pub func: u32,
    /// The process's address space (`task_struct.mm`): a new one at each
    /// exec, so that what a process ran before and after an exec are told
    /// apart (a shell's child before it execs the command). 0 when the
    /// kernel's layout is not known.
    pub mm: u64,
    /// The return address.
    pub ret: u64,
}

/// [`HostKey`]'s process: its id and address space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostProcess {
    pub tgid: u32,
    pub _pad: u32,
    pub mm: u64,
}

/// Where a return address lies, looked up once per key (when the program
/// that makes the key runs; on other CPUs' copies of the value, `place` is
/// [`PLACE_UNKNOWN`]).
pub const PLACE_UNKNOWN: u32 = 0;
/// In a file: `dev`, `ino` and `offset` say where.
pub const PLACE_FILE: u32 = 1;
/// In no file (a JIT's code).
pub const PLACE_ANONYMOUS: u32 = 2;
/// Its mapping could not be looked up (the process's memory map was
/// locked, or the kernel's layout is not known).
pub const PLACE_UNRESOLVED: u32 = 3;

/// Calls and requested bytes (added atomically: per CPU, but a uprobe
/// program can be preempted by another thread's on the same CPU), and the
/// return address's place in its file, which stays meaningful after the
/// process is gone.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostValue {
    pub calls: u64,
    pub bytes: u64,
    /// The file's device as the kernel numbers it (major << 20 | minor).
    pub dev: u32,
    pub place: u32,
    pub ino: u64,
    /// The return address's offset in the file.
    pub offset: u64,
}

/// What the programs know of a host function-table row.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostFunc {
    /// Index of its file in the bodies table.
    pub file: u32,
    pub _pad: u32,
    /// File offset of the probed instruction: the probe's address less it
    /// is the file's load bias (address minus file offset) in the process.
    pub probe_offset: u64,
}

/// The probed allocator functions' bodies (and the internals) of one
/// file, as file offsets, sorted and not overlapping.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostBodies {
    pub n: u32,
    pub _pad: u32,
    pub ranges: [BodyRange; MAX_HOST_BODIES],
}

impl Default for HostBodies {
    fn default() -> Self {
        HostBodies {
            n: 0,
            _pad: 0,
            ranges: [BodyRange::default(); MAX_HOST_BODIES],
        }
    }
}

/// A thread's last counted allocator entry in the host scope, in its task
/// storage: the tail-call check, and where that function's file lies in
/// the process (a call from inside its body is the allocator's own).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMark {
    pub ip: u64,
    pub sp: u64,
    pub ret: u64,
    /// Load bias of `file` in the process.
    pub base: u64,
    /// The process's address space (`task_struct.mm`), read once per
    /// thread and exec; 0: not read yet.
    pub mm: u64,
    pub file: u32,
    /// 0: no entry counted since the thread's last exec.
    pub set: u32,
}

/// Longest executable path an exec event carries.
pub const HOST_EXEC_PATH: usize = 256;

/// A process exec'd (the `sched_process_exec` tracepoint): the tracer
/// looks at its files for allocators not probed yet, and keeps its name.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostExec {
    pub tgid: u32,
    pub _pad: u32,
    /// Its new address space (see [`HostKey::mm`]).
    pub mm: u64,
    /// The path given to exec, NUL-terminated.
    pub path: [u8; HOST_EXEC_PATH],
}

/// Where the running kernel keeps what leads from a memory mapping to its
/// file's identity (from its BTF): `vm_area_struct`'s `vm_start`,
/// `vm_pgoff` and `vm_file`, `file.f_inode`, `inode`'s `i_ino` and `i_sb`,
/// `super_block.s_dev`. `known` 0: callers are kept as addresses.
/// Also where an exec keeps its path.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmaOffsets {
    pub known: u32,
    pub vm_start: u32,
    pub vm_pgoff: u32,
    pub vm_file: u32,
    pub file_inode: u32,
    pub inode_ino: u32,
    pub inode_sb: u32,
    pub sb_dev: u32,
    /// `linux_binprm.filename`: the path an exec was given (the exec
    /// tracepoint's), 0 when unknown.
    pub binprm_filename: u32,
    pub _pad: u32,
}

/// Bytes of a `vm_area_struct` the programs copy (every offset of
/// [`VmaOffsets`] into it lies below this).
pub const VMA_COPY: usize = 256;
