//! Standard output: whether it was closed when mtrace started, and the
//! report's text written to it as the renderers make it.

use std::{
    io::Write,
    sync::atomic::{AtomicBool, Ordering},
};

use anyhow::Result;

use super::files::io_error;

/// Whether fd 1 was closed when mtrace started (`>&-`). Rust's runtime
/// opens /dev/null on a closed standard descriptor before `main`, where
/// the report would vanish unsaid; so fd 1 is looked at earlier, by a
/// constructor the loader runs before the runtime starts.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

#[used]
#[link_section = ".init_array"]
static SEE_STDOUT: extern "C" fn() = {
    extern "C" fn see_stdout() {
        // SAFETY: F_GETFD only reads the descriptor's flags.
        if unsafe { libc::fcntl(1, libc::F_GETFD) } == -1 {
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
        }
    }
    see_stdout
};

/// Whether fd 1 was closed when mtrace started: what is printed there
/// would vanish.
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

/// The report's text on its way to stdout, written as the renderers make
/// it (`render_to`): a report is never held whole in memory, however many
/// lines it has. The first failed write is kept, and nothing more is
/// written after it.
pub struct StdoutText {
    out: std::io::BufWriter<std::io::StdoutLock<'static>>,
    failed: Option<std::io::Error>,
}

impl StdoutText {
    #[allow(clippy::new_without_default)]
    pub fn new() -> StdoutText {
        let failed = stdout_closed().then(|| std::io::Error::other("it is closed"));
        StdoutText {
            out: std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock()),
            failed,
        }
    }

    /// Flushes what is left; a failed write (a full disk, a closed pipe,
    /// stdout closed from the start) is a one-line error with exit code
    /// [`EXIT_IO`].
    pub fn finish(mut self) -> Result<()> {
        let failed = match self.failed.take() {
            Some(e) => Some(e),
            None => self.out.flush().err(),
        };
        // What could not be written is dropped, not written again.
        let _ = self.out.into_parts();
        match failed {
            Some(e) => Err(io_error(format!("cannot write the report to stdout: {e}"))),
            None => Ok(()),
        }
    }
}

impl std::fmt::Write for StdoutText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        if self.failed.is_some() {
            return Err(std::fmt::Error);
        }
        self.out.write_all(s.as_bytes()).map_err(|e| {
            self.failed = Some(e);
            std::fmt::Error
        })
    }
}
