//! `mtrace diff`'s arguments.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::StackFiles;

pub(super) const DIFF_EXAMPLES: &str = "\
Examples:
  mtrace diff base.json new.json
  mtrace diff base.json new.json --fail-if 'calls>+5%' --fail-if 'bytes>+1MiB'
  mtrace diff base.json new.json --per-stack --fail-if 'calls>+10%'
  mtrace diff base.json new.json --flamegraph diff.svg

Exit status: 0 no regression, 1 a --fail-if condition holds, 2 unreadable input.";

/// `mtrace diff --format`'s help: the JSON's schema version is the one
/// [`crate::render::diff_report::json`] writes.
fn diff_format_help() -> String {
    format!(
        "The report's form: text; json (every change and every condition's result, schema \
         tracer/schema/diff.schema.json, version {}); markdown (for a pull request comment or \
         $GITHUB_STEP_SUMMARY); junit (JUnit XML, a test case per --fail-if, or per --fail-if \
         and test or group). Printed, or written to -o",
        crate::render::diff_report::DIFF_SCHEMA_VERSION
    )
}

#[derive(Args, Debug)]
pub struct DiffArgs {
    #[arg(value_name = "BASE.json")]
    pub base: PathBuf,

    #[arg(value_name = "NEW.json")]
    pub new: PathBuf,

    /// Exit 1 when this holds, e.g. 'calls>+5%' or 'bytes>+1MiB' (on the
    /// totals, or on every stack with --per-stack). May be repeated.
    #[arg(long = "fail-if", value_name = "COND")]
    pub fail_if: Vec<String>,

    /// Apply --fail-if to every stack instead of the totals.
    #[arg(long)]
    pub per_stack: bool,

    /// Apply --fail-if to every test (a Rust test binary's, pytest's,
    /// GoogleTest's, found among the frames) instead of the totals.
    #[arg(long)]
    pub per_test: bool,

    /// Apply --fail-if to every group (of --group, or else the groups the
    /// profiles were saved with) instead of the totals.
    #[arg(long)]
    pub per_group: bool,

    /// A group, as for a trace: NAME=PATTERN (a glob on frames'
    /// functions) or NAME=thread:PATTERN. May be repeated.
    #[arg(long = "group", value_name = "NAME=PATTERN", value_parser = crate::profile::groups::Rule::parse)]
    pub groups: Vec<crate::profile::groups::Rule>,

    /// With --per-stack (--per-test, --per-group): a stack (test, group)
    /// whose calls moved by at most N (and its bytes by at most N calls of
    /// twice its average size) is noise, never a regression. 0 gates every
    /// change.
    #[arg(long, value_name = "CALLS", default_value_t = crate::diff::gate::DEFAULT_NOISE_FLOOR)]
    pub noise_floor: u64,

    /// Show at most N changed stacks (0: all).
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub top: usize,

    // Its help names the diff schema version the writer writes.
    #[arg(long, value_enum, value_name = "FORMAT", default_value = "text", help = diff_format_help())]
    pub format: DiffFormat,

    /// Write the --format report to FILE; the text report is still printed.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<PathBuf>,

    #[command(flatten)]
    pub stacks: StackFiles,
}

/// `mtrace diff --format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DiffFormat {
    Text,
    Json,
    Markdown,
    Junit,
}
