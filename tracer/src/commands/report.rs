//! `mtrace report FILE.json`: the same table and files as a live trace,
//! from a saved profile, its unnamed frames named where debug information
//! for their build ids can be found now.

use anyhow::Result;

use crate::{
    cli::{config, ReportArgs},
    profile::file as profile_file,
    sinks::{Report, Sink},
};

pub fn run(args: ReportArgs) -> Result<i32> {
    let outputs = config::outputs(&args.out);
    outputs.check()?;
    let mut profile = profile_file::read(&args.file)?;
    crate::symbolize::name_saved(&mut profile);
    outputs.check_weight(profile.live.is_some())?;
    Report(outputs).finish(&profile)?;
    Ok(0)
}
