//! The target's user stack, read a chunk at a time into the walk
//! scratch: the leaf both the frame walk (`walk.rs`) and the walk memo's
//! check of the words it remembered (`memo.rs`) read through.

use tracer_common::{WalkScratch, STACK_CHUNK};

/// Reads the target's stack at `addr` into the scratch: `STACK_CHUNK`
/// bytes, or near the top of the stack (where that read fails) 16. False
/// when nothing could be read.
#[inline(always)]
pub(crate) fn load_chunk(w: &mut WalkScratch, addr: u64) -> bool {
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
        } else if unsafe { aya_ebpf::helpers::bpf_probe_read_user_buf(addr as *const u8, frame) }
            .is_ok()
        {
            w.valid = 16;
        } else {
            let word =
                unsafe { core::slice::from_raw_parts_mut(w.chunk.as_mut_ptr() as *mut u8, 8) };
            if unsafe { aya_ebpf::helpers::bpf_probe_read_user_buf(addr as *const u8, word) }
                .is_err()
            {
                w.valid = 0;
                return false;
            }
            w.valid = 8;
        }
    }
    w.base = addr;
    true
}
