//! By pid: hold the target at its exit long enough to read its mappings
//! once more, as launch mode does. Without it, a library the target loads
//! and uses just before exiting is gone before the tracer has seen it
//! mapped, and its frames can be neither unwound nor named. And hold it at
//! an `exec`, until the new program's allocator is probed (as launch mode
//! does, [`super::launch::follow_exec`]).
//!
//! The target is seized (`PTRACE_SEIZE`, which does not stop it) with
//! `PTRACE_O_TRACEEXIT` and `PTRACE_O_TRACEEXEC` only; its signals are
//! passed on, a group stop is kept (`PTRACE_LISTEN`). When the trace ends first, it is detached. A
//! target that another tracer (a debugger) holds is traced without the
//! hold. If mtrace dies, the kernel detaches it.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::Duration,
};

use super::{launch::follow_exec, AddressSpace, Mapping};

/// How often the holding thread looks for a stop of the target.
const POLL: Duration = Duration::from_millis(2);

pub struct ExitHold {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ExitHold {
    pub fn start<E>(pid: u32, space: Arc<Mutex<AddressSpace>>, mut on_exec: E) -> ExitHold
    where
        E: FnMut(u32, &[Mapping]) -> anyhow::Result<Option<()>> + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        // ptrace requests come from the thread that seized the target.
        let thread = std::thread::Builder::new()
            .name("mtrace-exit-hold".into())
            .spawn(move || hold(pid, &space, &flag, &mut on_exec))
            .ok();
        ExitHold { stop, thread }
    }
}

impl Drop for ExitHold {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn ptrace(req: libc::c_uint, pid: u32, data: usize) -> bool {
    unsafe {
        libc::ptrace(
            req,
            pid as libc::pid_t,
            std::ptr::null_mut::<libc::c_void>(),
            data as *mut libc::c_void,
        ) == 0
    }
}

fn hold(
    pid: u32,
    space: &Mutex<AddressSpace>,
    stop: &AtomicBool,
    on_exec: &mut impl FnMut(u32, &[Mapping]) -> anyhow::Result<Option<()>>,
) {
    let options = libc::PTRACE_O_TRACEEXIT | libc::PTRACE_O_TRACEEXEC;
    if !ptrace(libc::PTRACE_SEIZE, pid, options as usize) {
        log::debug!(
            "pid {pid} not held at its exit: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    loop {
        if stop.load(Ordering::Relaxed) {
            // Stop it (PTRACE_EVENT_STOP), then let it go.
            if ptrace(libc::PTRACE_INTERRUPT, pid, 0) {
                let mut status = 0;
                unsafe { libc::waitpid(pid as i32, &mut status, libc::__WALL) };
            }
            ptrace(libc::PTRACE_DETACH, pid, 0);
            return;
        }
        let mut status = 0;
        let r = unsafe { libc::waitpid(pid as i32, &mut status, libc::__WALL | libc::WNOHANG) };
        if r < 0 {
            return;
        }
        if r == 0 {
            std::thread::sleep(POLL);
            continue;
        }
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            return;
        }
        if !libc::WIFSTOPPED(status) {
            continue;
        }
        let sig = libc::WSTOPSIG(status);
        match status >> 16 {
            libc::PTRACE_EVENT_EXIT => {
                // Its memory is still there: last look at its mappings.
                space.lock().unwrap().refresh(pid);
                ptrace(libc::PTRACE_CONT, pid, 0);
            }
            libc::PTRACE_EVENT_EXEC => {
                if follow_exec(pid, on_exec).is_some() {
                    return;
                }
                ptrace(libc::PTRACE_CONT, pid, 0);
            }
            libc::PTRACE_EVENT_STOP => {
                // A group stop (SIGSTOP and the like) stays a stop.
                if matches!(
                    sig,
                    libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
                ) {
                    ptrace(libc::PTRACE_LISTEN, pid, 0);
                } else {
                    ptrace(libc::PTRACE_CONT, pid, 0);
                }
            }
            // A signal on its way to the target: deliver it.
            _ => {
                ptrace(libc::PTRACE_CONT, pid, sig as usize);
            }
        }
    }
}
