//! Edge cases of the allocator API (tests/fixtures/edge.c, built without
//! frame pointers): pvalloc, free(NULL), a block glibc serves with mmap
//! grown by realloc; the source line and build id of a frame; a command
//! killed by a signal; SIGUSR1 without --interval.

use std::fs;

use crate::support::{
    fixtures::compile_c, run_profiled, FixtureProc, Mtrace, Profile, LINE_TIMEOUT,
};

/// edge.c built without frame pointers (once: the tests run in parallel).
fn edge() -> std::path::PathBuf {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| compile_c("edge", "edge", &["-O2", "-fomit-frame-pointer", "-g"], &[]))
        .clone()
}

/// The line of edge.c marked `LINE_SITE`.
fn line_site_line() -> u64 {
    let src = fs::read_to_string(crate::support::fixtures::fixtures_dir().join("edge.c")).unwrap();
    let i = src
        .lines()
        .position(|l| l.contains("/* LINE_SITE */"))
        .expect("edge.c marks LINE_SITE");
    i as u64 + 1
}

/// The GNU build id of an ELF file, in hex.
fn build_id(path: &std::path::Path) -> String {
    use object::Object;
    let data = fs::read(path).unwrap();
    let file = object::File::parse(&*data).unwrap();
    let id = file
        .build_id()
        .unwrap()
        .expect("the fixture has a build id");
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every site of edge.c, exact, in count mode with frees counted and in
/// live mode: pvalloc's requested bytes, free(NULL) counted as a call to
/// free (16 in all), the mmapped block and its realloc, nothing
/// outstanding, no free of an unknown block; line_site's frame carries its
/// source line and the executable's build id.
#[test]
fn pvalloc_free_null_and_an_mmapped_realloc_are_exact() {
    need_bpf!();
    let program = edge();
    let id = build_id(&program);
    for mode in ["--count-frees", "--live"] {
        let (out, p) = run_profiled(&[mode, "--top", "0", "--", program.to_str().unwrap()]);
        out.assert_exit(0);
        let d = out.describe();
        assert_eq!(p.site("pvalloc", "pvalloc_site"), (3, 300), "{mode}\n{d}");
        assert_eq!(
            p.site("malloc", "mmapped_site"),
            (1, 1 << 20),
            "{mode}\n{d}"
        );
        assert_eq!(
            p.site("realloc", "mmapped_site"),
            (1, 2 << 20),
            "{mode}\n{d}"
        );
        assert_eq!(p.site("malloc", "line_site"), (7, 168), "{mode}\n{d}");
        assert_eq!(p.total(), (12, 300 + (3 << 20) + 168), "{mode}\n{d}");
        // 3 + 1 + 7 blocks and 5 free(NULL).
        assert_eq!(p.calls_of("free"), Some(16), "{mode}\n{d}");
        for st in p.doc["stacks"].as_array().unwrap() {
            let f = &st["frames"][0];
            if f["function"] == "line_site" {
                assert_eq!(f["line"].as_u64(), Some(line_site_line()), "{f}");
                assert!(
                    f["file"]
                        .as_str()
                        .unwrap()
                        .ends_with("tests/fixtures/edge.c"),
                    "{f}"
                );
                assert_eq!(f["build_id"].as_str(), Some(id.as_str()), "{f}");
            }
        }
        if mode == "--live" {
            let live = &p.doc["live"];
            assert_eq!(live["outstanding"], 0, "{live}");
            assert_eq!(live["frees_unknown"], 0, "{live}");
            assert_eq!(live["tracked_allocations"], 12, "{live}");
            // The realloc frees the 1 MiB block as it makes the 2 MiB one.
            assert_eq!(live["peak_bytes"], 2 << 20, "{live}");
        }
    }
}

/// A command killed by signal N: mtrace reports, then exits 128+N, as a
/// shell would.
#[test]
fn a_command_killed_by_a_signal_exits_128_plus_its_number() {
    need_bpf!();
    let program = edge();
    let script = format!("{}; kill -TERM $$", program.display());
    let (out, p) = run_profiled(&["--top", "0", "--", "sh", "-c", &script]);
    out.assert_exit(128 + libc::SIGTERM);
    assert_eq!(
        p.site("malloc", "line_site"),
        (7, 168),
        "{}",
        out.describe()
    );
    assert_eq!(out.report().total_calls, p.total().0, "{}", out.describe());
}

/// SIGUSR1 writes a snapshot also when no --interval was given.
#[test]
fn sigusr1_without_interval_writes_a_snapshot() {
    need_bpf!();
    let program = edge();
    let snap_dir = tempfile::tempdir().unwrap();
    let mut fx = FixtureProc::start(&program, &["--wait"]);
    fx.wait_ready();
    let pid = fx.pid();
    let mut m = Mtrace::start(&[
        "--pid",
        &pid.to_string(),
        "--snapshot-dir",
        snap_dir.path().to_str().unwrap(),
    ]);
    assert_eq!(m.wait_tracing(), pid);
    fx.release();
    fx.stdout.wait_for(|l| l == "done", LINE_TIMEOUT);
    unsafe { libc::kill(m.proc.id() as i32, libc::SIGUSR1) };
    let line = m
        .stderr
        .wait_for(|l| l.starts_with("mtrace: wrote snapshot "), LINE_TIMEOUT);
    let path = line.rsplit(' ').next().unwrap();
    let snapshot = Profile::load(std::path::Path::new(path));
    assert_eq!(snapshot.site("malloc", "line_site"), (7, 168), "{line}");
    assert!(
        path.starts_with(snap_dir.path().to_str().unwrap()),
        "{line}"
    );
    // The target's exit ends the trace.
    drop(fx.stdin.take());
    m.finish().assert_exit(0);
}

/// By pid, a target whose executable exists only in its own mount
/// namespace (a tmpfs mounted there): mtrace reads it through
/// `/proc/PID/root`, unwinds and symbolizes it to the source line.
#[test]
fn a_target_in_another_mount_namespace() {
    need_bpf!();
    let program = edge();
    let dir = tempfile::tempdir().unwrap();
    let inside = dir.path().join("edge-ns");
    let script = format!(
        "mount -t tmpfs none {d} && cp {p} {i} && exec {i} --wait",
        d = dir.path().display(),
        p = program.display(),
        i = inside.display()
    );
    let mut fx = FixtureProc::start(
        std::path::Path::new("unshare"),
        &["-m", "sh", "-c", &script],
    );
    fx.wait_ready();
    assert!(
        !inside.exists(),
        "the tmpfs is visible outside its namespace"
    );
    let pid = fx.pid();
    let json = dir.path().join("ns.json");
    let mut m = Mtrace::start(&["--pid", &pid.to_string(), "-o", json.to_str().unwrap()]);
    assert_eq!(m.wait_tracing(), pid);
    fx.release();
    fx.stdout.wait_for(|l| l == "done", LINE_TIMEOUT);
    drop(fx.stdin.take());
    let out = m.finish();
    out.assert_exit(0);
    let p = Profile::load(&json);
    let d = out.describe();
    assert_eq!(p.doc["meta"]["executable"], inside.to_str().unwrap(), "{d}");
    assert_eq!(p.site("malloc", "line_site"), (7, 168), "{d}");
    assert_eq!(p.site("pvalloc", "pvalloc_site"), (3, 300), "{d}");
    for st in p.stacks_at("malloc", "line_site") {
        assert_eq!(st.frames[0].line, Some(line_site_line()), "{d}");
        assert_eq!(st.names().last().copied(), Some("_start"), "{d}");
    }
}
