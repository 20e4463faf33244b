//! Errors the user sees: one line, a fixed exit code.

use std::fmt;

/// An error meant for the user: printed as one line `mtrace: MESSAGE`,
/// then mtrace exits with `code`.
#[derive(Debug)]
pub struct UserError {
    pub message: String,
    pub code: i32,
}

/// Exit code of runtime errors (bad pid, no privilege, no allocator, ...).
pub const EXIT_FAILURE: i32 = 1;
/// Exit code when an output cannot be written (a full disk, `/dev/full`,
/// a closed stdout): sysexits' EX_IOERR.
pub const EXIT_IO: i32 = 74;
/// Exit code of usage errors (bad or missing arguments), as clap's.
pub const EXIT_USAGE: i32 = 2;
/// Exit code when the command of launch mode cannot be found or run, as a
/// shell does.
pub const EXIT_CMD_NOT_FOUND: i32 = 127;
pub const EXIT_CMD_NOT_EXECUTABLE: i32 = 126;

impl UserError {
    pub fn new(message: impl Into<String>) -> Self {
        UserError {
            message: message.into(),
            code: EXIT_FAILURE,
        }
    }

    pub fn with_code(message: impl Into<String>, code: i32) -> Self {
        UserError {
            message: message.into(),
            code,
        }
    }
}

impl fmt::Display for UserError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for UserError {}

/// Shorthand: `Err(user_error!("no process with pid {pid}"))`.
#[macro_export]
macro_rules! user_error {
    ($($arg:tt)*) => {
        anyhow::Error::new($crate::error::UserError::new(format!($($arg)*)))
    };
}

/// `eprintln!` that cannot panic: a line for the user on stderr. A failed
/// write (`2>/dev/full`, a closed stderr) is dropped: there is nowhere
/// left to say it, and the exit code still tells.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
