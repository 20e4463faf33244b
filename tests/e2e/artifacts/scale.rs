//! Profiles at scale, made up (no trace, no privilege): 100,000 distinct
//! stacks of 35 frames make a file of a few MB that `report` and `diff`
//! read; `report --tree` writes a stack of 100,000 frames, and a node of
//! 100,000 children in time linear in them.

use std::{fs, path::Path, time::Duration};

use tracer_offline::profile::{file, synthetic, Profile};

use super::s;
use crate::support::{run_mtrace, Finished, Mtrace};

/// Far more than a linear tree of 100,000 nodes takes on a busy machine,
/// far less than the quadratic one took (over 60 s).
const TREE_TIMEOUT: Duration = Duration::from_secs(30);

fn write(dir: &Path, name: &str, profile: &Profile) -> String {
    let path = dir.join(name);
    fs::write(&path, file::to_json(profile)).unwrap();
    s(&path).to_string()
}

/// `mtrace report --tree --threshold 0.0001` of `profile`, which must
/// exit 0 within [`TREE_TIMEOUT`]: its tree's lines, headings first, and
/// the rest of what it printed.
fn tree(profile: &Profile) -> (Vec<String>, Finished) {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "tree.json", profile);
    let mut m = Mtrace::start(&["report", "--tree", "--threshold", "0.0001", &path]);
    m.proc.wait_timeout(TREE_TIMEOUT);
    let out = m.finish();
    out.assert_exit(0);
    let at = out
        .stdout
        .find("call tree, top-down")
        .expect("no call tree");
    let lines = out.stdout[at..].lines().map(String::from).collect();
    (lines, out)
}

#[test]
fn deep_distinct_stacks_make_a_file_report_and_diff_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "deep.json",
        &synthetic::deep_stacks(100_000, 35),
    );
    // Version 1 repeated every frame in every stack: 1.2 GB, over what
    // `report` reads.
    let size = fs::metadata(&path).unwrap().len();
    assert!(size < 40 << 20, "{size} bytes");
    let out = run_mtrace(&["report", "--top", "1", &path]);
    out.assert_exit(0);
    assert!(out.stdout.contains("level0_site"), "{}", out.describe());
    run_mtrace(&["diff", &path, &path]).assert_exit(0);
}

#[test]
fn tree_of_a_stack_of_100k_frames() {
    let (lines, out) = tree(&synthetic::one_deep_stack(100_000));
    assert_eq!(lines.len(), 2 + 100_000, "{:?}", out.stderr);
    assert!(lines[2].ends_with("  f99999"), "{}", lines[2]);
    assert!(lines.last().unwrap().ends_with("[99999] f0"));
}

#[test]
fn tree_of_a_node_of_100k_children() {
    let (lines, out) = tree(&synthetic::siblings(100_000));
    assert_eq!(lines.len(), 3 + 100_000, "{:?}", out.stderr);
    assert!(lines[2].ends_with("  main"), "{}", lines[2]);
    // Equal totals: by name.
    assert!(lines[3].ends_with("    leaf0"), "{}", lines[3]);
}
