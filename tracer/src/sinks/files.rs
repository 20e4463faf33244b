//! Output files: the checks before tracing that a path can be written,
//! and [`write_file`], the one place mtrace writes an output file (whole
//! or not at all, never through a symbolic link, the invoking user's
//! under sudo).

use std::{
    fs::OpenOptions,
    io::Write,
    os::unix::fs::{FileTypeExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

use anyhow::Result;

use crate::{
    error::{UserError, EXIT_IO, EXIT_USAGE},
    render::{
        flamegraph::{self, Kind},
        StackWeight,
    },
    say,
};

pub(super) fn io_error(message: String) -> anyhow::Error {
    anyhow::Error::new(UserError::with_code(message, EXIT_IO))
}

/// Checks, before tracing starts, that `path` can be an output: its
/// directory exists and a file can be made in it (not a read-only
/// directory or file system), and it is not a directory itself.
pub fn check_output_path(path: &Path) -> Result<()> {
    let bad = |why: &str| {
        anyhow::Error::new(UserError::with_code(
            format!("cannot write {}: {why}", path.display()),
            EXIT_USAGE,
        ))
    };
    if path.is_dir() {
        return Err(bad("it is a directory"));
    }
    let dir = output_dir(path);
    if !dir.is_dir() {
        return Err(bad("no such directory"));
    }
    if device_at(path) {
        return Ok(());
    }
    check_writable_dir(dir).map_err(|e| bad(&format!("{}: {e}", dir.display())))
}

/// Checks that files can be made in `dir`, as [`write_file`] makes them
/// (an unnamed file, or where the file system has none a named temporary
/// removed at once); not a directory is an error too. mtrace killed during
/// the check leaves a name behind only on a file system without unnamed
/// files.
pub fn check_writable_dir(dir: &Path) -> std::io::Result<()> {
    match unnamed_in(dir)? {
        Some(file) => drop(file),
        None => drop(temporary_in(dir)?),
    }
    Ok(())
}

/// A file without a name in `dir` (`O_TMPFILE`), gone with its last
/// descriptor whatever happens to mtrace; `None` when the file system
/// has no unnamed files.
fn unnamed_in(dir: &Path) -> std::io::Result<Option<std::fs::File>> {
    let opened = OpenOptions::new()
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_TMPFILE)
        .open(dir);
    match opened {
        Ok(f) => Ok(Some(f)),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL)
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// A fresh temporary of an unpredictable name in `dir`, created
/// exclusively, never through a symbolic link; removed when dropped.
fn temporary_in(dir: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    tempfile::Builder::new()
        .prefix(".mtrace-")
        .suffix(".tmp")
        .tempfile_in(dir)
}

/// Whether a character or block device is at `path` itself (not through
/// a symbolic link): only root makes those, and they are written in place.
fn device_at(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| {
        let t = m.file_type();
        t.is_char_device() || t.is_block_device()
    })
}

/// Writes `bytes` into the device at `path`, in place. The open never
/// blocks and never follows a symbolic link, and what it opened must be a
/// device: a FIFO put there meanwhile is refused, not waited on.
fn write_device(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)?;
    let t = f.metadata()?.file_type();
    if !(t.is_char_device() || t.is_block_device()) {
        return Err(std::io::Error::other("not a regular file or a device"));
    }
    // Blocking again: a terminal or a slow device is waited for.
    use std::os::fd::AsRawFd;
    // SAFETY: plain fcntl on a descriptor this function owns.
    unsafe {
        let fd = f.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags == -1 || libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == -1 {
            return Err(std::io::Error::last_os_error());
        }
    }
    f.write_all(bytes)?;
    f.flush()
}

/// The directory an output file goes to.
/// What names the file an output path writes: its directory's identity
/// (device and inode: the same directory however the path reaches it,
/// through `..`, `.` or a symbolic link) and its own name. A file is
/// written by linking a new one at that name, so two paths write the same
/// file exactly when these agree (a hard link or a symbolic link at the
/// name is replaced, not written through).
pub(super) fn output_identity(path: &Path) -> (Option<(u64, u64)>, PathBuf) {
    use std::os::unix::fs::MetadataExt;
    let dir = std::fs::metadata(output_dir(path))
        .ok()
        .map(|m| (m.dev(), m.ino()));
    match (dir, path.file_name()) {
        (Some(dir), Some(name)) => (Some(dir), PathBuf::from(name)),
        _ => (None, path.to_path_buf()),
    }
}

fn output_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Draws a flame graph into `path`; nothing to draw is a note, not an
/// error (the table says why).
pub fn write_flamegraph(
    path: &Path,
    what: &str,
    folded: &str,
    title: &str,
    weight: impl Into<StackWeight>,
    kind: Kind,
) -> Result<()> {
    match flamegraph::render(folded, title, weight, kind) {
        Ok(svg) => write_file(path, what, &svg),
        Err(e) => {
            say!("mtrace: no {what} written: {e}");
            Ok(())
        }
    }
}

/// Writes `bytes` to `path` and says so on stderr: the one place mtrace
/// writes an output file. Safe for root in a directory others can write:
/// the bytes go to a fresh temporary of an unpredictable name beside
/// `path` (created exclusively, never through a symbolic link), which is
/// renamed over `path` (a symbolic link, a FIFO or a socket there is
/// replaced, never opened); a reader never sees half a file. Under sudo
/// the file belongs to the user who ran sudo (`SUDO_UID`, `SUDO_GID`),
/// readable by all (0644). A device at `path` (`/dev/null`, `/dev/full`)
/// is written in place. Every failure is one line with exit code
/// [`EXIT_IO`].
pub fn write_file(path: &Path, what: &str, bytes: &[u8]) -> Result<()> {
    let fail = |e: std::io::Error| io_error(format!("cannot write {}: {e}", path.display()));
    if device_at(path) {
        write_device(path, bytes).map_err(fail)?;
    } else if !write_unnamed(output_dir(path), path, bytes).map_err(fail)? {
        let mut tmp = temporary_in(output_dir(path)).map_err(fail)?;
        tmp.write_all(bytes)
            .and_then(|()| tmp.as_file().sync_all())
            .map_err(fail)?;
        give_to_invoking_user(tmp.as_file()).map_err(fail)?;
        tmp.persist(path).map_err(|e| fail(e.error))?;
    }
    say!("mtrace: wrote {what} to {}", path.display());
    Ok(())
}

/// Writes `bytes` to `path` through a file that has no name until it is
/// whole (`O_TMPFILE` in `dir`): mtrace killed while writing leaves
/// nothing behind. Then it is linked at `path` when nothing is there, or
/// else under a hidden name renamed over `path` (replacing whatever is
/// there, a symbolic link or a FIFO included, never following it). False when the file system has no
/// unnamed files (the caller writes a named temporary file instead).
fn write_unnamed(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<bool> {
    use std::os::{fd::AsRawFd, unix::ffi::OsStrExt};
    let Some(mut file) = unnamed_in(dir)? else {
        return Ok(false);
    };
    file.write_all(bytes)?;
    file.sync_all()?;
    give_to_invoking_user(&file)?;
    let c =
        |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let from = c(Path::new(&format!("/proc/self/fd/{}", file.as_raw_fd())))?;
    let link = |to: &std::ffi::CStr| {
        // SAFETY: two NUL-terminated paths that live across the call.
        unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        }
    };
    // Nothing at `path`: the whole file gets its name in one step (a link
    // never follows or replaces what is at its destination).
    if link(&c(path)?) == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EEXIST) {
        return Err(e);
    }
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    for attempt in 0..16 {
        let name = dir.join(format!(
            ".mtrace-{}-{stamp:x}-{attempt}.tmp",
            std::process::id()
        ));
        if link(&c(&name)?) == 0 {
            return std::fs::rename(&name, path)
                .map(|()| true)
                .inspect_err(|_| {
                    let _ = std::fs::remove_file(&name);
                });
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(e);
        }
    }
    Err(std::io::Error::from_raw_os_error(libc::EEXIST))
}

/// Mode 0644, and under sudo (`SUDO_UID`/`SUDO_GID` set, running as root)
/// the invoking user's: the output of `sudo mtrace` is the user's file.
fn give_to_invoking_user(file: &std::fs::File) -> std::io::Result<()> {
    use std::os::unix::fs::{fchown, PermissionsExt};
    file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    let id = |name: &str| std::env::var(name).ok()?.parse::<u32>().ok();
    if unsafe { libc::geteuid() } == 0 {
        if let (Some(uid), Some(gid)) = (id("SUDO_UID"), id("SUDO_GID")) {
            fchown(file, Some(uid), Some(gid))?;
        }
    }
    Ok(())
}
