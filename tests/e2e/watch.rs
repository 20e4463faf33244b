//! What a person sees while tracing, in a real terminal (tmux): the status
//! line on the terminal's last row, and `mtrace top`'s full-screen view,
//! whose `q` ends the trace with the usual report.

use std::{
    fs,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use crate::support::{fixtures::compile_c, mtrace_path, require, Profile};

/// A detached tmux session of `cols` x `rows` running `shell` (sh -c),
/// killed when dropped.
struct Tmux {
    name: String,
}

impl Tmux {
    fn start(name: &str, cols: u16, rows: u16, shell: &str) -> Tmux {
        let name = format!("{name}-{}", std::process::id());
        let status = Command::new("tmux")
            .args(["new-session", "-d", "-s", &name])
            .args(["-x", &cols.to_string(), "-y", &rows.to_string()])
            .arg(shell)
            .env("TERM", "xterm-256color")
            .status()
            .expect("running tmux (cargo xtask setup installs it)");
        assert!(status.success(), "tmux new-session failed");
        // The pane closes when the command ends; keep it for a last look.
        let _ = Command::new("tmux")
            .args(["set-option", "-t", &name, "remain-on-exit", "on"])
            .status();
        Tmux { name }
    }

    /// The pane's text, one line per row.
    fn capture(&self) -> String {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &self.name])
            .output()
            .expect("tmux capture-pane");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until the pane shows something `pred` accepts; returns it.
    fn wait_for(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let text = self.capture();
            if pred(&text) {
                return text;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the terminal never showed {what}:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn keys(&self, keys: &str) {
        let status = Command::new("tmux")
            .args(["send-keys", "-t", &self.name, keys])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.name])
            .status();
    }
}

fn need_tmux() -> bool {
    let found = Command::new("tmux").arg("-V").output().is_ok();
    require(found, "tmux")
}

/// tests/fixtures/steady.c, compiled once for the tests here.
fn steady() -> &'static Path {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        compile_c(
            "steady",
            "steady",
            &["-O2", "-fno-omit-frame-pointer", "-g"],
            &[],
        )
    })
}

/// `mtrace ARGS... > DIR/out; echo $? > DIR/exit`, standard error on the
/// terminal.
fn shell(dir: &Path, args: &str) -> String {
    format!(
        "{} {args} > {d}/out; echo $? > {d}/exit",
        mtrace_path().display(),
        d = dir.display()
    )
}

fn wait_exit(dir: &Path) -> i32 {
    let start = Instant::now();
    loop {
        if let Ok(s) = fs::read_to_string(dir.join("exit")) {
            if s.ends_with('\n') {
                return s.trim().parse().unwrap();
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "mtrace never ended"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The number before " calls" on the line starting with `prefix`.
fn calls_shown(text: &str, prefix: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.trim_start().starts_with(prefix))?;
    let before = &line[..line.find(" calls")?];
    before.rsplit(' ').next()?.replace(',', "").parse().ok()
}

#[test]
fn mtrace_top_shows_the_stacks_live_and_q_prints_the_report() {
    need_bpf!();
    if !need_tmux() {
        return;
    }
    let dir = crate::support::public_tempdir();
    let fixture = steady();
    let json = dir.path().join("top.json");
    let tmux = Tmux::start(
        "mtrace-top",
        140,
        40,
        &shell(
            dir.path(),
            &format!("top -o {} -- {} 30", json.display(), fixture.display()),
        ),
    );
    let first = tmux.wait_for("the fixture's stack", |t| {
        t.contains("malloc ← steady_site ← main") && calls_shown(t, "0:").is_some_and(|n| n > 0)
    });
    assert!(first.contains("mtrace top: pid "), "{first}");
    assert!(first.contains("no loss"), "{first}");
    let n1 = calls_shown(&first, "0:").unwrap();
    let later = tmux.wait_for("a rising call count", |t| {
        calls_shown(t, "0:").is_some_and(|n| n > n1)
    });
    // The selected stack, expanded.
    assert!(
        later
            .lines()
            .any(|l| l.trim_end() == "  steady_site (steady.c:16)"),
        "{later}"
    );
    tmux.keys("q");
    // The command runs on to its end (30 s): the report comes first.
    let report = tmux.wait_for("the report", |t| t.contains("tracing ended after"));
    assert!(report.contains("stopped from the live view"), "{report}");
    let start = Instant::now();
    let out = loop {
        let out = fs::read_to_string(dir.path().join("out")).unwrap_or_default();
        // The profile is written after the report is printed (renamed
        // into place whole).
        let done = out.contains("steady_site") && json.exists();
        if done || start.elapsed() > Duration::from_secs(20) {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(out.contains("steady_site"), "no report on stdout:\n{out}");
    let p = Profile::load(&json);
    let (calls, bytes) = p.site("malloc", "steady_site");
    assert!(
        calls >= n1,
        "{calls} calls in the profile, {n1} shown before"
    );
    assert_eq!(bytes, calls * 48);
}

/// `mtrace top --all`: who allocates on the host, one row per process
/// with its most frequent stack; a process the test starts elsewhere
/// shows under its name and pid; `p` turns to one row per stack; `q`
/// ends with the report, whose profile counts the process as the
/// fixture itself counts its calls.
#[test]
fn mtrace_top_all_shows_who_allocates_on_the_host() {
    if !crate::support::require_bpf_alone() || !need_tmux() {
        return;
    }
    let dir = crate::support::public_tempdir();
    let json = dir.path().join("top.json");
    let tmux = Tmux::start(
        "mtrace-top-all",
        160,
        40,
        &shell(dir.path(), &format!("top --all -o {}", json.display())),
    );
    tmux.wait_for("the host view", |t| t.contains("processes, by calls"));
    // As fast as it can: on top of the view by rate whatever else the
    // host runs (each call takes a trap: about a million a second).
    let fixture = std::process::Command::new(steady())
        .args(["4", "0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = fixture.id();
    let row = format!("[steady ({pid})] malloc ← steady_site");
    let shown = tmux.wait_for("the fixture's row", |t| t.contains(&row));
    assert!(shown.contains("mtrace top --all"), "{shown}");
    tmux.keys("p");
    tmux.wait_for("rows per stack", |t| t.contains("stacks, by calls"));
    let out = fixture.wait_with_output().unwrap();
    assert!(out.status.success());
    let made: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .strip_prefix("calls=")
        .and_then(|n| n.parse().ok())
        .expect("the fixture's calls=N");
    tmux.keys("q");
    let report = tmux.wait_for("the report", |t| t.contains("tracing ended after"));
    assert!(report.contains("stopped from the live view"), "{report}");
    assert_eq!(wait_exit(dir.path()), 0);
    let start = Instant::now();
    while !json.exists() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let p = Profile::load(&json);
    assert_eq!(p.doc["meta"]["scope"], "host");
    let counted: u64 = p
        .allocs()
        .filter(|s| s.process.as_ref().is_some_and(|r| r.pid == pid))
        .filter(|s| s.function == "malloc" && s.caller() == Some("steady_site"))
        .map(|s| s.calls)
        .sum();
    assert_eq!(counted, made, "steady_site's mallocs in pid {pid}");
}

/// The target exits while the live view shows it: the last state stays
/// on the screen, saying so, until q; then the report.
#[test]
fn mtrace_top_keeps_the_last_state_after_the_target_exits() {
    need_bpf!();
    if !need_tmux() {
        return;
    }
    top_keeps_the_last_state("mtrace-top-end", "top --");
}

/// The same on the host engine (`top --file-wide -- CMD`): the view names
/// the command, not the host, and the command's output goes to a log.
#[test]
fn mtrace_top_file_wide_keeps_the_last_state_after_the_command_exits() {
    if !crate::support::require_bpf_alone() || !need_tmux() {
        return;
    }
    let view = top_keeps_the_last_state("mtrace-top-end-fw", "top --file-wide --");
    assert!(
        view.contains("(steady, --file-wide), count mode") && !view.contains("--all"),
        "{view}"
    );
}

/// `mtrace ARGS STEADY 2` in tmux, run until its end shows and q is
/// pressed: the view at its end.
fn top_keeps_the_last_state(session: &str, args: &str) -> String {
    let dir = crate::support::public_tempdir();
    let fixture = steady();
    let tmux = Tmux::start(
        session,
        140,
        40,
        // Two seconds: at least one of the view's ticks before the exit,
        // however loaded the machine.
        &shell(dir.path(), &format!("{args} {} 2", fixture.display())),
    );
    let ended = tmux.wait_for("the end of tracing, on the view", |t| {
        t.contains("tracing ended (the target exited), q for the report")
    });
    assert!(ended.contains("malloc ← steady_site ← main"), "{ended}");
    // Still there a moment later: nothing takes it away but q.
    std::thread::sleep(Duration::from_millis(1500));
    let still = tmux.capture();
    assert!(
        still.contains("tracing ended (the target exited), q for the report"),
        "{still}"
    );
    tmux.keys("q");
    let report = tmux.wait_for("the report", |t| t.contains("tracing ended after"));
    assert!(report.contains(": the target exited"), "{report}");
    assert_eq!(wait_exit(dir.path()), 0);
    ended
}

#[test]
fn the_status_line_counts_on_the_last_row_and_goes_away() {
    need_bpf!();
    if !need_tmux() {
        return;
    }
    let dir = crate::support::public_tempdir();
    let fixture = steady();
    let rows = 24;
    let tmux = Tmux::start(
        "mtrace-status",
        120,
        rows,
        &shell(dir.path(), &format!("-- {} 4", fixture.display())),
    );
    let last_row = |t: &str| t.lines().nth(rows as usize - 1).unwrap_or("").to_string();
    let first = tmux.wait_for("the status line", |t| {
        calls_shown(&last_row(t), "mtrace 0:").is_some_and(|n| n > 0)
    });
    let n1 = calls_shown(&last_row(&first), "mtrace 0:").unwrap();
    let later = tmux.wait_for("a rising count", |t| {
        calls_shown(&last_row(t), "mtrace 0:").is_some_and(|n| n > n1)
    });
    assert!(last_row(&later).contains("/s"), "{later}");
    assert_eq!(wait_exit(dir.path()), 0);
    let end = tmux.wait_for("the end", |t| t.contains("tracing ended after"));
    assert!(
        end.contains("the target exited"),
        "the end is explained\n{end}"
    );
    assert!(
        !end.contains("mtrace 0:"),
        "the status line stayed behind\n{end}"
    );
    let out = fs::read_to_string(dir.path().join("out")).unwrap();
    assert!(out.contains("steady_site"), "{out}");
}

/// `samesite.c`'s three calls of malloc in one function without line
/// information: the live view's three rows would read the same, and
/// show instead each call site's offset in `sites`, as the JSON gives it.
#[test]
fn mtrace_top_tells_apart_rows_alike_but_for_the_call_site() {
    need_bpf!();
    if !need_tmux() {
        return;
    }
    top_tells_apart_rows("", "mtrace-top-samesite");
}

/// The same on the host's engine (alone): a command's view opens on its
/// stacks, as by pid.
#[test]
fn mtrace_top_file_wide_opens_on_the_commands_stacks() {
    if !crate::support::require_bpf_alone() || !need_tmux() {
        return;
    }
    top_tells_apart_rows("--file-wide ", "mtrace-top-samesite-fw");
}

/// `mtrace top ENGINE-- samesite`'s rows, in tmux session `session`.
fn top_tells_apart_rows(engine: &str, session: &str) {
    let dir = crate::support::public_tempdir();
    let fixture = compile_c("samesite", "samesite", &["-O1"], &[]);
    let json = dir.path().join("top.json");
    let tmux = Tmux::start(
        session,
        140,
        40,
        // Three seconds asleep after the allocations: the view shows them.
        &shell(
            dir.path(),
            &format!(
                "top {engine}-o {} -- {} 3",
                json.display(),
                fixture.display()
            ),
        ),
    );
    let shown = tmux.wait_for("three rows under sites", |t| {
        t.matches("malloc ← sites+0x").count() == 3
    });
    tmux.keys("q");
    assert_eq!(wait_exit(dir.path()), 0);
    let p = Profile::load(&json);
    let stacks = p.stacks_at("malloc", "sites");
    assert_eq!(stacks.len(), 3, "{shown}");
    for s in stacks {
        let o = s.frames[0].symbol_offset.expect("no symbol offset");
        let row = format!("malloc ← sites+{o:#x} [samesite] ← main");
        assert!(shown.contains(&row), "no {row}\n{shown}");
    }
}
