//! Sinks: where profiles go once they are made. The session hands every
//! snapshot and the final profile to each [`Sink`]; a renderer turns the
//! profile into bytes and [`write_file`], the one place mtrace writes an
//! output file, puts them on disk.
//!
//! A live view or a push target is one more [`Sink`], not more code in the
//! session's loop.

use std::{
    fs::OpenOptions,
    io::Write,
    os::unix::fs::{FileTypeExt, OpenOptionsExt},
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
};

use anyhow::Result;

use crate::{
    error::{UserError, EXIT_IO, EXIT_USAGE},
    profile::{file as profile_file, groups, snapshot, Profile},
    render::{
        self,
        flamegraph::{self, Kind},
        ReportOptions, StackWeight,
    },
    say,
};

/// Something that takes profiles: snapshots while tracing, the final one
/// at the end.
pub trait Sink {
    /// A snapshot while tracing goes on (`--interval`, SIGUSR1).
    fn snapshot(&mut self, _profile: &Profile) -> Result<()> {
        Ok(())
    }

    /// The final profile, once tracing has ended.
    fn finish(&mut self, profile: &Profile) -> Result<()>;
}

/// What to show and which files to write: the same for a trace and for
/// `mtrace report`.
#[derive(Clone, Debug)]
pub struct Outputs {
    pub table: ReportOptions,
    /// `-o`: the JSON profile.
    pub profile: Option<PathBuf>,
    pub folded: Option<PathBuf>,
    pub flamegraph: Option<PathBuf>,
    /// What folded stacks and the flame graph count.
    pub weight: StackWeight,
    pub pprof: Option<PathBuf>,
    pub speedscope: Option<PathBuf>,
    /// The HTML report.
    pub html: Option<PathBuf>,
    /// `--tree`: the call tree after the table.
    pub tree: bool,
    /// `--dot`: the call graph.
    pub dot: Option<PathBuf>,
    /// `--per-test`: sum the allocations of each test.
    pub per_test: bool,
    /// `--group`: the user's groups.
    pub rules: Vec<groups::Rule>,
}

impl Outputs {
    /// Every file path asked for.
    pub fn paths(&self) -> impl Iterator<Item = &PathBuf> {
        [
            &self.profile,
            &self.folded,
            &self.flamegraph,
            &self.pprof,
            &self.speedscope,
            &self.html,
            &self.dot,
        ]
        .into_iter()
        .flatten()
    }

    /// [`check_output_path`] for each of them, and no file asked for
    /// twice, however spelled (the second file would replace the first).
    pub fn check(&self) -> Result<()> {
        check_outputs(self.paths())
    }

    /// A usage error when the weight needs a live profile and `live` (the
    /// trace, or the profile read) is not one.
    pub fn check_weight(&self, live: bool) -> Result<()> {
        if self.weight.needs_live() && !live {
            return Err(anyhow::Error::new(UserError::with_code(
                format!(
                    "--weight {} needs a live profile (trace with --live)",
                    self.weight.name()
                ),
                EXIT_USAGE,
            )));
        }
        Ok(())
    }
}

/// [`check_output_path`] for each of `paths`, and no file asked for twice,
/// however spelled (the second file would replace the first).
pub fn check_outputs<'a>(paths: impl IntoIterator<Item = &'a PathBuf>) -> Result<()> {
    let mut seen = std::collections::HashMap::new();
    for path in paths {
        check_output_path(path)?;
        if let Some(first) = seen.insert(output_identity(path), path) {
            let also = if first == path {
                String::new()
            } else {
                format!(" (as {})", first.display())
            };
            return Err(anyhow::Error::new(UserError::with_code(
                format!("{} is given for two outputs{also}", path.display()),
                EXIT_USAGE,
            )));
        }
    }
    Ok(())
}

/// The report: the table on stdout and every requested file.
pub struct Report(pub Outputs);

impl Sink for Report {
    /// Every output is attempted: one that fails is said on stderr, the
    /// others are still written, and the last failure is the result.
    fn finish(&mut self, profile: &Profile) -> Result<()> {
        let mut outcome = Outcome::default();
        let out = &self.0;
        let profile = &*groups::apply(profile, out.per_test, &out.rules);
        let mut stdout = StdoutText::new();
        let mut text = || -> std::fmt::Result {
            render::table::render_to(&mut stdout, profile, &out.table)?;
            if out.tree {
                std::fmt::Write::write_char(&mut stdout, '\n')?;
                let tree = if out.table.per_thread {
                    render::calltree::render_tree_per_thread_to
                } else {
                    render::calltree::render_tree_to
                };
                tree(
                    &mut stdout,
                    profile,
                    out.table.sort,
                    out.table.threshold_pct,
                )?;
            }
            Ok(())
        };
        // A failed write is kept, and said by `finish`.
        let _ = text();
        outcome.add(stdout.finish());
        if let Some(path) = &out.profile {
            outcome.add(write_file(
                path,
                "profile",
                profile_file::to_json(profile).as_bytes(),
            ));
        }
        if out.folded.is_some() || out.flamegraph.is_some() {
            let folded = render::folded::render(profile, out.weight, out.table.per_thread);
            if let Some(path) = &out.folded {
                outcome.add(write_file(path, "folded stacks", folded.as_bytes()));
            }
            if let Some(path) = &out.flamegraph {
                let title = format!(
                    "mtrace: {} (pid {})",
                    profile.meta.command, profile.meta.pid
                );
                outcome.add(write_flamegraph(
                    path,
                    "flamegraph",
                    &folded,
                    &title,
                    out.weight,
                    Kind::Plain,
                ));
            }
        }
        if let Some(path) = &out.dot {
            let dot = render::calltree::render_dot(profile, out.weight, out.table.threshold_pct);
            outcome.add(write_file(path, "call graph", dot.as_bytes()));
        }
        if let Some(path) = &out.pprof {
            outcome.add(
                render::pprof::render(profile)
                    .and_then(|bytes| write_file(path, "pprof profile", &bytes)),
            );
        }
        if let Some(path) = &out.speedscope {
            outcome.add(
                render::speedscope::render(profile, out.weight)
                    .and_then(|page| write_file(path, "speedscope profile", page.as_bytes())),
            );
        }
        if let Some(path) = &out.html {
            outcome.add(
                render::html::render(profile, &out.table)
                    .and_then(|page| write_file(path, "HTML report", page.as_bytes())),
            );
        }
        outcome.result()
    }
}

/// Outputs attempted one after another: every failure but the last is
/// said at once, the last is the result (said by `main`, with its code).
#[derive(Default)]
pub struct Outcome {
    failed: Option<anyhow::Error>,
}

impl Outcome {
    pub fn add(&mut self, result: Result<()>) {
        if let Err(e) = result {
            if let Some(earlier) = self.failed.replace(e) {
                say!("mtrace: {}", one_line(&earlier));
            }
        }
    }

    pub fn result(self) -> Result<()> {
        self.failed.map_or(Ok(()), Err)
    }
}

/// An error as `main` says it: the user's message, or the chain of
/// causes, on one line.
pub fn one_line(e: &anyhow::Error) -> String {
    let msg = match e.downcast_ref::<UserError>() {
        Some(u) => u.message.clone(),
        None => e
            .chain()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(": "),
    };
    msg.replace('\n', " ")
}

/// Snapshots as files `mtrace-PID-NNNN.json` (`mtrace-all-NNNN.json` for
/// the host scope; NNNN counting from 0001) in
/// a directory, each with what changed since the previous one, and with
/// the tests (`--per-test`) and groups (`--group`) the final profile
/// carries, summed over the snapshot's stacks. A snapshot
/// that cannot be written is said at once and the trace goes on; at the
/// end, how many were not written is an error with exit code [`EXIT_IO`].
pub struct Snapshots {
    dir: PathBuf,
    /// What the files are named after: the target's pid, or `all`.
    target: String,
    /// `--per-test`.
    per_test: bool,
    /// `--group`.
    rules: Vec<groups::Rule>,
    written: u32,
    last: Option<Profile>,
    failed: u32,
}

impl Snapshots {
    pub fn new(dir: PathBuf, pid: u32) -> Self {
        Self::named(dir, pid.to_string())
    }

    /// Snapshots as files `mtrace-TARGET-NNNN.json`.
    pub fn named(dir: PathBuf, target: String) -> Self {
        Snapshots {
            dir,
            target,
            per_test: false,
            rules: Vec::new(),
            written: 0,
            last: None,
            failed: 0,
        }
    }

    /// With the tests and groups `out` (the final report) asks for.
    pub fn grouped_as(mut self, out: &Outputs) -> Self {
        self.per_test = out.per_test;
        self.rules = out.rules.clone();
        self
    }

    fn path(&self, index: u32) -> PathBuf {
        self.dir
            .join(format!("mtrace-{}-{index:04}.json", self.target))
    }
}

impl Sink for Snapshots {
    fn snapshot(&mut self, profile: &Profile) -> Result<()> {
        let index = self.written + 1;
        let mut profile = groups::apply(profile, self.per_test, &self.rules).into_owned();
        profile.snapshot = Some(snapshot::delta(
            index,
            profile.meta.duration_secs,
            self.last.as_ref(),
            &profile,
        ));
        let path = self.path(index);
        let written = write_file(
            &path,
            "snapshot",
            profile_file::to_json(&profile).as_bytes(),
        );
        if let Err(e) = written {
            say!("mtrace: {}", one_line(&e));
            self.failed += 1;
            return Ok(());
        }
        self.written = index;
        profile.snapshot = None;
        self.last = Some(profile);
        Ok(())
    }

    fn finish(&mut self, _profile: &Profile) -> Result<()> {
        match self.failed {
            0 => Ok(()),
            1 => Err(io_error("a snapshot was not written".into())),
            n => Err(io_error(format!("{n} snapshots were not written"))),
        }
    }
}

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

fn io_error(message: String) -> anyhow::Error {
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
fn output_identity(path: &Path) -> (Option<(u64, u64)>, PathBuf) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_follow_the_pattern() {
        let s = Snapshots::new(PathBuf::from("/tmp"), 42);
        assert_eq!(s.path(7), PathBuf::from("/tmp/mtrace-42-0007.json"));
    }
}
