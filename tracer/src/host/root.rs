//! A tree scope's root process: its execs after the command's own are
//! said, as the per-process engine says them (the program the trace is
//! of is the one the root runs last).

/// The root's pid and the names the command's own exec goes by.
pub(super) struct RootExecs {
    pid: u32,
    /// The command as resolved and as its file's canonical path, until
    /// the root's first exec (the command's own) is seen.
    launch: Option<[String; 2]>,
}

impl RootExecs {
    pub(super) fn new(pid: u32, resolved: String, canonical: String) -> Self {
        RootExecs {
            pid,
            launch: Some([resolved, canonical]),
        }
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
        Some(format!(
            "pid {tgid} exec'd {}: its allocator files probed file-wide",
            crate::render::text::printable(path)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_commands_own_exec_is_not_said_and_the_next_ones_are() {
        let mut r = RootExecs::new(7, "/bin/env".into(), "/usr/bin/env".into());
        assert_eq!(r.said(8, "/x"), None);
        assert_eq!(r.said(7, "/usr/bin/env"), None);
        assert_eq!(
            r.said(7, "/bin/env").as_deref(),
            Some("pid 7 exec'd /bin/env: its allocator files probed file-wide")
        );
        let mut lost = RootExecs::new(7, "/bin/env".into(), "/usr/bin/env".into());
        assert!(lost.said(7, "/opt/fixture").is_some());
    }
}
