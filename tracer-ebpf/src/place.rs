//! Where an address of the current process lies, looked up in the kernel
//! with `bpf_find_vma` for the host scope: a walk's return addresses as
//! their file's tag and offset (the mapping remembered per window of
//! addresses and per process incarnation, the file's tag given once), and
//! a new key's direct caller as its file's device, inode and offset.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_probe_read_kernel, bpf_probe_read_kernel_buf,
        generated::{bpf_find_vma, bpf_get_current_task_btf},
    },
};
use tracer_common::{
    counter, host_frame, HostFileId, HostValue, HostVma, HostVmaKey, WalkScratch, HOST_NEXT_TAG,
    HOST_RAW_ANON, HOST_RAW_BUSY, HOST_VMA_WINDOW_SHIFT, MAX_HOST_TAGS, PLACE_ANONYMOUS,
    PLACE_FILE, PLACE_UNRESOLVED, VMA_COPY, VM_EXEC,
};

use crate::{
    aggregate::{bump_counter, EEXIST},
    incarnation::next_number,
    maps::{config_u32, CONFIG, HOST_FILE_TAGS, HOST_TAG_FILES, HOST_VMAS, HOST_VMA_COPY},
    scratch::level_of,
};

/// The incarnation of a process the table had no room for: its mappings
/// are never remembered.
pub(crate) const NO_GEN: u64 = tracer_common::HOST_GEN_NONE;

/// Return address `addr` of the walk's process (incarnation
/// `w.host_gen`) as a stack frame: its file's tag and its offset in the
/// file ([`host_frame`]), else the address (in no file, or its mapping not
/// found; `w.host_raw` says which). The mapping is remembered per 64 KiB
/// window of addresses.
#[inline(always)]
pub(crate) fn host_place(w: &mut WalkScratch, addr: u64) -> u64 {
    let gen = w.host_gen;
    w.host_raw = 0;
    let key = HostVmaKey {
        gen,
        window: addr >> HOST_VMA_WINDOW_SHIFT,
    };
    if gen != NO_GEN {
        if let Some(v) = unsafe { HOST_VMAS.get(&key) } {
            if v.start <= addr && addr < v.end {
                if v.tag != 0 {
                    return host_frame(v.tag, addr - v.bias);
                }
                w.host_raw = if v.code != 0 { HOST_RAW_ANON } else { 0 };
                return addr;
            }
        }
    }
    let mut busy = false;
    let Some(vma) = find_mapping(level_of(w), addr, &mut busy) else {
        if busy {
            w.host_raw = HOST_RAW_BUSY;
        }
        return addr;
    };
    if gen != NO_GEN {
        let _ = HOST_VMAS.insert(&key, &vma, 0);
    }
    if vma.tag != 0 {
        return host_frame(vma.tag, addr - vma.bias);
    }
    w.host_raw = if vma.code != 0 { HOST_RAW_ANON } else { 0 };
    addr
}

/// `bpf_find_vma`'s error when the mapping lock was taken (by the process
/// changing its mappings, or one waiting to).
const EBUSY: i64 = 16;

/// The mapping that holds `addr` in the current process, with its file's
/// tag (0: no file); `None` when it cannot be looked up (`busy` set when
/// it may be on another try).
#[inline(never)]
fn find_mapping(level: u64, addr: u64, busy: &mut bool) -> Option<HostVma> {
    let o = &CONFIG.vma;
    if config_u32(&o.known) == 0 {
        return None;
    }
    let copy = HOST_VMA_COPY.get_ptr_mut(level as u32)?;
    unsafe { (*copy).found = 0 };
    let mut at = level;
    let r = unsafe {
        bpf_find_vma(
            bpf_get_current_task_btf(),
            addr,
            copy_vma_to_map as *mut core::ffi::c_void,
            &mut at as *mut u64 as *mut core::ffi::c_void,
            0,
        )
    };
    if r == -EBUSY {
        *busy = true;
        return None;
    }
    if r != 0 || unsafe { (*copy).found } == 0 {
        return None;
    }
    let found = unsafe { &*copy };
    let field = |at: u32| vma_field(&found.vma, at);
    let start = field(config_u32(&o.vm_start));
    let end = field(config_u32(&o.vm_start) + 8);
    let pgoff = field(config_u32(&o.vm_pgoff));
    let file = field(config_u32(&o.vm_file));
    // Code unless the flags say otherwise (a stack or heap address the
    // walk went astray to is no JIT's).
    let flags_at = config_u32(&o.vm_flags);
    let code = flags_at == 0 || field(flags_at) & VM_EXEC != 0;
    let mut vma = HostVma {
        start,
        end,
        bias: start.wrapping_sub(pgoff << 12),
        tag: 0,
        code: code as u32,
    };
    if file != 0 {
        let id = file_identity(file)?;
        vma.tag = tag_of(&id);
        if vma.tag == 0 {
            return None;
        }
    }
    Some(vma)
}

/// File `id`'s tag, given now if it has none (0: the table is full).
#[inline(always)]
fn tag_of(id: &HostFileId) -> u32 {
    if let Some(t) = unsafe { HOST_FILE_TAGS.get(id) } {
        return *t;
    }
    let Some(tag) = next_number(HOST_NEXT_TAG) else {
        bump_counter(counter::HOST_NO_TAG, 1);
        return 0;
    };
    if tag >= (MAX_HOST_TAGS / 2) as u64 {
        bump_counter(counter::HOST_NO_TAG, 1);
        return 0;
    }
    let tag = tag as u32;
    // The tag's file first: a tag found in the table names its file.
    if let Some(slot) = HOST_TAG_FILES.get_ptr_mut(tag) {
        unsafe { *slot = *id };
    }
    match HOST_FILE_TAGS.insert(id, &tag, BPF_NOEXIST as u64) {
        Ok(()) => tag,
        Err(e) if e == -EEXIST => unsafe { HOST_FILE_TAGS.get(id) }.copied().unwrap_or(0),
        Err(_) => {
            bump_counter(counter::HOST_NO_TAG, 1);
            0
        }
    }
}

/// `bpf_find_vma`'s callback for [`find_mapping`]: copies the start of
/// the mapping's `vm_area_struct` into this CPU's `HOST_VMA_COPY` entry of
/// the walk's scratch level (`ctx`; a callback's context must be on the
/// stack, too small for the copy).
#[inline(never)]
extern "C" fn copy_vma_to_map(
    _task: *mut core::ffi::c_void,
    vma: *mut core::ffi::c_void,
    ctx: *mut core::ffi::c_void,
) -> i64 {
    let level = unsafe { *(ctx as *const u64) };
    if let Some(copy) = HOST_VMA_COPY.get_ptr_mut(level as u32) {
        if unsafe { bpf_probe_read_kernel_buf(vma as *const u8, &mut (*copy).vma) }.is_ok() {
            unsafe { (*copy).found = 1 };
        }
    }
    0
}

/// What the mapping callback fills in.
#[repr(C)]
struct VmaFound {
    vma: [u8; VMA_COPY],
    found: u64,
}

/// Puts where return address `ret` lies in `v`: its file and offset in
/// it, or that it lies in no file, or that its mapping could not be
/// looked up.
#[inline(always)]
pub(crate) fn caller_place(ret: u64, v: &mut HostValue) {
    v.place = PLACE_UNRESOLVED;
    let o = &CONFIG.vma;
    if config_u32(&o.known) == 0 || ret == 0 {
        return;
    }
    let mut found = VmaFound {
        vma: [0; VMA_COPY],
        found: 0,
    };
    let r = unsafe {
        bpf_find_vma(
            bpf_get_current_task_btf(),
            ret,
            copy_vma as *mut core::ffi::c_void,
            &mut found as *mut VmaFound as *mut core::ffi::c_void,
            0,
        )
    };
    if r == -2 {
        // -ENOENT: no mapping there.
        v.place = PLACE_ANONYMOUS;
        return;
    }
    if r != 0 || found.found == 0 {
        return;
    }
    let field = |at: u32| vma_field(&found.vma, at);
    let file = field(config_u32(&o.vm_file));
    if file == 0 {
        v.place = PLACE_ANONYMOUS;
        return;
    }
    let Some(id) = file_identity(file) else {
        return;
    };
    v.dev = id.dev;
    v.ino = id.ino;
    let start = field(config_u32(&o.vm_start));
    let pgoff = field(config_u32(&o.vm_pgoff));
    v.offset = ret.wrapping_sub(start).wrapping_add(pgoff << 12);
    v.place = PLACE_FILE;
}

/// The word at byte `at` of a copy of a `vm_area_struct`.
#[inline(always)]
fn vma_field(vma: &[u8; VMA_COPY], at: u32) -> u64 {
    let at = (at as usize) & (VMA_COPY - 8);
    u64::from_ne_bytes([
        vma[at],
        vma[at + 1],
        vma[at + 2],
        vma[at + 3],
        vma[at + 4],
        vma[at + 5],
        vma[at + 6],
        vma[at + 7],
    ])
}

/// The identity (device and inode) of the file of a mapping whose
/// `vm_file` is `file`; `None` when it cannot be read.
#[inline(always)]
fn file_identity(file: u64) -> Option<HostFileId> {
    let o = &CONFIG.vma;
    let read = |a: u64| unsafe { bpf_probe_read_kernel(a as *const u64) }.unwrap_or(0);
    let inode = read(file + config_u32(&o.file_inode) as u64);
    if inode == 0 {
        return None;
    }
    let sb = read(inode + config_u32(&o.inode_sb) as u64);
    if sb == 0 {
        return None;
    }
    Some(HostFileId {
        dev: unsafe { bpf_probe_read_kernel((sb + config_u32(&o.sb_dev) as u64) as *const u32) }
            .unwrap_or(0),
        _pad: 0,
        ino: read(inode + config_u32(&o.inode_ino) as u64),
    })
}

/// `bpf_find_vma`'s callback: copies the start of the mapping's
/// `vm_area_struct` (the offsets of [`VmaOffsets`](tracer_common::VmaOffsets)
/// are read from the copy: the verifier allows no variable offset into the
/// pointer it hands over).
#[inline(never)]
extern "C" fn copy_vma(
    _task: *mut core::ffi::c_void,
    vma: *mut core::ffi::c_void,
    ctx: *mut core::ffi::c_void,
) -> i64 {
    let found = unsafe { &mut *(ctx as *mut VmaFound) };
    if unsafe { bpf_probe_read_kernel_buf(vma as *const u8, &mut found.vma) }.is_ok() {
        found.found = 1;
    }
    0
}
