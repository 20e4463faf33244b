//! Profiles at scale, made up (no trace, no privilege): 100,000 distinct
//! stacks of 35 frames make a file of a few MB that `report` and `diff`
//! read; `report --tree` writes a stack of 100,000 frames, and a node of
//! 100,000 children in time linear in them. `report` and `diff` hold a
//! profile in memory bounded by its size ([`peak_bound`]), whatever it
//! names and how often; a name of a megabyte is cut on a report's line.

use std::{fs, path::Path, time::Duration};

use tracer_offline::profile::{file, synthetic, Profile};

use crate::support::{run_mtrace, s, Finished, Mtrace};

/// The most a `report` or a `diff` may hold at its peak (resident), as
/// docs/usage.md states it: 32 MiB and ten times the bytes of the
/// profile files it reads.
fn peak_bound(read: u64) -> u64 {
    (32 << 20) + 10 * read
}

/// Runs mtrace with `args`, which must exit 0: what it printed, and its
/// peak resident memory in bytes.
fn run_measured(args: &[&str]) -> (Finished, u64) {
    let (out, used) = Mtrace::start(args).finish_measured();
    out.assert_exit(0);
    (out, used.peak_rss_kib as u64 * 1024)
}

/// `report`, `report --tree` and `diff` of `path` (against itself), each
/// within [`peak_bound`] of the file's size; their outputs.
fn within_bound(path: &str, extra: &[&str]) -> Vec<Finished> {
    let size = fs::metadata(path).unwrap().len();
    let runs: [(&[&str], u64); 3] = [
        (&["report", path], size),
        (&["report", "--tree", path], size),
        (&["diff", path, path], 2 * size),
    ];
    runs.iter()
        .map(|&(args, read)| {
            let mut all = args.to_vec();
            all.extend_from_slice(extra);
            let (out, peak) = run_measured(&all);
            assert!(
                peak <= peak_bound(read),
                "{all:?} of {size} bytes peaked at {} MiB, over {} MiB",
                peak >> 20,
                peak_bound(read) >> 20
            );
            out
        })
        .collect()
}

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

/// One frame of a 100 KB name, named 10,011 times by 141 stacks, in a file
/// of some hundreds of KB: read, reported and compared within the bound
/// of that size (main's model copied the frame into every stack, 1 GB for
/// a report, 2.9 GB for a diff).
#[test]
fn a_frame_named_10000_times_is_held_once() {
    let dir = tempfile::tempdir().unwrap();
    let name: String = "a_long_made_up_function_name_".repeat(3449)[..100_000].into();
    let path = write(
        dir.path(),
        "long.json",
        &synthetic::one_frame_named_often(name, 10_000),
    );
    let size = fs::metadata(&path).unwrap().len();
    assert!(size < 512 << 10, "{size} bytes");
    // The reports name it (the diff of a file with itself names none).
    for out in &within_bound(&path, &[])[..2] {
        assert!(
            out.stdout.contains("a_long_made_up_function_name_"),
            "{}",
            out.describe()
        );
    }
}

/// A 7 MB profile of 32,768 distinct stacks of 35 frames prints its top
/// row in at most 100 MB (main's took 474 MB); its tree and its diff stay
/// within the bound.
#[test]
fn top_row_of_32768_stacks_in_100_mb() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "deep.json", &synthetic::deep_stacks(32_768, 35));
    let size = fs::metadata(&path).unwrap().len();
    assert!((6 << 20..9 << 20).contains(&size), "{size} bytes");
    let (out, peak) = run_measured(&["report", "--top", "1", &path]);
    assert!(out.stdout.contains("\n#1 "), "{}", out.describe());
    assert!(out.stdout.contains("level0_site"), "{}", out.describe());
    assert!(peak <= 100 << 20, "peaked at {} MiB", peak >> 20);
    within_bound(&path, &["--top", "1"]);
}

/// A frame's name of a megabyte (1,048,576 characters) is cut on every
/// line of the table, the tree and the diff, after 1,024 characters, with
/// the count of those left out (a line, its counts and place too, stays
/// under 1,200 characters); the JSON profile and speedscope's file
/// keep it whole.
#[test]
fn a_name_of_a_megabyte_is_cut_on_report_lines_whole_in_json() {
    let dir = tempfile::tempdir().unwrap();
    let name = "m".repeat(1 << 20);
    let base = synthetic::one_frame_named_often(name.clone(), 1);
    let mut grown = base.clone();
    grown.stacks[0].counts.calls += 1;
    grown.totals.allocs.calls += 1;
    grown.totals.per_func.get_mut("malloc").unwrap().calls += 1;
    let base = write(dir.path(), "base.json", &base);
    let grown = write(dir.path(), "grown.json", &grown);
    let json = s(&dir.path().join("out.json")).to_string();
    let speedscope = s(&dir.path().join("speedscope.json")).to_string();
    let mark = "…[1047552 more characters]";
    let report = run_mtrace(&[
        "report",
        "--tree",
        "--threshold",
        "0",
        &base,
        "-o",
        &json,
        "--speedscope",
        &speedscope,
    ]);
    let diff = run_mtrace(&["diff", &base, &grown]);
    for (out, cut) in [(&report, 2), (&diff, 1)] {
        out.assert_exit(0);
        let long: Vec<&str> = out
            .stdout
            .lines()
            .filter(|l| l.chars().count() > 1200)
            .collect();
        assert!(
            long.is_empty(),
            "lines of {:?} characters",
            long.iter().map(|l| l.chars().count()).collect::<Vec<_>>()
        );
        let marked = out
            .stdout
            .lines()
            .filter(|l| l.contains(&format!("{}{mark}", &name[..1024])))
            .count();
        assert_eq!(marked, cut, "{}", &out.stdout[..out.stdout.len().min(4096)]);
    }
    let written: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        written["frames"][0]["function"].as_str(),
        Some(name.as_str())
    );
    let speedscope: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&speedscope).unwrap()).unwrap();
    let frames = speedscope["shared"]["frames"].as_array().unwrap();
    assert!(
        frames
            .iter()
            .any(|f| f["name"].as_str() == Some(name.as_str())),
        "no frame of the whole name in speedscope's file"
    );
}
