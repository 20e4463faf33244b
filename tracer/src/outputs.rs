//! Writing what [`OutputArgs`] asks for: the table on stdout and every
//! requested file. Shared by a live trace and `mtrace report`.

use std::{io::Write, path::Path};

use anyhow::Result;

use crate::{
    cli::OutputArgs,
    profile::Profile,
    profile_file,
    render::{self, ReportOptions},
    user_error,
};

pub fn report_options(out: &OutputArgs) -> ReportOptions {
    ReportOptions {
        top: out.top,
        threshold_pct: out.threshold,
        sort: out.sort,
        per_thread: out.per_thread,
    }
}

/// Prints the table to stdout and writes every requested file.
pub fn emit(profile: &Profile, out: &OutputArgs) -> Result<()> {
    let table = render::table::render(profile, &report_options(out));
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(table.as_bytes())?;
    stdout.flush()?;
    drop(stdout);
    write_files(profile, out)
}

fn write_file(path: &Path, what: &str, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| user_error!("cannot write {}: {e}", path.display()))?;
    eprintln!("mtrace: wrote {what} to {}", path.display());
    Ok(())
}

pub fn write_files(profile: &Profile, out: &OutputArgs) -> Result<()> {
    if let Some(path) = &out.output {
        profile_file::write(path, profile)?;
        eprintln!("mtrace: wrote profile to {}", path.display());
    }
    if out.folded.is_some() || out.flamegraph.is_some() {
        let folded = render::folded::render(profile, out.weight, out.per_thread);
        if let Some(path) = &out.folded {
            write_file(path, "folded stacks", folded.as_bytes())?;
        }
        if let Some(path) = &out.flamegraph {
            let title = format!(
                "mtrace: {} (pid {})",
                profile.meta.command, profile.meta.pid
            );
            match render::flamegraph::render(&folded, &title, out.weight) {
                Ok(svg) => write_file(path, "flamegraph", &svg)?,
                Err(e) => eprintln!("mtrace: no flamegraph written: {e}"),
            }
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
