//! `mtrace report FILE.json`: the same table and files as a live trace,
//! from a saved profile.

use anyhow::Result;

use crate::{
    cli::{config, ReportArgs},
    profile::file as profile_file,
    sinks::{Report, Sink},
};

pub fn run(args: ReportArgs) -> Result<i32> {
    let profile = profile_file::read(&args.file)?;
    Report(config::outputs(&args.out)).finish(&profile)?;
    Ok(0)
}
