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

/// mtrace killed while it writes a large output leaves nothing behind: the
/// file has no name until it is whole (no hidden temporary file, as a named
/// one left where mtrace died). Killed the moment a file of its is open in
/// the output directory, whatever it writes first.
#[test]
fn killed_while_writing_leaves_no_hidden_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = write(
        dir.path(),
        "deep.json",
        &synthetic::deep_stacks(100_000, 35),
    );
    let out = dir.path().join("out");
    fs::create_dir(&out).unwrap();
    let file = |name: &str| s(&out.join(name)).to_string();
    let (folded, html, json) = (file("p.folded"), file("p.html"), file("p.json"));
    let mut m = Mtrace::start(&[
        "report", &src, "--folded", &folded, "--html", &html, "-o", &json,
    ]);
    let pid = m.proc.id();
    let writing = |pid: u32| -> bool {
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
            return false;
        };
        fds.flatten()
            .filter_map(|e| fs::read_link(e.path()).ok())
            .any(|target| target.starts_with(&out))
    };
    let mut killed = false;
    let started = std::time::Instant::now();
    while m.proc.running() && started.elapsed() < TREE_TIMEOUT {
        if writing(pid) {
            m.proc.signal(libc::SIGKILL);
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let _ = m.finish();
    assert!(
        killed,
        "mtrace was never seen writing: the test proved nothing"
    );
    let left: Vec<String> = crate::support::names_in(&out)
        .into_iter()
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
