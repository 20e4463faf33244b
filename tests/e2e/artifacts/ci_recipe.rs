//! The CI recipe of docs/profiles.md, run as GitHub would run it: the
//! workflow file's steps, in order, on fixtures.

use std::{
    fs,
    os::unix::fs::{symlink, PermissionsExt},
    path::Path,
    process::Command,
};

use serde_json::Value;

use crate::support::{diff::junit_cases, mtrace::mtrace_path, Fixture};

/// The workflow file docs/profiles.md shows.
fn workflow() -> (String, Value) {
    let path = crate::support::fixtures::fixtures_dir().join("../../docs/ci/allocations.yml");
    let text = fs::read_to_string(&path).unwrap();
    let doc: Value = serde_saphyr::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not YAML: {e}", path.display()));
    (text, doc)
}

/// A directory for PATH with `mtrace` and a `sudo` that runs its command
/// (the tests run as root); PATH with it first.
fn tools(dir: &Path) -> String {
    let bin = dir.join("bin");
    fs::create_dir(&bin).unwrap();
    symlink(mtrace_path(), bin.join("mtrace")).unwrap();
    fs::write(bin.join("sudo"), "#!/bin/sh\nexec \"$@\"\n").unwrap();
    fs::set_permissions(bin.join("sudo"), fs::Permissions::from_mode(0o755)).unwrap();
    format!("{}:{}", bin.display(), std::env::var("PATH").unwrap())
}

/// Runs the job's `run` steps in `dir` as a runner does (`bash -e` unless
/// the step names its shell; the first failing step ends the job). The
/// build step is the test's: `bench` is put in place instead. Returns the
/// name of the step that failed and its exit code.
fn run_job(doc: &Value, dir: &Path, path: &str) -> Option<(String, i32)> {
    let steps = doc["jobs"]["allocations"]["steps"].as_array().unwrap();
    for step in steps {
        let (Some(run), name) = (step["run"].as_str(), step["name"].as_str().unwrap_or("")) else {
            continue;
        };
        if name == "build" {
            continue;
        }
        let shell = step["shell"].as_str().unwrap_or("bash -e {0}");
        let script = dir.join("step.sh");
        fs::write(&script, run).unwrap();
        let argv: Vec<String> = shell
            .split_whitespace()
            .map(|a| a.replace("{0}", script.to_str().unwrap()))
            .collect();
        let status = Command::new(&argv[0])
            .args(&argv[1..])
            .current_dir(dir)
            .env("PATH", path)
            .env("GITHUB_STEP_SUMMARY", dir.join("summary.md"))
            .status()
            .unwrap();
        if !status.success() {
            return Some((name.to_string(), status.code().unwrap_or(-1)));
        }
    }
    None
}

/// docs/ci/allocations.yml, the workflow docs/profiles.md shows word for
/// word: its baseline recorded as its comment says; its job passes on the
/// same build, with the verdict in the step summary and a JUnit report
/// without failures; and fails at its gate step on a build that makes
/// 15% more calls, the summary and the JUnit report saying so.
#[test]
fn the_documented_ci_workflow_gates_a_build() {
    let dir = bpf_tempdir!();
    let (text, doc) = workflow();
    let docs =
        fs::read_to_string(crate::support::fixtures::fixtures_dir().join("../../docs/profiles.md"))
            .unwrap();
    assert!(
        docs.contains(&format!("```yaml\n{text}```")),
        "docs/profiles.md shows docs/ci/allocations.yml as it is"
    );
    let d = dir.path();
    let path = tools(d);
    fs::create_dir_all(d.join("target/release")).unwrap();
    fs::create_dir_all(d.join("ci")).unwrap();
    let bench = d.join("target/release/bench");
    fs::copy(Fixture::Counts.path(), &bench).unwrap();
    let baseline = text
        .lines()
        .find_map(|l| {
            l.trim_start_matches('#')
                .trim()
                .strip_prefix("sudo mtrace ")
        })
        .expect("the workflow's comment says how the baseline is made");
    let made = Command::new("sh")
        .args(["-c", &format!("sudo mtrace {baseline}")])
        .current_dir(d)
        .env("PATH", &path)
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");

    let summary = || fs::read_to_string(d.join("summary.md")).unwrap_or_default();
    let junit = || junit_cases(&fs::read_to_string(d.join("gate.xml")).unwrap());
    assert_eq!(run_job(&doc, d, &path), None, "{}", summary());
    assert!(summary().contains("no regression"), "{}", summary());
    let (cases, failures) = junit();
    assert!(
        !cases.is_empty() && failures.is_empty(),
        "{cases:?} {failures:?}"
    );

    fs::remove_file(d.join("summary.md")).unwrap();
    fs::copy(Fixture::CountsPlus20.path(), &bench).unwrap();
    assert_eq!(
        run_job(&doc, d, &path),
        Some(("gate".to_string(), 1)),
        "{}",
        summary()
    );
    assert!(summary().contains("❌ "), "{}", summary());
    let (_, failures) = junit();
    assert!(
        failures.iter().any(|f| f.contains("calls")),
        "{failures:?}\n{}",
        summary()
    );
}
