//! Sinks: where profiles go once they are made. The session hands every
//! snapshot and the final profile to each [`Sink`]; a renderer turns the
//! profile into bytes and [`write_file`], the one place mtrace writes an
//! output file, puts them on disk.
//!
//! A live view or a push target is one more [`Sink`], not more code in the
//! session's loop.

use std::{
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::Result;

use crate::{
    error::{UserError, EXIT_IO, EXIT_USAGE},
    profile::{file as profile_file, snapshot, Profile},
    render::{
        self,
        flamegraph::{self, Kind},
        ReportOptions, StackWeight,
    },
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

    /// [`check_output_path`] for each of them.
    pub fn check(&self) -> Result<()> {
        self.paths().try_for_each(|p| check_output_path(p))
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

/// The report: the table on stdout and every requested file.
pub struct Report(pub Outputs);

impl Sink for Report {
    fn finish(&mut self, profile: &Profile) -> Result<()> {
        let out = &self.0;
        let mut text = render::table::render(profile, &out.table);
        if out.tree {
            text.push('\n');
            text.push_str(&render::calltree::render_tree(
                profile,
                out.table.sort,
                out.table.threshold_pct,
            ));
        }
        print_stdout(&text)?;
        if let Some(path) = &out.profile {
            write_file(path, "profile", profile_file::to_json(profile).as_bytes())?;
        }
        if out.folded.is_some() || out.flamegraph.is_some() {
            let folded = render::folded::render(profile, out.weight, out.table.per_thread);
            if let Some(path) = &out.folded {
                write_file(path, "folded stacks", folded.as_bytes())?;
            }
            if let Some(path) = &out.flamegraph {
                let title = format!(
                    "mtrace: {} (pid {})",
                    profile.meta.command, profile.meta.pid
                );
                write_flamegraph(path, "flamegraph", &folded, &title, out.weight, Kind::Plain)?;
            }
        }
        if let Some(path) = &out.dot {
            let dot = render::calltree::render_dot(profile, out.weight, out.table.threshold_pct);
            write_file(path, "call graph", dot.as_bytes())?;
        }
        if let Some(path) = &out.pprof {
            write_file(path, "pprof profile", &render::pprof::render(profile)?)?;
        }
        if let Some(path) = &out.speedscope {
            write_file(
                path,
                "speedscope profile",
                render::speedscope::render(profile, out.weight)?.as_bytes(),
            )?;
        }
        if let Some(path) = &out.html {
            let page = render::html::render(profile, &out.table)?;
            write_file(path, "HTML report", page.as_bytes())?;
        }
        Ok(())
    }
}

/// Snapshots as files `mtrace-PID-NNNN.json` (NNNN counting from 0001) in
/// a directory, each with what changed since the previous one.
pub struct Snapshots {
    dir: PathBuf,
    pid: u32,
    written: u32,
    last: Option<Profile>,
}

impl Snapshots {
    pub fn new(dir: PathBuf, pid: u32) -> Self {
        Snapshots {
            dir,
            pid,
            written: 0,
            last: None,
        }
    }

    fn path(&self, index: u32) -> PathBuf {
        self.dir
            .join(format!("mtrace-{}-{index:04}.json", self.pid))
    }
}

impl Sink for Snapshots {
    fn snapshot(&mut self, profile: &Profile) -> Result<()> {
        let index = self.written + 1;
        let mut profile = profile.clone();
        profile.snapshot = Some(snapshot::delta(
            index,
            profile.meta.duration_secs,
            self.last.as_ref(),
            &profile,
        ));
        let path = self.path(index);
        write_file(
            &path,
            "snapshot",
            profile_file::to_json(&profile).as_bytes(),
        )?;
        self.written = index;
        profile.snapshot = None;
        self.last = Some(profile);
        Ok(())
    }

    fn finish(&mut self, _profile: &Profile) -> Result<()> {
        Ok(())
    }
}

/// Prints `text` on stdout and flushes it; a failed write (a full disk, a
/// closed pipe) is a one-line error with exit code [`EXIT_IO`].
pub fn print_stdout(text: &str) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|e| io_error(format!("cannot write the report to stdout: {e}")))
}

fn io_error(message: String) -> anyhow::Error {
    anyhow::Error::new(UserError::with_code(message, EXIT_IO))
}

/// Checks, before tracing starts, that `path` can be an output: its
/// directory exists, and it is not a directory itself.
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
    Ok(())
}

/// The directory an output file goes to.
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
            eprintln!("mtrace: no {what} written: {e}");
            Ok(())
        }
    }
}

/// Writes `bytes` to `path` and says so on stderr: the one place mtrace
/// writes an output file. Safe for root in a directory others can write:
/// the bytes go to a fresh temporary of an unpredictable name beside
/// `path` (created exclusively, never through a symbolic link), which is
/// renamed over `path` (a symbolic link there is replaced, not followed);
/// a reader never sees half a file. Under sudo the file belongs to the
/// user who ran sudo (`SUDO_UID`, `SUDO_GID`), readable by all (0644). A
/// device or FIFO at `path` (`/dev/stdout`, `/dev/full`) is written in
/// place. Every failure is one line with exit code [`EXIT_IO`].
pub fn write_file(path: &Path, what: &str, bytes: &[u8]) -> Result<()> {
    let fail = |e: std::io::Error| io_error(format!("cannot write {}: {e}", path.display()));
    let special = std::fs::symlink_metadata(path)
        .is_ok_and(|m| !m.file_type().is_file() && !m.file_type().is_symlink() && !m.is_dir());
    if special {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(fail)?;
        f.write_all(bytes).and_then(|()| f.flush()).map_err(fail)?;
    } else {
        let mut tmp = tempfile::Builder::new()
            .prefix(".mtrace-")
            .suffix(".tmp")
            .tempfile_in(output_dir(path))
            .map_err(fail)?;
        tmp.write_all(bytes)
            .and_then(|()| tmp.as_file().sync_all())
            .map_err(fail)?;
        give_to_invoking_user(tmp.as_file()).map_err(fail)?;
        tmp.persist(path).map_err(|e| fail(e.error))?;
    }
    eprintln!("mtrace: wrote {what} to {}", path.display());
    Ok(())
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
