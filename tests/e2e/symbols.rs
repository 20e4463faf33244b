//! Stripped programs named from their debug information, found by build
//! id: in `/usr/lib/debug/.build-id`, or fetched from a real debuginfod
//! server (Debian's `debuginfod -F`, serving a directory on loopback) into
//! the client's cache; a server that does not answer costs a timeout, once,
//! and is counted.

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use crate::support::{mtrace::mtrace_command, require, Mtrace, Profile};

/// A C program allocating 100 times at `alpha_site`, built with debug
/// information and a build id, in `dir`: the stripped program, its split
/// debug file, and the build id (hex).
fn stripped(dir: &Path) -> (PathBuf, PathBuf, String) {
    let src = dir.join("s.c");
    std::fs::write(
        &src,
        "#include <stdlib.h>\n\
         __attribute__((noinline)) void *alpha_site(int n) { return malloc(n); }\n\
         int main(void) { for (int i = 0; i < 100; i++) free(alpha_site(16)); return 0; }\n",
    )
    .unwrap();
    let full = dir.join("s_full");
    let run = |cmd: &mut Command| {
        let st = cmd.status().unwrap();
        assert!(st.success(), "{cmd:?}: {st}");
    };
    run(Command::new("gcc")
        .args([
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            "-Wl,--build-id=sha1",
            "-o",
        ])
        .arg(&full)
        .arg(&src));
    let debug = dir.join("s.debug");
    run(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(&full)
        .arg(&debug));
    let strip = dir.join("s_strip");
    run(Command::new("objcopy")
        .arg("--strip-all")
        .arg(&full)
        .arg(&strip));
    std::fs::remove_file(&full).unwrap();
    let notes = Command::new("readelf")
        .arg("-n")
        .arg(&strip)
        .output()
        .unwrap();
    let id = String::from_utf8_lossy(&notes.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: ").map(str::to_string))
        .expect("a build id");
    (strip, debug, id)
}

/// Traces `program` with `args` and `env`; the profile.
fn trace(program: &Path, args: &[&str], env: &[(&str, &str)], dir: &Path) -> (String, Profile) {
    let out_path = dir.join(format!("p{}.json", rand_suffix()));
    let mut all = vec!["-o", out_path.to_str().unwrap()];
    all.extend(args);
    all.extend(["--", program.to_str().unwrap()]);
    let mut cmd = mtrace_command(&all);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut m = Mtrace::spawn(&mut cmd);
    m.wait_tracing();
    let out = m.finish();
    out.assert_exit(0);
    (out.describe(), Profile::load(&out_path))
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// The caller of the allocations (the frame under malloc).
fn caller(p: &Profile) -> String {
    p.stacks
        .iter()
        .find(|s| s.function == "malloc" && s.calls == 100)
        .and_then(|s| s.frames.first())
        .map(|f| f.function.clone())
        .unwrap_or_default()
}

fn symbols(p: &Profile, key: &str) -> u64 {
    p.doc["stack_quality"]["symbols"][key].as_u64().unwrap_or(0)
}

/// A debuginfod server on loopback serving `dir`, stopped when dropped.
struct Debuginfod {
    child: std::process::Child,
    url: String,
}

impl Drop for Debuginfod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `debuginfod -F` on `dir` and waits until it serves `id`.
fn debuginfod(dir: &Path, id: &str, db: &Path) -> Debuginfod {
    let port = free_port();
    let child = Command::new("debuginfod")
        .args(["-F", "-p", &port.to_string(), "-d"])
        .arg(db)
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("debuginfod runs");
    let server = Debuginfod {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(2)))
        .build()
        .into();
    loop {
        let url = format!("{}/buildid/{id}/debuginfo", server.url);
        if agent
            .get(&url)
            .call()
            .is_ok_and(|r| r.status().as_u16() == 200)
        {
            return server;
        }
        assert!(Instant::now() < deadline, "debuginfod never served {id}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Stripped: its frames are offsets, and say so. Fetched from a real
/// debuginfod server: named with lines, the file kept in the cache, and
/// named from the cache with the server gone. With `--no-debuginfod`, no
/// server is asked.
#[test]
fn a_stripped_program_is_named_through_debuginfod() {
    let dir = bpf_tempdir!();
    if !require(
        Path::new("/usr/bin/debuginfod").exists(),
        "debuginfod is missing (cargo xtask setup installs it)",
    ) {
        return;
    }
    let (strip, debug, id) = stripped(dir.path());
    let served = dir.path().join("served");
    std::fs::create_dir(&served).unwrap();
    std::fs::rename(&debug, served.join("s.debug")).unwrap();
    let cache = dir.path().join("cache");
    let cache_s = cache.to_str().unwrap().to_string();
    let server = debuginfod(&served, &id, &dir.path().join("db.sqlite"));

    let (d, p) = trace(
        &strip,
        &["--no-debuginfod"],
        &[
            ("DEBUGINFOD_URLS", &server.url),
            ("DEBUGINFOD_CACHE_PATH", &cache_s),
        ],
        dir.path(),
    );
    assert!(caller(&p).starts_with("s_strip+0x"), "{d}");
    assert_eq!(symbols(&p, "not_on_servers"), 1, "{d}");
    assert!(
        d.contains("symbols: stripped files 1, debug info found here 0, fetched 0, missing 1,"),
        "{d}"
    );

    let (d, p) = trace(
        &strip,
        &[],
        &[
            ("DEBUGINFOD_URLS", &server.url),
            ("DEBUGINFOD_CACHE_PATH", &cache_s),
        ],
        dir.path(),
    );
    assert_eq!(caller(&p), "alpha_site", "{d}");
    let frame = &p.stacks.iter().find(|s| s.calls == 100).unwrap().frames[0];
    assert_eq!(frame.line, Some(2), "{d}");
    assert_eq!(symbols(&p, "fetched"), 1, "{d}");
    assert!(cache.join(&id).join("debuginfo").is_file(), "{d}");

    drop(server);
    let (d, p) = trace(
        &strip,
        &[],
        &[("DEBUGINFOD_CACHE_PATH", &cache_s)],
        dir.path(),
    );
    assert_eq!(caller(&p), "alpha_site", "{d}");
    assert_eq!(symbols(&p, "local"), 1, "{d}");
}

/// A server that accepts and never answers: the trace ends a timeout
/// later, the frames stay offsets, the build id is counted as not
/// fetched, and the server is said once.
#[test]
fn a_silent_debuginfod_server_costs_one_timeout_and_is_counted() {
    let dir = bpf_tempdir!();
    let (strip, _debug, _id) = stripped(dir.path());
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let cache = dir.path().join("cache");
    let began = Instant::now();
    let (d, p) = trace(
        &strip,
        &[],
        &[
            ("DEBUGINFOD_URLS", &url),
            ("DEBUGINFOD_CACHE_PATH", cache.to_str().unwrap()),
            ("DEBUGINFOD_TIMEOUT", "2"),
        ],
        dir.path(),
    );
    assert!(began.elapsed() < Duration::from_secs(20), "{d}");
    assert!(caller(&p).starts_with("s_strip+0x"), "{d}");
    assert_eq!(symbols(&p, "not_fetched"), 1, "{d}");
    assert_eq!(d.matches("not asked again").count(), 1, "{d}");
    drop(silent);
}

/// A debug file in `/usr/lib/debug/.build-id`, as Debian's -dbgsym
/// packages install them: found by the build id alone (the stripped file
/// has no debug link).
#[test]
fn a_stripped_program_is_named_from_the_build_id_tree() {
    let dir = bpf_tempdir!();
    let (strip, debug, id) = stripped(dir.path());
    let tree = Path::new("/usr/lib/debug/.build-id").join(&id[..2]);
    std::fs::create_dir_all(&tree).unwrap();
    let placed = tree.join(format!("{}.debug", &id[2..]));
    struct Removed(PathBuf);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    std::fs::copy(&debug, &placed).unwrap();
    let _placed = Removed(placed);
    let (d, p) = trace(&strip, &["--no-debuginfod"], &[], dir.path());
    assert_eq!(caller(&p), "alpha_site", "{d}");
    assert_eq!(symbols(&p, "local"), 1, "{d}");
}
