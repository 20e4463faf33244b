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
    profile::{file as profile_file, snapshot, Profile, Weight},
    render::{
        self,
        flamegraph::{self, Kind},
        ReportOptions,
    },
    user_error,
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
    pub weight: Weight,
    pub pprof: Option<PathBuf>,
    pub speedscope: Option<PathBuf>,
}

/// The report: the table on stdout and every requested file.
pub struct Report(pub Outputs);

impl Sink for Report {
    fn finish(&mut self, profile: &Profile) -> Result<()> {
        let out = &self.0;
        print_stdout(&render::table::render(profile, &out.table))?;
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
        if let Some(path) = &out.pprof {
            write_file(path, "pprof profile", &render::pprof::render(profile)?)?;
        }
        if let Some(path) = &out.speedscope {
            write_file(
                path,
                "speedscope profile",
                render::speedscope::render(profile)?.as_bytes(),
            )?;
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

/// Prints `text` on stdout and flushes it.
pub fn print_stdout(text: &str) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

/// Draws a flame graph into `path`; nothing to draw is a note, not an
/// error (the table says why).
pub fn write_flamegraph(
    path: &Path,
    what: &str,
    folded: &str,
    title: &str,
    weight: Weight,
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

/// Writes `bytes` to `path` atomically (a reader never sees half a file:
/// a temporary beside it, then a rename) and says so on stderr. Every
/// output file mtrace writes goes through here.
pub fn write_file(path: &Path, what: &str, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| user_error!("cannot write {}: {e}", path.display()))?;
    eprintln!("mtrace: wrote {what} to {}", path.display());
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
