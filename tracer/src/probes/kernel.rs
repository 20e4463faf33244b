//! Where the running kernel keeps the return addresses its return probes
//! hid ([`KernelOffsets`]), from its BTF: another tool's uretprobe on a
//! function the target runs replaces that function's return address on the
//! stack with the kernel's trampoline, and the programs take the real one
//! from the thread's pending returns.

use std::sync::OnceLock;

use btf_rs::{Backend, Btf, Member, Type};
use tracer_common::{KernelOffsets, VmaOffsets, VMA_COPY};

/// The offsets, worked out once per run (`known` 0 when the kernel's BTF
/// lacks one of them: hidden return addresses then end a stack, as they
/// did before).
pub fn offsets() -> KernelOffsets {
    static OFFSETS: OnceLock<KernelOffsets> = OnceLock::new();
    *OFFSETS.get_or_init(|| {
        let started = std::time::Instant::now();
        let found = read();
        match found {
            Some(k) if k.known == 1 => log::debug!(
                "kernel BTF: offsets of pending return probes read in {:.1} ms",
                started.elapsed().as_secs_f64() * 1e3
            ),
            _ => log::debug!("kernel BTF: no offsets of pending return probes"),
        }
        found.unwrap_or_default()
    })
}

/// Where the kernel keeps a mapping's start, page offset and file, and a
/// file's device and inode (the host scope's callers); `known` 0 when its
/// BTF lacks one, or one lies beyond the part of a mapping the programs
/// copy.
pub fn vma_offsets() -> VmaOffsets {
    static OFFSETS: OnceLock<VmaOffsets> = OnceLock::new();
    *OFFSETS.get_or_init(|| {
        let btf = kernel_btf();
        let found = btf.and_then(|btf| {
            let at = |st: &str, member: &str| offset_of(&btf, st, member);
            let o = VmaOffsets {
                known: 1,
                vm_start: at("vm_area_struct", "vm_start")?,
                vm_pgoff: at("vm_area_struct", "vm_pgoff")?,
                vm_file: at("vm_area_struct", "vm_file")?,
                file_inode: at("file", "f_inode")?,
                inode_ino: at("inode", "i_ino")?,
                inode_sb: at("inode", "i_sb")?,
                sb_dev: at("super_block", "s_dev")?,
                binprm_filename: at("linux_binprm", "filename").unwrap_or(0),
                mm_start_stack: at("mm_struct", "start_stack").unwrap_or(0),
                task_tgid: at("task_struct", "tgid").unwrap_or(0),
                mm_start_code: at("mm_struct", "start_code").unwrap_or(0),
                task_real_parent: at("task_struct", "real_parent").unwrap_or(0),
                vm_flags: at("vm_area_struct", "vm_flags").unwrap_or(0),
                task_signal: at("task_struct", "signal").unwrap_or(0),
                signal_live: at("signal_struct", "live").unwrap_or(0),
            };
            let copied = |at: u32| (at as usize) + 8 <= VMA_COPY && at.is_multiple_of(8);
            let o = VmaOffsets {
                vm_flags: if copied(o.vm_flags) { o.vm_flags } else { 0 },
                ..o
            };
            (copied(o.vm_start) && copied(o.vm_pgoff) && copied(o.vm_file)).then_some(o)
        });
        found.unwrap_or_default()
    })
}

/// Starts working the offsets out on a thread of their own (lookups in
/// the kernel's BTF, which take a noticeable part of the start), so that
/// the first load finds them done.
pub fn prepare() {
    std::thread::spawn(offsets);
}

/// The running kernel's BTF, mapped rather than parsed whole: a few
/// lookups in several MiB.
pub fn kernel_btf() -> Option<Btf> {
    let path = "/sys/kernel/btf/vmlinux";
    Btf::from_file_with_backend(path, Backend::Mmap)
        .or_else(|_| Btf::from_file(path))
        .ok()
}

/// The offsets from the kernel's BTF.
fn read() -> Option<KernelOffsets> {
    let btf = kernel_btf()?;
    let at = |st: &str, member: &str| offset_of(&btf, st, member);
    let task_blocked = at("task_struct", "blocked").unwrap_or(0);
    let returns = || {
        Some(KernelOffsets {
            known: 1,
            task_utask: at("task_struct", "utask")?,
            task_mm: at("task_struct", "mm")?,
            mm_xol_area: at("mm_struct", "uprobes_state")? + at("uprobes_state", "xol_area")?,
            xol_vaddr: at("xol_area", "vaddr")?,
            utask_returns: at("uprobe_task", "return_instances")?,
            return_stack: at("return_instance", "stack")?,
            return_orig: at("return_instance", "orig_ret_vaddr")?,
            return_next: at("return_instance", "next")?,
            task_blocked,
        })
    };
    Some(returns().unwrap_or(KernelOffsets {
        task_blocked,
        ..KernelOffsets::default()
    }))
}

/// The byte offset of `member` in struct `name` (looked for in anonymous
/// structs and unions inside it too).
pub fn offset_of(btf: &Btf, name: &str, member: &str) -> Option<u32> {
    btf.resolve_types_by_name(name)
        .ok()?
        .iter()
        .find_map(|t| match t {
            Type::Struct(s) => bits_in(btf, &s.members, member, 0),
            _ => None,
        })
        .filter(|bits| bits % 8 == 0)
        .map(|bits| bits / 8)
}

/// The bit offset of `member` among `members`, `base` bits in.
fn bits_in(btf: &Btf, members: &[Member], member: &str, base: u32) -> Option<u32> {
    members.iter().find_map(|m| {
        let name = btf.resolve_name(m).ok()?;
        if name == member {
            return Some(base + m.bit_offset());
        }
        if !name.is_empty() {
            return None;
        }
        // An anonymous struct or union: through any qualifiers to it.
        let mut t = btf.resolve_chained_type(m).ok()?;
        for _ in 0..8 {
            match t {
                Type::Struct(ref s) | Type::Union(ref s) => {
                    return bits_in(btf, &s.members, member, base + m.bit_offset())
                }
                Type::Const(_) | Type::Volatile(_) | Type::Typedef(_) => {
                    t = btf.resolve_chained_type(t.as_btf_type()?).ok()?
                }
                _ => return None,
            }
        }
        None
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel this runs on has the mapping's offsets, inside the copy.
    #[test]
    fn mapping_offsets_of_the_running_kernel() {
        let o = vma_offsets();
        assert_eq!(o.known, 1, "{o:?}");
        assert_eq!(o.vm_start, 0, "{o:?}");
        assert!(o.vm_file > o.vm_start && o.inode_sb != o.inode_ino, "{o:?}");
        // (In an anonymous union since 6.3: found through it.)
        assert!(
            o.vm_flags > o.vm_start && o.vm_flags.is_multiple_of(8),
            "{o:?}"
        );
    }

    /// The kernel this runs on has them all, each where its struct can
    /// hold it (a word apart in `return_instance`).
    #[test]
    fn offsets_of_the_running_kernel() {
        if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
            assert!(std::env::var_os("CI").is_none(), "no kernel BTF under CI");
            return;
        }
        let k = read().expect("offsets in the kernel's BTF");
        assert_eq!(k.known, 1);
        assert!(k.task_utask > 0 && k.task_mm > 0 && k.task_utask != k.task_mm);
        assert_eq!(k.return_orig, k.return_stack + 8);
        assert!(k.task_blocked > 0 && k.task_blocked != k.task_mm);
        assert!(k.return_next > k.return_orig);
    }
}
