//! A cgroup v2 directory of the test's own.

use std::{path::PathBuf, time::Duration};

/// A cgroup of the test's own under the cgroup2 mount, removed when
/// dropped (its processes must be gone by then).
pub struct TestCgroup {
    pub dir: PathBuf,
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
    pub fn join(&self) -> String {
        format!("echo $$ > {}/cgroup.procs", self.dir.display())
    }

    /// Waits until process `pid` is in the cgroup.
    pub fn wait_in(&self, pid: u32) {
        while !std::fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap()
            .lines()
            .any(|l| l == pid.to_string())
        {
            std::thread::sleep(Duration::from_millis(10));
        }
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
