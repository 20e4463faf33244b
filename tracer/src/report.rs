//! Offline commands on saved profiles: `mtrace report` and `mtrace diff`.

use std::io::Write;

use anyhow::Result;

use crate::{
    cli::{DiffArgs, ReportArgs},
    diff,
    error::UserError,
    outputs, profile_file, user_error,
};

/// `mtrace report FILE.json`: the same table and files as a live trace.
pub fn run(args: ReportArgs) -> Result<i32> {
    let profile = profile_file::read(&args.file)?;
    outputs::emit(&profile, &args.out)?;
    Ok(0)
}

/// `mtrace diff BASE.json NEW.json`: prints what changed; exits 1 when a
/// `--fail-if` condition holds, 2 on unreadable input or a bad condition.
pub fn diff(args: DiffArgs) -> Result<i32> {
    let conditions = args
        .fail_if
        .iter()
        .map(|c| diff::parse_condition(c))
        .collect::<Result<Vec<_>, String>>()
        .map_err(|e| anyhow::Error::new(UserError::with_code(e, profile_file::EXIT_BAD_INPUT)))?;
    let base = profile_file::read(&args.base)?;
    let new = profile_file::read(&args.new)?;
    let d = diff::diff(&base, &new);

    let mut out = format!(
        "mtrace diff: {} ({}) -> {} ({})\n",
        args.base.display(),
        describe(&base),
        args.new.display(),
        describe(&new)
    );
    out.push_str(&diff::render_table(&d, args.top));
    let violations = diff::check(&d, &conditions, args.per_stack);
    if !conditions.is_empty() {
        out.push('\n');
        if violations.is_empty() {
            out.push_str(&format!(
                "ok: no regression ({})\n",
                args.fail_if.join(", ")
            ));
        }
        for v in &violations {
            out.push_str(&format!("{v}\n"));
        }
    }
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes())?;
    stdout.flush()?;
    drop(stdout);

    if args.folded.is_some() || args.flamegraph.is_some() {
        let folded = diff::differential_folded(&d, args.weight);
        if let Some(path) = &args.folded {
            std::fs::write(path, &folded)
                .map_err(|e| user_error!("cannot write {}: {e}", path.display()))?;
            eprintln!(
                "mtrace: wrote differential folded stacks to {}",
                path.display()
            );
        }
        if let Some(path) = &args.flamegraph {
            let title = format!(
                "mtrace diff: {} -> {}",
                args.base.display(),
                args.new.display()
            );
            match diff::differential_flamegraph(&folded, &title, args.weight) {
                Ok(svg) => {
                    std::fs::write(path, svg)
                        .map_err(|e| user_error!("cannot write {}: {e}", path.display()))?;
                    eprintln!(
                        "mtrace: wrote differential flamegraph to {}",
                        path.display()
                    );
                }
                Err(e) => eprintln!("mtrace: no differential flamegraph written: {e}"),
            }
        }
    }
    if violations.is_empty() {
        Ok(0)
    } else {
        eprintln!(
            "mtrace: {} regression{} found",
            violations.len(),
            if violations.len() == 1 { "" } else { "s" }
        );
        Ok(1)
    }
}

fn describe(p: &crate::profile::Profile) -> String {
    format!("{}, {}", p.meta.command, p.meta.start_time)
}
