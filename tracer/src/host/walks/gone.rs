//! What the tracer knows of a process gone when it finishes its walk:
//! the mappings the kernel met, and the files they map, opened by
//! identity through a path a process or an exec named them by.

use std::{
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use tracer_common::{host_frame_parts, HostVmaKey, MissEvent, UnwindRule, HOST_VMA_WINDOW_SHIFT};

use super::{lock_paths, HostWalks};
use crate::{
    tracee::{AddressSpace, FileId, Mapping},
    unwind::ObjectCfi,
};

/// Files kept loaded for rules learned from a file alone.
const OBJECTS_KEPT: usize = 4096;

/// `path`, opened, when it is the file `key` (device and inode).
fn open_if(path: &Path, key: (u32, u64)) -> Option<std::fs::File> {
    let f = std::fs::File::open(path).ok()?;
    (crate::host::files::key_of_path(&PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd())))
        == Some(key))
    .then_some(f)
}

impl HostWalks {
    /// Adds to `space` what is known of the address space of `ev`'s
    /// process, gone: the mappings the kernel remembered under its
    /// incarnation (`HOST_VMAS`) for the walk's return address, its direct
    /// caller, the probed function and the executable's code, each file
    /// opened by identity. Whether `space` then maps the return address,
    /// and whether a file could not be opened.
    pub(super) fn add_known_mappings(
        &mut self,
        ev: &MissEvent,
        space: &mut AddressSpace,
    ) -> (bool, bool) {
        let mut unopened = false;
        for addr in [ev.ra, ev.caller, ev.ip, ev.exe] {
            // A mapping read from `/proc` whose file could not be opened
            // then (the process exec'ing or exiting) is known no better
            // than none: the kernel's, whose file opens, goes over it.
            if addr == 0
                || space
                    .mapping(addr)
                    .is_some_and(|m| space.file(&m.path).is_some())
            {
                continue;
            }
            let key = HostVmaKey {
                gen: ev.gen,
                window: addr >> HOST_VMA_WINDOW_SHIFT,
            };
            let Ok(vma) = self.vmas.get(&key, 0) else {
                continue;
            };
            if vma.tag == 0 || !(vma.start <= addr && addr < vma.end) {
                continue;
            }
            let Some(file) = self.file_of(vma.tag) else {
                continue;
            };
            let Some((opened, path)) = self.open_file(file) else {
                unopened = true;
                continue;
            };
            let mapping = Mapping {
                start: vma.start,
                end: vma.end,
                perms: "r-xp".into(),
                offset: vma.start - vma.bias,
                dev: ((file.0 >> 20) as u64) << 32 | (file.0 & 0xfffff) as u64,
                inode: file.1,
                path,
            };
            space.add_mapped(mapping, opened);
        }
        (space.mapping(ev.ra).is_some(), unopened)
    }

    /// The rule of `frame` (a file and an offset in it) from the file's
    /// call-frame information, the file opened by a path a process or an
    /// exec named it by; `None` when no such path opens it.
    pub(super) fn rule_in_file(&mut self, frame: u64) -> Option<UnwindRule> {
        let (tag, offset) = host_frame_parts(frame)?;
        let key = self.file_of(tag)?;
        let obj = match self.objects.get(&key) {
            Some(o) => o.clone(),
            None => {
                let loaded = self.open_file(key).and_then(|(f, _)| {
                    let id = FileId::of_file(&f)?;
                    let fd_path = PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
                    ObjectCfi::shared(id, &fd_path, Path::new("/usr/lib/debug")).ok()
                });
                if self.objects.len() >= OBJECTS_KEPT {
                    self.objects.clear();
                }
                self.objects.insert(key, loaded.clone());
                loaded
            }
        }?;
        // The file offset as an address of a mapping at 0 from offset 0.
        let svma = obj.svma_for(0, 0, offset)?;
        Some(obj.rule_for_ra(svma))
    }

    /// File `key` (device, inode), opened, and its path: by a path a
    /// process or an exec named it by.
    pub(super) fn open_file(&mut self, key: (u32, u64)) -> Option<(std::fs::File, String)> {
        let known = lock_paths(&self.paths).get(&key).cloned();
        if let Some(f) = known.as_deref().and_then(|p| open_if(p, key)) {
            return Some((f, known?.to_string_lossy().into_owned()));
        }
        self.index.find(std::iter::once(key));
        self.index.open(key)
    }
}
