//! `mtrace diff BASE.json NEW.json`: prints what changed; exits 1 when a
//! `--fail-if` condition holds, 2 on unreadable input or a bad condition.

use std::fmt::Write;

use anyhow::Result;

use crate::{
    cli::{
        config,
        diff::{DiffArgs, DiffFormat},
    },
    diff::{self, gate},
    error::{UserError, EXIT_USAGE},
    profile::{file as profile_file, Profile},
    render::{
        diff_report::{self, DiffReport, Side},
        diff_table,
        flamegraph::Kind,
        folded,
        text::{printable_profile, shown},
    },
    say,
    sinks::{
        check_outputs,
        files::{write_file, write_flamegraph},
        stdout::StdoutText,
    },
};

pub fn run(args: DiffArgs) -> Result<i32> {
    let conditions = args
        .fail_if
        .iter()
        .map(|c| gate::parse_condition(c))
        .collect::<Result<Vec<_>, String>>()
        .map_err(|e| anyhow::Error::new(UserError::with_code(e, profile_file::EXIT_BAD_INPUT)))?;
    let weight = config::diff_weight(args.stacks.weight)?;
    check_outputs(
        [&args.output, &args.stacks.folded, &args.stacks.flamegraph]
            .into_iter()
            .flatten(),
    )?;
    // Names from the traced processes, made printable on both sides
    // alike, so that they still match.
    let base = profile_file::read(&args.base)?;
    let base = printable_profile(&base);
    let new = profile_file::read(&args.new)?;
    let new = printable_profile(&new);
    let d = diff::diff(&base, &new).with_groups(&base, &new, args.per_test, &args.groups);
    if args.per_group && d.groups.is_empty() {
        return Err(anyhow::Error::new(UserError::with_code(
            "--per-group needs --group NAME=PATTERN (or profiles saved with --group)",
            EXIT_USAGE,
        )));
    }

    let options = gate::GateOptions {
        per_stack: args.per_stack,
        noise_floor: args.noise_floor,
        per_test: args.per_test,
        per_group: args.per_group,
    };
    let outcomes = gate::judge(&d, &conditions, options);
    let violations: Vec<&gate::Violation> = outcomes.iter().flat_map(|o| &o.violations).collect();
    // The text report, written as it is made.
    let text = |out: &mut dyn Write| -> std::fmt::Result {
        writeln!(
            out,
            "mtrace diff: {} ({}) -> {} ({})",
            args.base.display(),
            describe(&base),
            args.new.display(),
            describe(&new)
        )?;
        diff_table::render_table_to(&mut &mut *out, &d, args.top)?;
        diff_table::render_groups_to(&mut &mut *out, &d)?;
        if !conditions.is_empty() {
            out.write_char('\n')?;
            if violations.is_empty() {
                writeln!(out, "ok: no regression ({})", args.fail_if.join(", "))?;
            }
            for v in &violations {
                writeln!(out, "{v}")?;
            }
            let noise: usize = outcomes.iter().map(|o| o.within_noise).sum();
            if noise > 0 {
                writeln!(
                    out,
                    "noise: {noise} stack change{} within --noise-floor {} not gated",
                    if noise == 1 { "" } else { "s" },
                    args.noise_floor
                )?;
            }
        }
        Ok(())
    };
    let (base_path, new_path) = (
        args.base.display().to_string(),
        args.new.display().to_string(),
    );
    let report = DiffReport {
        base: side(&base_path, &base),
        new: side(&new_path, &new),
        diff: &d,
        outcomes: &outcomes,
        top: args.top,
        noise_floor: args.noise_floor,
    };
    let formatted = || match args.format {
        DiffFormat::Text => {
            let mut s = String::new();
            let _ = text(&mut s);
            s
        }
        DiffFormat::Json => diff_report::json(&report),
        DiffFormat::Markdown => diff_report::markdown(&report),
        DiffFormat::Junit => diff_report::junit(&report),
    };
    let mut stdout = StdoutText::new();
    if args.output.is_none() && args.format != DiffFormat::Text {
        let _ = stdout.write_str(&formatted());
    } else {
        // A failed write is kept, and said by `finish`.
        let _ = text(&mut stdout);
    }
    stdout.finish()?;
    if let Some(path) = &args.output {
        let what = format!("{:?} diff report", args.format).to_lowercase();
        write_file(path, &what, formatted().as_bytes())?;
    }

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

fn side<'a>(path: &'a str, p: &'a Profile) -> Side<'a> {
    Side {
        path,
        command: &p.meta.command,
        start_time: &p.meta.start_time,
    }
}

/// `command, start time`, each as a person is shown it (the command is
/// printable already).
fn describe(p: &Profile) -> String {
    format!("{}, {}", shown(&p.meta.command), shown(&p.meta.start_time))
}
