//! A tree scope's root process: its execs after the command's own are
//! said, as the per-process engine says them, and the program it runs
//! last is the trace's (the profile's `meta.executable`).

/// The root's pid and the names the command's own exec goes by.
pub(super) struct RootExecs {
    pid: u32,
    /// The command as resolved and as its file's canonical path, until
    /// the root's first exec (the command's own) is seen.
    launch: Option<[String; 2]>,
    /// The root's program: the command's, then each it exec'd.
    program: String,
}

impl RootExecs {
    pub(super) fn new(pid: u32, resolved: String, canonical: String) -> Self {
        RootExecs {
            pid,
            program: canonical.clone(),
            launch: Some([resolved, canonical]),
        }
    }

    /// The program the root runs (or ran last).
    pub(super) fn program(&self) -> &str {
        &self.program
    }

    /// The line to say for process `tgid`'s exec of `path`: one when it
    /// is the root and this is not the command's own exec.
    pub(super) fn said(&mut self, tgid: u32, path: &str) -> Option<String> {
        if tgid != self.pid {
            return None;
        }
        // (A first exec of another name: the command's own was not told,
        // its record lost; this one is the next.)
        if self
            .launch
            .take()
            .is_some_and(|names| names.iter().any(|n| n == path))
        {
            return None;
        }
        // Its file as the kernel has it, while the process runs it.
        self.program = match crate::tracee::executable(tgid) {
            exe if exe.is_empty() => path.to_string(),
            exe => exe,
        };
        Some(format!(
            "pid {tgid} exec'd {}: its allocator files probed file-wide",
            crate::render::text::printable(path)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid no process has (`/proc/PID/exe` is not there).
    const NO_SUCH_PID: u32 = 4_000_000_000;

    #[test]
    fn the_commands_own_exec_is_not_said_and_the_next_ones_are() {
        let mut r = RootExecs::new(NO_SUCH_PID, "/bin/env".into(), "/usr/bin/env".into());
        assert_eq!(r.said(NO_SUCH_PID - 1, "/x"), None);
        assert_eq!(r.said(NO_SUCH_PID, "/usr/bin/env"), None);
        assert_eq!(
            r.said(NO_SUCH_PID, "/bin/env").as_deref(),
            Some("pid 4000000000 exec'd /bin/env: its allocator files probed file-wide")
        );
        assert_eq!(r.program(), "/bin/env");
        let mut lost = RootExecs::new(NO_SUCH_PID, "/bin/env".into(), "/usr/bin/env".into());
        assert_eq!(lost.program(), "/usr/bin/env");
        assert!(lost.said(NO_SUCH_PID, "/opt/fixture").is_some());
        assert_eq!(lost.program(), "/opt/fixture");
    }
}
