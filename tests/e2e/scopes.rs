//! Scopes beyond one process: `--cgroup` (every process of a cgroup v2
//! directory, present and to come, and none outside it).

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use crate::{
    counts::assert_counts_sites_times,
    lifecycle::sigkilled_mtrace_leaves_no_breakpoints_in,
    support::{Fixture, Mtrace},
};

/// A cgroup of the test's own under the cgroup2 mount, removed when
/// dropped (its processes must be gone by then).
pub struct TestCgroup {
    dir: PathBuf,
}

impl TestCgroup {
    pub fn new(name: &str) -> TestCgroup {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
        let mount = mounts
            .lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
            })
            .expect("a cgroup2 mount in /proc/mounts");
        let dir = mount.join(format!("mtrace-e2e-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TestCgroup { dir }
    }

    pub fn path(&self) -> &str {
        self.dir.to_str().unwrap()
    }

    /// A shell command that moves its shell into the cgroup first.
    fn join(&self) -> String {
        format!("echo $$ > {}/cgroup.procs", self.dir.display())
    }

    pub fn add(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Waits until `file` exists (the test's go), from a shell.
fn wait_for(file: &Path) -> String {
    format!("while [ ! -e {} ]; do sleep 0.02; done", file.display())
}

/// A member present when tracing begins runs the counts fixture twice
/// (once through a shell it starts); a process that joins the cgroup
/// after tracing began runs it once; the same fixture run outside the
/// cgroup meanwhile is not traced. Every run in the cgroup is counted
/// exactly, and the trace ends by itself when the cgroup is empty.
#[test]
fn a_cgroup_is_traced_present_and_to_come_and_nothing_outside() {
    need_bpf!();
    let cg = TestCgroup::new("scope");
    let dir = tempfile::tempdir().unwrap();
    let (go, go_late) = (dir.path().join("go"), dir.path().join("go-late"));
    let counts = Fixture::Counts.path_str();
    let member = std::process::Command::new("sh")
        .args([
            "-c",
            &format!(
                "{}; {}; {counts} >/dev/null; sh -c '{counts} >/dev/null'",
                cg.join(),
                wait_for(&go)
            ),
        ])
        .spawn()
        .unwrap();
    // In the cgroup before mtrace looks.
    while !std::fs::read_to_string(cg.dir.join("cgroup.procs"))
        .unwrap()
        .contains(&member.id().to_string())
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    let json = dir.path().join("p.json");
    let mut m = Mtrace::start(&[
        "--per-process",
        "--top",
        "1",
        "-o",
        json.to_str().unwrap(),
        "--cgroup",
        cg.path(),
    ]);
    m.wait_tracing();
    let joiner = std::process::Command::new("sh")
        .args([
            "-c",
            &format!(
                "{}; {}; exec {counts} >/dev/null",
                cg.join(),
                wait_for(&go_late)
            ),
        ])
        .spawn()
        .unwrap();
    let outside = std::process::Command::new(counts)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let outside_pid = outside.id();
    std::fs::write(&go, "").unwrap();
    // Time for mtrace (which lists the cgroup every 0.1 s) to see the
    // process that joined.
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::write(&go_late, "").unwrap();
    for mut child in [member, joiner, outside] {
        child.wait().unwrap();
    }
    let out = m.finish();
    out.assert_exit(0);
    let d = out.describe();
    assert!(
        out.stderr
            .iter()
            .any(|l| l.ends_with(": no process is left in the cgroup")),
        "{d}"
    );
    let p = crate::support::Profile::load(&json);
    let procs = p.doc["meta"]["processes"].as_array().unwrap().clone();
    let counted: Vec<u64> = procs
        .iter()
        .filter(|e| e["name"] == "counts")
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(counted.len(), 3, "{procs:?}\n{d}");
    assert!(
        !procs
            .iter()
            .any(|e| e["pid"].as_u64() == Some(outside_pid as u64)),
        "the process outside the cgroup was traced: {procs:?}"
    );
    assert_counts_sites_times(&p, 3, &d);
    // Per process, each with the cgroup it ran in.
    let name = cg.dir.file_name().unwrap().to_str().unwrap();
    let report = out.report();
    let in_cgroup = report
        .by_process
        .iter()
        .filter(|l| l.starts_with("counts (pid ") && l.ends_with(&format!(", cgroup /{name}")))
        .count();
    assert_eq!(in_cgroup, 3, "{d}");
}

/// mtrace killed with SIGKILL while it traces a cgroup leaves nothing in
/// its processes.
#[test]
fn sigkilled_mtrace_leaves_no_breakpoints_in_a_cgroup() {
    need_bpf!();
    let cg = TestCgroup::new("kill");
    let path = cg.path().to_string();
    sigkilled_mtrace_leaves_no_breakpoints_in(&|pid| {
        cg.add(pid);
        vec!["--cgroup".into(), path.clone()]
    });
}

/// A directory that is not a cgroup v2 one, and an empty cgroup: one
/// line each, and the status of a target that cannot be traced.
#[test]
fn a_path_that_is_not_a_cgroup_or_an_empty_one_is_refused() {
    need_bpf!();
    let out = crate::support::run_mtrace(&["--cgroup", "/tmp"]);
    out.assert_exit(1);
    out.assert_error("/tmp: not a cgroup v2 directory");
    let cg = TestCgroup::new("empty");
    let out = crate::support::run_mtrace(&["--cgroup", cg.path()]);
    out.assert_exit(1);
    out.assert_error("has no process to trace");
}
