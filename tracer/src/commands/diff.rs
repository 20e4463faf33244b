//! `mtrace diff BASE.json NEW.json`: prints what changed; exits 1 when a
//! `--fail-if` condition holds, 2 on unreadable input or a bad condition.

use std::fmt::Write as _;

use anyhow::Result;

use crate::{
    cli::{config, DiffArgs},
    diff::{self, gate},
    error::UserError,
    profile::{file as profile_file, Profile},
    render::{
        diff_table,
        flamegraph::Kind,
        folded,
        text::{printable_profile, shown},
    },
    say,
    sinks::{write_file, write_flamegraph, StdoutText},
};

pub fn run(args: DiffArgs) -> Result<i32> {
    let conditions = args
        .fail_if
        .iter()
        .map(|c| gate::parse_condition(c))
        .collect::<Result<Vec<_>, String>>()
        .map_err(|e| anyhow::Error::new(UserError::with_code(e, profile_file::EXIT_BAD_INPUT)))?;
    let weight = config::diff_weight(args.stacks.weight)?;
    // Names from the traced processes, made printable on both sides
    // alike, so that they still match.
    let base = profile_file::read(&args.base)?;
    let base = printable_profile(&base);
    let new = profile_file::read(&args.new)?;
    let new = printable_profile(&new);
    let d = diff::diff(&base, &new);

    let violations = gate::check(&d, &conditions, args.per_stack);
    let mut stdout = StdoutText::new();
    let mut text = || -> std::fmt::Result {
        writeln!(
            stdout,
            "mtrace diff: {} ({}) -> {} ({})",
            args.base.display(),
            describe(&base),
            args.new.display(),
            describe(&new)
        )?;
        diff_table::render_table_to(&mut stdout, &d, args.top)?;
        if !conditions.is_empty() {
            stdout.write_char('\n')?;
            if violations.is_empty() {
                writeln!(stdout, "ok: no regression ({})", args.fail_if.join(", "))?;
            }
            for v in &violations {
                writeln!(stdout, "{v}")?;
            }
        }
        Ok(())
    };
    // A failed write is kept, and said by `finish`.
    let _ = text();
    stdout.finish()?;

    let files = &args.stacks;
    if files.folded.is_some() || files.flamegraph.is_some() {
        let folded = folded::differential(&d, weight);
        if let Some(path) = &files.folded {
            write_file(path, "differential folded stacks", folded.as_bytes())?;
        }
        if let Some(path) = &files.flamegraph {
            let title = format!(
                "mtrace diff: {} -> {}",
                args.base.display(),
                args.new.display()
            );
            write_flamegraph(
                path,
                "differential flamegraph",
                &folded,
                &title,
                weight,
                Kind::Differential,
            )?;
        }
    }
    if violations.is_empty() {
        Ok(0)
    } else {
        say!(
            "mtrace: {} regression{} found",
            violations.len(),
            if violations.len() == 1 { "" } else { "s" }
        );
        Ok(1)
    }
}

/// `command, start time`, each as a person is shown it (the command is
/// printable already).
fn describe(p: &Profile) -> String {
    format!("{}, {}", shown(&p.meta.command), shown(&p.meta.start_time))
}
