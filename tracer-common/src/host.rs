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
    /// The stack above the direct caller: the key of its frames
    /// ([`crate::stack_hash_step`] over [`host_frame`]s, in
    /// `HOST_STACKS`), 0 when not walked.
    pub stack: u64,
    /// The calling thread with `--per-thread` (named in `THREAD_NAMES`),
    /// else 0.
    pub tid: u32,
    /// 1 when the kernel knew no interpreter of the process at the call
    /// (not one, or not yet), so that Python frames were not looked for.
    pub python_unread: u32,
}

/// [`HostKey`]'s process: its id and address space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostProcess {
    pub tgid: u32,
    pub _pad: u32,
    pub mm: u64,
}

/// `HOST_NAMES`' value: a process's name (`comm`) and its parent's
/// process id when its first key was made (a process gone before the
/// tracer read `/proc` is still named and placed in its tree).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostName {
    pub comm: crate::Comm,
    pub ppid: u32,
    pub _pad: u32,
}

/// Where a return address lies, looked up once per key, by the program
/// that makes the key; [`PLACE_UNKNOWN`] in a value made by the tracer
/// that has not said.
pub const PLACE_UNKNOWN: u32 = 0;
/// In a file: `dev`, `ino` and `offset` say where.
pub const PLACE_FILE: u32 = 1;
/// In no file (a JIT's code).
pub const PLACE_ANONYMOUS: u32 = 2;
/// Its mapping could not be looked up (the process's memory map was
/// locked, or the kernel's layout is not known).
pub const PLACE_UNRESOLVED: u32 = 3;

/// Calls and requested bytes (added atomically: the CPUs share the entry,
/// and a uprobe program can be preempted by another thread's), and the
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
    /// The process's incarnation as this thread last looked it up (0:
    /// not yet), and the count of incarnations ended on the host then
    /// (`HOST_NEXT_ENDS`): it stands while no process's incarnation
    /// ended since.
    pub gen: u64,
    pub ends: u64,
    /// A tree scope: the count of incarnations ended plus one as this
    /// thread found its process in the tree (0: not yet). A process joins
    /// a tree only as it is forked and leaves it only as it ends, an end:
    /// it stands while that count is unchanged.
    pub in_tree: u64,
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
    /// `mm_struct.start_stack`: the main thread's stack pointer at exec
    /// (its frames lie below), 0 when unknown.
    pub mm_start_stack: u32,
    /// `task_struct.tgid`: a forked task's process (the host scope's
    /// process tree), 0 when unknown.
    pub task_tgid: u32,
    /// `mm_struct.start_code`: where the executable's code begins (a
    /// walk finished after its process is gone finds the executable
    /// there), 0 when unknown.
    pub mm_start_code: u32,
    /// `task_struct.real_parent`: a process's parent (named with its
    /// first key), 0 when unknown.
    pub task_real_parent: u32,
    /// `vm_area_struct.vm_flags` (its `VM_EXEC` bit: a mapping of code),
    /// 0 when unknown (then every mapping of no file counts as code).
    pub vm_flags: u32,
    /// `task_struct.signal` and `signal_struct.live`: how many of a
    /// process's threads have not begun to exit (0 at the last one's
    /// exit: the process ended), 0 when unknown (then a process ends
    /// with its main thread).
    pub task_signal: u32,
    pub signal_live: u32,
}

/// `vm_flags`' bit of a mapping whose pages may be executed.
pub const VM_EXEC: u64 = 0x4;

/// Bytes of a `vm_area_struct` the programs copy (every offset of
/// [`VmaOffsets`] into it lies below this).
pub const VMA_COPY: usize = 256;

/// A frame of the host scope's stacks in a file: bit 60 set, the file's
/// tag (`HOST_FILE_TAGS`) in bits 40-55 and the return address's offset in
/// the file below: the same in every process that maps the file, and
/// meaningful once they are gone. A frame without bit 60 is the return
/// address itself (code in no file, or whose mapping could not be looked
/// up). Bit 60 is clear in a Python frame's first word, whose bit 63
/// ([`crate::PY_FRAME`]) no native frame has.
pub const HOST_FRAME_IN_FILE: u64 = 1 << 60;

const _: () = assert!(
    HOST_FRAME_IN_FILE
        & (crate::PY_FRAME | crate::PY_ENTRY | crate::PY_CUT_MARK | crate::PY_CODE_MASK)
        == 0
        && ((MAX_HOST_TAGS as u64 - 1) << HOST_TAG_SHIFT) < HOST_FRAME_IN_FILE
);

/// `HOST_RULES`' key for the rule of process incarnation `gen`'s code in
/// no file (a JIT's): the frame pointer, where the tracer found it leads
/// to a call site, else none. Never a file frame's key (bit 60 clear).
#[inline(always)]
pub const fn host_anon_rule_key(gen: u64) -> u64 {
    HOST_ANON_RULE | (gen & (HOST_FRAME_IN_FILE - 1))
}

/// The mark of a [`host_anon_rule_key`].
pub const HOST_ANON_RULE: u64 = 1 << 61;

/// Why the host scope's walk kept the return address it is at as an
/// address (`WalkScratch::host_raw`): its mapping could not be looked
/// up then (the process was changing its mappings).
pub const HOST_RAW_BUSY: u64 = 1;
/// ... it lies in code no file backs (a JIT's).
pub const HOST_RAW_ANON: u64 = 2;

/// Where a [`HOST_FRAME_IN_FILE`] frame's tag starts.
pub const HOST_TAG_SHIFT: u32 = 40;

/// A [`HOST_FRAME_IN_FILE`] frame's offset bits.
pub const HOST_OFFSET_MASK: u64 = (1 << HOST_TAG_SHIFT) - 1;

/// Files the host scope tags: the programs take tags from 1 up, the
/// tracer (for files only its own walks meet) from the top down.
pub const MAX_HOST_TAGS: u32 = 1 << 16;

/// The frame of offset `offset` in the file tagged `tag`.
#[inline(always)]
pub fn host_frame(tag: u32, offset: u64) -> u64 {
    HOST_FRAME_IN_FILE
        | ((tag as u64 & (MAX_HOST_TAGS as u64 - 1)) << HOST_TAG_SHIFT)
        | (offset & HOST_OFFSET_MASK)
}

/// A frame's file tag and offset, `None` for a return address in no file.
#[inline(always)]
pub fn host_frame_parts(frame: u64) -> Option<(u32, u64)> {
    (frame & HOST_FRAME_IN_FILE != 0).then_some((
        ((frame >> HOST_TAG_SHIFT) & (MAX_HOST_TAGS as u64 - 1)) as u32,
        frame & HOST_OFFSET_MASK,
    ))
}

/// A file as the kernel names it (`HOST_FILE_TAGS`' key, `HOST_TAG_FILES`'
/// value): its device (major << 20 | minor) and inode.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HostFileId {
    pub dev: u32,
    pub _pad: u32,
    pub ino: u64,
}

/// `HOST_VMAS`' key: a process incarnation (`HOST_GENS`) and a 64 KiB
/// window of its address space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HostVmaKey {
    pub gen: u64,
    pub window: u64,
}

/// Bits of an address below a [`HostVmaKey`] window.
pub const HOST_VMA_WINDOW_SHIFT: u32 = 16;

/// A file mapping the host walk met, remembered for its window: valid for
/// the addresses in `[start, end)` only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostVma {
    pub start: u64,
    pub end: u64,
    /// `start` less the mapping's file offset: an address less it is its
    /// offset in the file.
    pub bias: u64,
    /// The file's tag, 0 for a mapping of no file.
    pub tag: u32,
    /// 1 for a mapping of code (executable, or not known not to be).
    pub code: u32,
}

/// The incarnation of a process the table (`HOST_GENS`) had no room for:
/// its mappings are never remembered, and whether it exec'd since a walk
/// cannot be told.
pub const HOST_GEN_NONE: u64 = u64::MAX;

/// `HOST_NEXT`'s slots: the next process incarnation and the next tag;
/// then the interpreter epoch in two parts, each only ever raised: one
/// the programs raise as they find a process runs an interpreter, one the
/// tracer raises (its only writer) as it puts a process's interpreter or
/// an interpreter file in the kernel's tables, after doing so; then the
/// count of incarnations ended.
pub const HOST_NEXT_GEN: u32 = 0;
pub const HOST_NEXT_TAG: u32 = 1;
pub const HOST_NEXT_PY_EPOCH: u32 = 2;
pub const HOST_NEXT_PY_EPOCH_TRACER: u32 = 3;
/// `HOST_NEXT`'s slot of how many process incarnations ended (a process
/// exec'd or ended), raised after each is taken out.
pub const HOST_NEXT_ENDS: u32 = 4;
/// `HOST_NEXT`'s size.
pub const HOST_NEXT_SLOTS: u32 = 5;
