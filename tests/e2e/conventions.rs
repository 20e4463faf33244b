//! The conventions of a Linux tool: man pages that `man` renders, bash
//! completions that complete, and `--user` (launch mode runs the command
//! as another user while mtrace stays root). Only the `--user` trace needs
//! BPF.

use std::{
    fs,
    io::Write,
    path::Path,
    process::{Command, Output, Stdio},
};

use crate::support::{
    copy_executable, mtrace::mtrace_command, names_in, public_tempdir, require, run_mtrace,
    Fixture, Mtrace, Profile, LINE_TIMEOUT,
};

/// `mtrace generate ARGS DIR`, which must succeed; the files it wrote,
/// sorted.
fn generate(args: &[&str], dir: &Path) -> Vec<String> {
    let mut all: Vec<&str> = vec!["generate"];
    all.extend_from_slice(args);
    all.push(dir.to_str().unwrap());
    let out = run_mtrace(&all);
    out.assert_exit(0);
    names_in(dir)
}

fn has(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `man -l PAGE` as a terminal 80 columns wide would show it, without
/// formatting; groff's warnings on stderr.
fn render_man(page: &Path) -> Output {
    Command::new("man")
        .args(["--warnings", "-l"])
        .arg(page)
        .env("MANWIDTH", "80")
        .env("MANPAGER", "cat")
        .env("LC_ALL", "C.UTF-8")
        .output()
        .unwrap()
}

#[test]
fn man_pages_render() {
    if !require(has("man"), "`man` (man-db) renders the man pages") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        generate(&["man"], dir.path()),
        [
            "mtrace-agent.1",
            "mtrace-diff.1",
            "mtrace-report.1",
            "mtrace-top.1",
            "mtrace.1"
        ]
    );
    for (page, expected) in [
        (
            "mtrace.1",
            &[
                "mtrace - an out-of-process malloc tracer on eBPF",
                "--live",
                "--user <USER>",
                "sudo mtrace --pid 1234",
                "127    The command of launch mode is not found.",
                "mtrace-report(1), mtrace-diff(1), mtrace-top(1), mtrace-agent(1)",
            ][..],
        ),
        (
            "mtrace-report.1",
            &["--top <N>", "mtrace report run.json --top 5 --sort bytes"][..],
        ),
        (
            "mtrace-top.1",
            &[
                "--pid <PID>",
                "sudo mtrace top --live --pid 1234",
                "q quit (then the report)",
            ][..],
        ),
        (
            "mtrace-agent.1",
            &[
                "--listen <ADDR:PORT>",
                "go tool pprof -seconds 30 http://127.0.0.1:7117/debug/pprof/allocs",
            ][..],
        ),
        (
            "mtrace-diff.1",
            &[
                "--fail-if <COND>",
                "1      A --fail-if condition holds: a regression.",
            ][..],
        ),
    ] {
        let out = render_man(&dir.path().join(page));
        let text = String::from_utf8_lossy(&out.stdout);
        let warnings = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && warnings.is_empty(),
            "man -l {page}: {}\n{warnings}",
            out.status
        );
        let headings: Vec<&str> = text
            .lines()
            .filter(|l| l.chars().next().is_some_and(|c| c.is_ascii_uppercase()))
            .collect();
        for section in ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "EXAMPLES"] {
            assert!(headings.contains(&section), "{page}: no {section}\n{text}");
        }
        assert!(headings.contains(&"EXIT STATUS"), "{page}\n{text}");
        for needle in expected {
            assert!(text.contains(needle), "{page}: no {needle:?}\n{text}");
        }
        // Hidden options and the hidden `generate` stay hidden.
        assert!(!text.contains("--bench-floor") && !text.contains("generate"));
        let wide: Vec<&str> = text.lines().filter(|l| l.chars().count() > 80).collect();
        assert!(wide.is_empty(), "{page}: lines over 80 columns: {wide:#?}");
    }
}

/// What bash's completion of `mtrace` offers for `line` (the last word
/// being completed), with the script mtrace generated.
fn bash_complete(script: &Path, line: &str) -> Vec<String> {
    let out = Command::new("bash")
        .args(["--norc", "--noprofile", "-c"])
        .arg(
            r#"source "$1" || exit 9
complete -p mtrace || exit 8
read -ra COMP_WORDS <<< "$2"
[[ "$2" == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
COMP_LINE="$2"; COMP_POINT=${#COMP_LINE}
_mtrace mtrace "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}""#,
        )
        .arg("bash")
        .arg(script)
        .arg(line)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bash: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = stdout.lines();
    // `complete -p mtrace` prints how mtrace is completed.
    let spec = lines.next().unwrap_or_default();
    assert!(
        spec.starts_with("complete ") && spec.contains("-F _mtrace") && spec.ends_with(" mtrace"),
        "{spec}"
    );
    let mut words: Vec<String> = lines
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    words.sort();
    words
}

#[test]
fn bash_completions_complete() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        generate(&["completions", "bash"], dir.path()),
        ["mtrace.bash"]
    );
    let script = dir.path().join("mtrace.bash");
    assert_eq!(
        bash_complete(&script, "mtrace --li"),
        ["--live", "--live-map-size"]
    );
    assert_eq!(bash_complete(&script, "mtrace --us"), ["--user"]);
    assert_eq!(bash_complete(&script, "mtrace rep"), ["report"]);
    assert_eq!(bash_complete(&script, "mtrace diff --fa"), ["--fail-if"]);
    assert_eq!(bash_complete(&script, "mtrace --sort "), ["bytes", "calls"]);
    // Hidden options and subcommands are not offered.
    assert_eq!(bash_complete(&script, "mtrace --b"), Vec::<String>::new());
    assert_eq!(bash_complete(&script, "mtrace gen"), Vec::<String>::new());
    // zsh and fish are not installed here: their scripts are only read.
    // Both complete --user with user names.
    for (shell, file, user) in [
        ("zsh", "_mtrace", ["--user=[Launch mode", "USER:_users"]),
        (
            "fish",
            "mtrace.fish",
            ["-l user -d 'Launch mode", "(__fish_complete_users)"],
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(generate(&["completions", shell], dir.path()), [file]);
        let script = fs::read_to_string(dir.path().join(file)).unwrap();
        for needle in user {
            assert!(script.contains(needle), "{shell}: no {needle}\n{script}");
        }
        assert!(!script.contains("bench-floor"), "{shell}\n{script}");
    }
}

#[test]
fn generate_errors_are_one_line() {
    let out = run_mtrace(&["generate", "man", "/nonexistent/dir"]);
    out.assert_exit(2);
    out.assert_error("cannot write /nonexistent/dir/mtrace.1: no such directory");
    let out = run_mtrace(&["generate", "completions", "tcsh", "/tmp"]);
    out.assert_exit(2);
}

#[test]
fn user_is_checked_before_tracing() {
    // No BPF needed: both are usage errors found before anything starts.
    let out = run_mtrace(&["--user", "no-such-user-mtrace", "--", "true"]);
    out.assert_exit(2);
    out.assert_error("--user no-such-user-mtrace: no such user");
    let out = run_mtrace(&["--user", "nobody", "--pid", "1"]);
    out.assert_exit(2);
    assert!(
        out.stderr[0].starts_with("mtrace: the argument '--user <USER>' cannot be used with"),
        "{}",
        out.describe()
    );
}

/// A field of `getent passwd USER` (0: name, 2: uid, 3: gid, 5: home).
fn passwd_field(user: &str, field: usize) -> String {
    let out = Command::new("getent")
        .args(["passwd", user])
        .output()
        .unwrap();
    let line = String::from_utf8(out.stdout).unwrap();
    line.trim().split(':').nth(field).unwrap().to_string()
}

#[test]
fn user_runs_the_command_as_that_user() {
    need_bpf!();
    let user = "nobody";
    let (uid, gid, home) = (
        passwd_field(user, 2),
        passwd_field(user, 3),
        passwd_field(user, 5),
    );
    // Supplementary groups, as `id -G` finds them (initgroups).
    let id = Command::new("id").args(["-G", user]).output().unwrap();
    let mut groups: Vec<String> = String::from_utf8(id.stdout)
        .unwrap()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    groups.sort();
    // Where `nobody` can run the fixture and mtrace can write.
    let dir = public_tempdir();
    let counts = copy_executable(Fixture::Counts.path(), dir.path(), "counts");
    let profile = dir.path().join("p.json");
    let mut cmd = mtrace_command(&[
        "--user",
        user,
        "-o",
        profile.to_str().unwrap(),
        "--",
        counts.to_str().unwrap(),
        "--wait",
    ]);
    // The fixture reads its go-ahead from mtrace's stdin.
    cmd.stdin(Stdio::piped());
    let mut m = Mtrace::spawn(&mut cmd);
    let mut go = m.proc.take_stdin();
    let pid = m.wait_tracing();
    m.stdout.wait_for(|l| l == "ready", LINE_TIMEOUT);

    // While it waits: its credentials and environment.
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> Vec<String> {
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in\n{status}"));
        line.split_whitespace().map(str::to_string).collect()
    };
    // Real, effective, saved and filesystem ids.
    assert_eq!(field("Uid:"), [uid.as_str(); 4], "{status}");
    assert_eq!(field("Gid:"), [gid.as_str(); 4], "{status}");
    let mut got_groups = field("Groups:");
    got_groups.sort();
    assert_eq!(got_groups, groups, "{status}");
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap();
    let environ: Vec<String> = environ
        .split(|b| *b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    for expected in [
        format!("HOME={home}"),
        format!("USER={user}"),
        format!("LOGNAME={user}"),
    ] {
        assert!(environ.contains(&expected), "{expected} not in {environ:?}");
    }

    go.write_all(b"g").unwrap();
    go.flush().unwrap();
    let out = m.finish();
    out.assert_exit(0);
    assert!(
        out.stdout.lines().any(|l| l == "done"),
        "{}",
        out.describe()
    );
    let p = Profile::load(&profile);
    assert_eq!(p.pid(), pid);
    crate::support::counts::check_counts_profile(&p);
}

/// `--max-processes` bounds the per-process engine's objects; the host
/// engine has none, and says so rather than take the limit silently.
#[test]
fn max_processes_is_refused_on_the_host_engine() {
    for engine in ["--file-wide", "--all"] {
        let mut args = vec![engine, "--max-processes", "3"];
        if engine == "--file-wide" {
            args.extend(["--", "true"]);
        }
        let out = run_mtrace(&args);
        out.assert_exit(2);
        assert!(
            out.stderr[0].starts_with("mtrace: the argument '")
                && out.stderr[0].contains("cannot be used with")
                && out.stderr[0].contains("--max-processes"),
            "{}",
            out.describe()
        );
    }
}
