//! What the tests of scopes beyond one process compare: a profile's
//! allocation stacks tallied per process, and a run against the same
//! program traced alone.

use std::collections::BTreeMap;

use super::Profile;

/// (allocator function, its whole stack: the frames' functions, files and
/// lines, innermost first, and whether it was cut short) -> calls of the
/// allocation stacks of a profile, of the processes `keep` takes (pid,
/// name).
pub fn tally(p: &Profile, keep: &dyn Fn(u64, &str) -> bool) -> BTreeMap<(String, String), u64> {
    let mut out = BTreeMap::new();
    for s in p.allocs() {
        let (pid, name) = s
            .process
            .as_ref()
            .map_or((0, ""), |r| (r.pid as u64, r.name.as_str()));
        if keep(pid, name) {
            let frames: Vec<String> = s
                .frames
                .iter()
                .map(|f| format!("{} {:?}:{:?}", f.function, f.file, f.line))
                .collect();
            let stack = format!("{} cut:{}", frames.join(" <- "), s.truncated);
            *out.entry((s.function.clone(), stack)).or_default() += s.calls;
        }
    }
    out
}

/// `run` and `alone` the same, else a failure that names first what
/// differs (each stack's calls on both sides), then `what`.
pub fn assert_tally_eq(
    run: &BTreeMap<(String, String), u64>,
    alone: &BTreeMap<(String, String), u64>,
    what: &str,
) {
    if run == alone {
        return;
    }
    let mut diff = Vec::new();
    for key in run
        .keys()
        .chain(alone.keys().filter(|k| !run.contains_key(*k)))
    {
        let (a, b) = (run.get(key), alone.get(key));
        if a != b {
            diff.push(format!("{a:?} against {b:?} alone: {} {}", key.0, key.1));
        }
    }
    panic!("the tallies differ:\n{}\n{what}", diff.join("\n"));
}

/// A run traced file-wide against the same program traced alone: the
/// same calls per function and direct caller, and every whole stack one
/// the trace alone has, frame for frame. (A first run's walk that met a
/// frame without a rule yet, its process gone before mtrace read its
/// mappings, is cut short there, and said: `process_gone`.)
pub fn assert_same_as_alone(
    run: &BTreeMap<(String, String), u64>,
    alone: &BTreeMap<(String, String), u64>,
    d: &str,
) {
    let sites = |t: &BTreeMap<(String, String), u64>| {
        let mut out: BTreeMap<(String, String), u64> = BTreeMap::new();
        for ((f, stack), calls) in t {
            let caller = stack.split(" <- ").next().unwrap_or("");
            let caller = caller.split(" cut:").next().unwrap_or("").to_string();
            *out.entry((f.clone(), caller)).or_default() += calls;
        }
        out
    };
    assert_eq!(sites(run), sites(alone), "{d}");
    for ((f, stack), _) in run.iter().filter(|((_, s), _)| s.ends_with("cut:false")) {
        assert!(
            alone.contains_key(&(f.clone(), stack.clone())),
            "{f} {stack}: a whole stack the trace alone has not\n{d}"
        );
    }
}
