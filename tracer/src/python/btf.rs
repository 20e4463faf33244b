//! Where the kernel keeps a thread's fs base (`task_struct.thread.fsbase`),
//! from the kernel's BTF (read as `probes::kernel` reads it): Python 3.10
//! and before name a thread state's thread by `pthread_self()`, which is
//! the fs base on x86_64.

use std::sync::OnceLock;

use crate::probes::kernel::{kernel_btf, offset_of};

/// `offsetof(struct task_struct, thread.fsbase)` on the running kernel.
pub fn task_fsbase_offset() -> Option<u32> {
    static OFFSET: OnceLock<Option<u32>> = OnceLock::new();
    *OFFSET.get_or_init(|| {
        let btf = kernel_btf()?;
        let thread = offset_of(&btf, "task_struct", "thread")?;
        let fsbase = offset_of(&btf, "thread_struct", "fsbase")?;
        Some(thread + fsbase)
    })
}

#[cfg(test)]
mod tests {
    /// The running kernel's BTF has the member (x86_64, Linux 6.x).
    #[test]
    fn finds_fsbase_in_task_struct() {
        let off = super::task_fsbase_offset().expect("kernel BTF with task_struct.thread.fsbase");
        assert!(off > 1000 && off.is_multiple_of(8), "{off}");
    }
}
