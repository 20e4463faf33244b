//! `mtrace generate man DIR` and `mtrace generate completions SHELL DIR`:
//! the man pages (clap_mangen) and shell completions (clap_complete) made
//! from the clap definition of this very binary, so that what
//! `cargo xtask install` installs beside it cannot describe another
//! version. Hidden from `--help`: a packager's tool, not a user's.
//!
//! A page is clap_mangen's sections (NAME, SYNOPSIS, DESCRIPTION, OPTIONS,
//! SUBCOMMANDS), then EXAMPLES (the `Examples:` block of the command's
//! `--help`), EXIT STATUS and SEE ALSO, which `--help` has no place for.

use std::path::Path;

use anyhow::Result;
use clap::CommandFactory;
use clap_mangen::{
    roff::{bold, roman, Roff},
    Man,
};

use crate::{
    cli::{Cli, Generate, GenerateArgs},
    sinks::files::{check_output_path, write_file},
};

pub fn run(args: GenerateArgs) -> Result<i32> {
    match args.what {
        Generate::Man { dir } => {
            for (name, page) in man_pages() {
                write(&dir, &name, "a man page", &page)?;
            }
        }
        Generate::Completions { shell, dir } => {
            let (name, script) = completions(shell);
            write(&dir, &name, &format!("{shell} completions"), &script)?;
        }
    }
    Ok(0)
}

fn write(dir: &Path, name: &str, what: &str, bytes: &[u8]) -> Result<()> {
    let path = dir.join(name);
    check_output_path(&path)?;
    write_file(&path, what, bytes)
}

/// SHELL's completion script and the file name its shell looks for.
pub fn completions(shell: clap_complete::Shell) -> (String, Vec<u8>) {
    use clap_complete::Generator;
    let mut cmd = Cli::command();
    cmd.build();
    let mut cmd = visible(&cmd);
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "mtrace", &mut script);
    (shell.file_name("mtrace"), script)
}

/// A built `cmd` less what `--help` does not show (clap_complete would
/// offer hidden options and subcommands, `--bench-floor` and `generate`
/// among them) and less the `help` subcommand (`--help` does its work).
/// Only what completion reads is kept: names, descriptions, arguments.
fn visible(cmd: &clap::Command) -> clap::Command {
    let mut out = clap::Command::new(cmd.get_name().to_string())
        // The built command's own help and version flags are among its
        // arguments already.
        .disable_help_flag(true)
        .disable_version_flag(true)
        .disable_help_subcommand(true)
        .args(cmd.get_arguments().filter(|a| !a.is_hide_set()).cloned())
        .subcommands(
            cmd.get_subcommands()
                .filter(|s| !s.is_hide_set() && s.get_name() != "help")
                .map(visible),
        );
    if let Some(about) = cmd.get_about() {
        out = out.about(about.clone());
    }
    // Its `--version` (kept among the arguments) needs the version.
    if let Some(version) = cmd.get_version() {
        out = out.version(version.to_string());
    }
    out
}

/// Each page's file name (`mtrace.1`, `mtrace-report.1`, ...) and roff
/// source: the command's, then one per visible subcommand.
pub fn man_pages() -> Vec<(String, Vec<u8>)> {
    let mut top = Cli::command().disable_help_subcommand(true);
    // Names the subcommands `mtrace-report` and their usage `mtrace report`.
    top.build();
    let subs: Vec<clap::Command> = top
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    let names: Vec<String> = subs
        .iter()
        .map(|s| format!("mtrace-{}", s.get_name()))
        .collect();
    // NAME reads `mtrace - an out-of-process ...`, not `mtrace - mtrace: ...`.
    let about = top.get_about().map(|a| a.to_string()).unwrap_or_default();
    let about = about.trim_start_matches("mtrace: ").to_string();
    let top = top.about(about).long_about(DESCRIPTION);
    let mut pages = vec![page(top, exit_status_trace(), &names)];
    for sub in subs {
        // A subcommand that reads profiles, or one that traces (as the
        // command itself does).
        let status = match sub.get_name() {
            "diff" => exit_status_diff(),
            "report" => exit_status_offline(),
            _ => exit_status_trace(),
        };
        let others: Vec<String> = std::iter::once("mtrace".to_string())
            .chain(
                names
                    .iter()
                    .filter(|n| **n != format!("mtrace-{}", sub.get_name()))
                    .cloned(),
            )
            .collect();
        pages.push(page(sub, status, &others));
    }
    pages
}

/// The main page's DESCRIPTION, before the notes of `--help`.
const DESCRIPTION: &str = "\
mtrace counts every call to malloc, calloc, realloc and the other allocating \
functions of a process, per call stack, from outside the process: uprobes on \
the allocator, counts aggregated in the kernel (eBPF), stacks symbolized in \
the tracer. Nothing is injected into the target.

It attaches to a running process (--pid), or starts a command with the \
probes in before its first instruction (launch mode, the command after --), \
and by default traces the processes that command starts as well. Tracing \
ends at Ctrl-C, SIGTERM, --duration or the target's exit; then the top \
stacks are printed, and the files asked for written (-o, --folded, \
--flamegraph, --pprof, --speedscope). With --live, every block is followed \
until it is freed: leaks, sizes, lifetimes, the peak of live bytes.

Tracing needs root, or CAP_BPF and CAP_PERFMON. In launch mode the command \
runs as whoever runs mtrace (root under sudo), as with perf, unless --user \
names another user. Files written under sudo belong to the user who ran \
sudo. mtrace report and mtrace diff read saved profiles and need no \
privilege.";

/// One exit status and what it means.
type Status = (&'static str, &'static str);

const EXIT_IO: Status = (
    "74",
    "An output could not be written (a full disk, /dev/full, a closed standard output); \
     the others were written.",
);

fn exit_status_trace() -> Vec<Status> {
    vec![
        ("0", "Tracing by pid ended and every output was written."),
        (
            "N",
            "In launch mode, the command's own exit status (128+N if signal N killed it), \
             whatever mtrace wrote.",
        ),
        (
            "1",
            "A runtime error: no such process, a kernel thread, not enough privilege, \
             no malloc in the target.",
        ),
        (
            "2",
            "A usage error: bad or missing arguments (mtrace alone included), an unknown \
             --user, an output whose directory does not exist or is read-only.",
        ),
        EXIT_IO,
        ("126", "The command of launch mode cannot be executed."),
        ("127", "The command of launch mode is not found."),
    ]
}

fn exit_status_offline() -> Vec<Status> {
    vec![
        ("0", "The report was printed and every output written."),
        (
            "2",
            "A usage error, or a profile it will not read: unreadable, not a regular file, \
             over 1 GiB, not an mtrace profile, or with values no trace produces.",
        ),
        EXIT_IO,
    ]
}

fn exit_status_diff() -> Vec<Status> {
    let mut s = vec![
        ("0", "No --fail-if condition holds."),
        ("1", "A --fail-if condition holds: a regression."),
    ];
    s.extend(exit_status_offline().into_iter().skip(1));
    s
}

fn page(cmd: clap::Command, status: Vec<Status>, see_also: &[String]) -> (String, Vec<u8>) {
    let (examples, notes) = split_after_help(&cmd);
    let name = cmd
        .get_display_name()
        .unwrap_or_else(|| cmd.get_name())
        .to_string();
    let has_args = cmd.get_arguments().any(|a| !a.is_hide_set());
    let has_subs = cmd.get_subcommands().any(|s| !s.is_hide_set());
    let has_version = cmd.get_version().is_some();
    // Every page's footer names the version, the subcommands' too.
    let man = Man::new(cmd)
        .manual("User Commands")
        .source(format!("mtrace {}", env!("CARGO_PKG_VERSION")));
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    man.render_title(&mut out).unwrap();
    // Left-adjusted, unhyphenated: commands and options keep their shape.
    let mut roff = Roff::new();
    roff.control("ad", ["l"]).control("nh", []);
    roff.to_writer(&mut out).unwrap();
    man.render_name_section(&mut out).unwrap();
    man.render_synopsis_section(&mut out).unwrap();
    man.render_description_section(&mut out).unwrap();
    let mut roff = Roff::new();
    for paragraph in &notes {
        roff.control("PP", []);
        roff.text([roman(paragraph.join(" "))]);
    }
    roff.to_writer(&mut out).unwrap();
    if has_args {
        man.render_options_section(&mut out).unwrap();
    }
    if has_subs {
        man.render_subcommands_section(&mut out).unwrap();
    }

    let mut roff = Roff::new();
    if !examples.is_empty() {
        roff.control("SH", ["EXAMPLES"]);
        for example in &examples {
            // `command   what it does`, or a command alone.
            let (command, what) = match example.split_once("  ") {
                Some((c, w)) => (c.trim(), w.trim()),
                None => (example.trim(), ""),
            };
            roff.control("TP", []);
            roff.text([bold(command)]);
            if !what.is_empty() {
                roff.text([roman(what)]);
            }
        }
    }
    roff.control("SH", ["EXIT STATUS"]);
    for (code, meaning) in status {
        roff.control("TP", []);
        roff.text([bold(code)]);
        roff.text([roman(meaning)]);
    }
    roff.control("SH", ["SEE ALSO"]);
    let refs: Vec<String> = see_also.iter().map(|n| format!("{n}(1)")).collect();
    roff.text([roman(refs.join(", "))]);
    roff.to_writer(&mut out).unwrap();
    if has_version {
        man.render_version_section(&mut out).unwrap();
    }
    (format!("{name}.1"), out)
}

/// The command's `after_help` (what `--help` prints after the options):
/// the lines of its `Examples:` block, and its other paragraphs (an `Exit
/// status:` one left out: the page has a section for that).
fn split_after_help(cmd: &clap::Command) -> (Vec<String>, Vec<Vec<String>>) {
    let text = cmd
        .get_after_help()
        .map(|h| h.to_string())
        .unwrap_or_default();
    let mut examples = Vec::new();
    let mut notes = Vec::new();
    for block in text.split("\n\n") {
        let mut lines = block.lines();
        match lines.next().map(str::trim) {
            Some("Examples:") => examples.extend(lines.map(|l| l.trim().to_string())),
            Some(first) if !first.starts_with("Exit status:") => {
                notes.push(block.lines().map(|l| l.trim().to_string()).collect())
            }
            _ => {}
        }
    }
    (examples, notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page_text(name: &str) -> String {
        let pages = man_pages();
        let (_, roff) = pages
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no page {name}"));
        String::from_utf8(roff.clone()).unwrap()
    }

    #[test]
    fn one_page_per_visible_command() {
        let names: Vec<String> = man_pages().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "mtrace.1",
                "mtrace-report.1",
                "mtrace-diff.1",
                "mtrace-top.1",
                "mtrace-agent.1"
            ]
        );
    }

    #[test]
    fn the_main_page_has_every_section_and_no_hidden_option() {
        let page = page_text("mtrace.1");
        for section in [
            ".SH NAME",
            ".SH SYNOPSIS",
            ".SH DESCRIPTION",
            ".SH OPTIONS",
            ".SH SUBCOMMANDS",
            ".SH EXAMPLES",
            ".SH \"EXIT STATUS\"",
            ".SH \"SEE ALSO\"",
        ] {
            assert!(page.contains(section), "{section} missing:\n{page}");
        }
        // Options as roff escapes their dashes.
        assert!(page.contains(r"\-\-live"), "{page}");
        assert!(page.contains(r"\-\-user"), "{page}");
        assert!(!page.contains(r"\-\-bench\-floor"), "{page}");
        assert!(!page.contains("generate"), "{page}");
        assert!(page.contains("mtrace\\-report(1)"), "{page}");
    }

    #[test]
    fn examples_come_from_the_help_text() {
        let page = page_text("mtrace.1");
        let (examples, _) = split_after_help(&Cli::command());
        assert!(examples.len() >= 5, "{examples:?}");
        assert!(
            page.contains(r"\fBsudo mtrace \-\-pid 1234\fR"),
            "first example missing:\n{page}"
        );
        let diff = page_text("mtrace-diff.1");
        assert!(
            diff.contains(r"\fBmtrace diff base.json new.json\fR"),
            "{diff}"
        );
        // Its `Exit status:` line became the section.
        assert!(!diff.contains("Exit status:"), "{diff}");
        assert!(diff.contains("A \\-\\-fail\\-if condition holds"), "{diff}");
    }

    #[test]
    fn completions_name_the_subcommands_and_options() {
        let (name, script) = completions(clap_complete::Shell::Bash);
        assert_eq!(name, "mtrace.bash");
        let script = String::from_utf8(script).unwrap();
        assert!(script.contains("complete -F _mtrace"), "{script}");
        for word in ["report", "diff", "--live", "--fail-if", "--user"] {
            assert!(script.contains(word), "{word} missing");
        }
        let (zsh, _) = completions(clap_complete::Shell::Zsh);
        let (fish, _) = completions(clap_complete::Shell::Fish);
        assert_eq!((zsh.as_str(), fish.as_str()), ("_mtrace", "mtrace.fish"));
    }
}
