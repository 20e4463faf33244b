//! Sinks: where profiles go once they are made. The session hands every
//! snapshot and the final profile to each [`Sink`]; a renderer turns the
//! profile into bytes and [`write_file`], the one place mtrace writes an
//! output file, puts them on disk ([`files`]); the report's text goes to
//! standard output ([`stdout`]).
//!
//! A live view or a push target is one more [`Sink`], not more code in the
//! session's loop.

pub mod files;
pub mod stdout;

use std::path::PathBuf;

use anyhow::Result;

use crate::{
    error::{UserError, EXIT_USAGE},
    profile::{file as profile_file, groups, snapshot, Profile},
    render::{self, flamegraph::Kind, ReportOptions, StackWeight},
    say,
};

use files::{check_output_path, io_error, output_identity, write_file, write_flamegraph};
use stdout::StdoutText;

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
/// end, how many were not written is an error with exit code
/// [`EXIT_IO`](crate::error::EXIT_IO).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_follow_the_pattern() {
        let s = Snapshots::new(PathBuf::from("/tmp"), 42);
        assert_eq!(s.path(7), PathBuf::from("/tmp/mtrace-42-0007.json"));
    }
}
