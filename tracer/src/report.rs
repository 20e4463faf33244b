//! Offline commands on saved profiles: `mtrace report` and `mtrace diff`.

use anyhow::Result;

use crate::{
    cli::{DiffArgs, ReportArgs},
    outputs, profile_file,
};

/// `mtrace report FILE.json`: the same table and files as a live trace.
pub fn run(args: ReportArgs) -> Result<i32> {
    let profile = profile_file::read(&args.file)?;
    outputs::emit(&profile, &args.out)?;
    Ok(0)
}

/// `mtrace diff BASE.json NEW.json`.
pub fn diff(args: DiffArgs) -> Result<i32> {
    let _base = profile_file::read(&args.base)?;
    let _new = profile_file::read(&args.new)?;
    Err(crate::user_error!("diff is not wired yet"))
}
