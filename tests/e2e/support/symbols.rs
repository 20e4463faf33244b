//! Stripped programs and their debug information, for the tests of
//! naming by build id (tests/e2e/symbols/): the program built and
//! stripped, traced, a real debuginfod server on loopback serving its
//! debug file, the file placed in `/usr/lib/debug/.build-id`.

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use super::{
    mtrace::{mtrace_command, Finished},
    profile::Stack,
    Mtrace, Profile,
};

/// A C program allocating 100 times at `alpha_site`, built with debug
/// information and a build id, in `dir`: the stripped program, its split
/// debug file, and the build id (hex).
pub(crate) fn stripped(dir: &Path) -> (PathBuf, PathBuf, String) {
    let (full, strip, debug, id) = built(dir);
    std::fs::remove_file(&full).unwrap();
    (strip, debug, id)
}

/// [`stripped`]'s program, and the program as it was built (with its
/// symbols and debug information) first.
pub(crate) fn built(dir: &Path) -> (PathBuf, PathBuf, PathBuf, String) {
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
    let notes = Command::new("readelf")
        .arg("-n")
        .arg(&strip)
        .output()
        .unwrap();
    let id = String::from_utf8_lossy(&notes.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: ").map(str::to_string))
        .expect("a build id");
    (full, strip, debug, id)
}

/// Traces `program` with `args` and `env`; the profile.
pub(crate) fn trace(
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    dir: &Path,
) -> (String, Profile) {
    let (out, p) = trace_out(program, args, env, dir);
    (out.describe(), p)
}

/// [`trace`], with what mtrace printed.
pub(crate) fn trace_out(
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    dir: &Path,
) -> (Finished, Profile) {
    trace_to(
        program,
        args,
        env,
        &dir.join(format!("p{}.json", rand_suffix())),
    )
}

/// [`trace_out`], the profile written to `out_path`.
pub(crate) fn trace_to(
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    out_path: &Path,
) -> (Finished, Profile) {
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
    let p = Profile::load(out_path);
    (out, p)
}

pub(crate) fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// The caller of the allocations (the frame under malloc).
pub(crate) fn caller(p: &Profile) -> String {
    p.stacks
        .iter()
        .find(|s| s.function == "malloc" && s.calls == 100)
        .and_then(|s| s.frames.first())
        .map(|f| f.function.clone())
        .unwrap_or_default()
}

pub(crate) fn symbols(p: &Profile, key: &str) -> u64 {
    p.doc["stack_quality"]["symbols"][key].as_u64().unwrap_or(0)
}

/// A debuginfod server on loopback serving `dir`, stopped when dropped.
pub(crate) struct Debuginfod {
    pub(crate) child: std::process::Child,
    pub(crate) url: String,
}

impl Drop for Debuginfod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `debuginfod -F` on `dir` and waits until it serves `id`.
pub(crate) fn debuginfod(dir: &Path, id: &str, db: &Path) -> Debuginfod {
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

/// A file taken out again when dropped.
pub(crate) struct Removed(pub(crate) PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `debug` copied into `/usr/lib/debug/.build-id` as the debug file of
/// build id `id`, as Debian's -dbgsym packages install them.
pub(crate) fn in_build_id_tree(debug: &Path, id: &str) -> Removed {
    let tree = Path::new("/usr/lib/debug/.build-id").join(&id[..2]);
    std::fs::create_dir_all(&tree).unwrap();
    let placed = tree.join(format!("{}.debug", &id[2..]));
    std::fs::copy(debug, &placed).unwrap();
    Removed(placed)
}

/// The stack of the fixture's 100 allocations.
pub(crate) fn hundred(p: &Profile) -> &Stack {
    p.stacks
        .iter()
        .find(|s| s.function == "malloc" && s.calls == 100)
        .expect("the stack of the 100 allocations")
}

/// A frame as the report prints it: function, file and line.
pub(crate) type Named = (String, Option<String>, Option<u64>);

/// Each frame of the 100 allocations' stack as the report prints it:
/// function, file and line.
pub(crate) fn named(p: &Profile) -> Vec<Named> {
    hundred(p)
        .frames
        .iter()
        .map(|f| (f.function.clone(), f.file.clone(), f.line))
        .collect()
}
