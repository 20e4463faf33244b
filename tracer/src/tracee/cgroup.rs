//! `--cgroup PATH`: a cgroup v2 directory (a container, a pod, a systemd
//! unit) and the processes in it.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::{
    error::{UserError, EXIT_USAGE},
    user_error,
};

/// Where cgroup v2 is mounted: on a v2-only host once, at
/// `/sys/fs/cgroup`; on a hybrid one beside the v1 controllers (often
/// `/sys/fs/cgroup/unified`).
fn mounts() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let (_, dir, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "cgroup2").then(|| PathBuf::from(dir.replace("\\040", " ")))
        })
        .collect()
}

/// The cgroup directory `path` names: absolute, or relative to where
/// cgroup v2 is mounted (`system.slice/redis.service`).
pub fn resolve(path: &str) -> Result<PathBuf> {
    let mounts = mounts();
    if mounts.is_empty() {
        return Err(user_error!(
            "--cgroup needs cgroup v2, and no cgroup2 file system is mounted (/proc/mounts)"
        ));
    }
    let given = Path::new(path);
    let mut candidates: Vec<PathBuf> = Vec::new();
    if given.is_absolute() && mounts.iter().any(|m| given.starts_with(m)) {
        candidates.push(given.to_path_buf());
    }
    for m in &mounts {
        candidates.push(m.join(path.trim_start_matches('/')));
    }
    let dir = candidates
        .into_iter()
        .find(|c| c.join("cgroup.procs").is_file())
        .ok_or_else(|| {
            let under: Vec<String> = mounts.iter().map(|m| m.display().to_string()).collect();
            user_error!(
                "{path}: not a cgroup v2 directory (looked under {})",
                under.join(", ")
            )
        })?;
    // The root holds every process of the host (and has no
    // `cgroup.events` to say when it empties): that scope is `--all`.
    if !dir.join("cgroup.events").is_file() {
        return Err(anyhow::Error::new(UserError::with_code(
            format!(
                "--cgroup {path} is the root of cgroup v2 ({}), which holds every process on the host: trace them with --all",
                dir.display()
            ),
            EXIT_USAGE,
        )));
    }
    Ok(dir)
}

/// The cgroup v2 id of `dir` (its directory's inode number, which the
/// kernel's cgroup id is) and its level below the mount's root (the
/// root's is 0), the ancestors counted up to the file system's root.
pub fn id_and_level(dir: &Path) -> Result<(u64, u32)> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).map_err(|e| user_error!("{}: {e}", dir.display()))?;
    let mut level = 0;
    let mut at = dir.to_path_buf();
    while let Some(parent) = at.parent() {
        match std::fs::metadata(parent) {
            Ok(m) if m.dev() == meta.dev() => level += 1,
            _ => break,
        }
        at = parent.to_path_buf();
    }
    Ok((meta.ino(), level))
}

/// Whether `pid` still runs (its /proc entry is there; a zombie's too).
pub fn is_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether `pid` is in the cgroup `dir` or one below it now (false once
/// it is gone).
pub fn contains(dir: &Path, pid: u32) -> bool {
    let path = of(pid);
    if path.is_empty() {
        return false;
    }
    mounts()
        .iter()
        .any(|m| m.join(path.trim_start_matches('/')).starts_with(dir))
}

/// The processes in the cgroup now (not those of the cgroups below it).
pub fn members(dir: &Path) -> Vec<u32> {
    let mut pids: Vec<u32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    pids.sort_unstable();
    pids
}

/// The processes in the cgroup and every cgroup below it.
pub fn members_below(dir: &Path) -> Vec<u32> {
    let mut pids = members(dir);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                pids.extend(members_below(&e.path()));
            }
        }
    }
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Whether a process of the cgroup (or of one below it) runs: its
/// `cgroup.events` says `populated 1`.
pub fn populated(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.events"))
        .map(|e| e.lines().any(|l| l == "populated 1"))
        .unwrap_or(false)
}

/// The cgroup v2 path of `pid` (`/proc/PID/cgroup`'s `0::` line), empty
/// when it has none.
pub fn of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_default()
        .to_string()
}
