//! Outputs safe for root, and checked: a symbolic link planted at an
//! output path is replaced, never followed; a failed write (`/dev/full`,
//! stdout included) is one line with exit code 74 and no "wrote"; a bad
//! output path is refused before tracing starts; under sudo the files are
//! the invoking user's.

use std::{
    fs,
    os::unix::fs::{MetadataExt, PermissionsExt},
    process::{Command, Stdio},
};

use crate::support::{mtrace::trace_counts, mtrace_path, run_mtrace, s, Fixture};

/// Every option that writes a file of the profile.
const OUTPUT_FLAGS: [&str; 6] = [
    "-o",
    "--folded",
    "--flamegraph",
    "--pprof",
    "--speedscope",
    "--html",
];

/// A profile to re-render (one real trace).
fn profile_in(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("base.json");
    trace_counts(Fixture::Counts, &["-o", s(&path)]);
    path
}

#[test]
fn a_planted_symlink_is_replaced_never_followed() {
    let dir = bpf_tempdir!();
    let base = profile_in(dir.path());
    let victim = dir.path().join("victim");
    fs::write(&victim, "precious\n").unwrap();
    for flag in OUTPUT_FLAGS {
        let out_path = dir.path().join(format!("out{flag}"));
        std::os::unix::fs::symlink(&victim, &out_path).unwrap();
        let out = run_mtrace(&["report", s(&base), "--top", "1", flag, s(&out_path)]);
        out.assert_exit(0);
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious\n", "{flag}");
        let meta = fs::symlink_metadata(&out_path).unwrap();
        assert!(meta.file_type().is_file(), "{flag}: not a regular file");
        assert!(meta.len() > 0, "{flag}");
    }
    // No temporary is left behind.
    let left: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn failed_writes_are_one_line_exit_74_and_never_said_written() {
    let dir = bpf_tempdir!();
    let base = profile_in(dir.path());
    for flag in OUTPUT_FLAGS {
        let out = run_mtrace(&["report", s(&base), "--top", "1", flag, "/dev/full"]);
        out.assert_exit(74);
        // The table went to stdout; stderr has the one error line.
        let lines: Vec<&String> = out.stderr.iter().filter(|l| !l.is_empty()).collect();
        assert!(
            lines.len() == 1 && lines[0].starts_with("mtrace: cannot write /dev/full"),
            "{flag}\n{}",
            out.describe()
        );
    }
    // The report itself, on a full stdout.
    let full = fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let status = Command::new(mtrace_path())
        .args(["report", s(&base)])
        .stdout(Stdio::from(full))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(status.status.code(), Some(74));
    let stderr = String::from_utf8_lossy(&status.stderr);
    let one_line = stderr.lines().count() == 1;
    assert!(
        one_line && stderr.starts_with("mtrace: cannot write the report to stdout"),
        "{stderr}"
    );
}

/// A missing directory, a directory as a file, a missing snapshot
/// directory: refused at once (exit 2), not after the trace.
#[test]
fn a_bad_output_path_is_refused_before_tracing() {
    let dir = bpf_tempdir!();
    let (missing, nope) = (
        dir.path().join("no-such-dir/run.json"),
        dir.path().join("nope"),
    );
    let cases = [
        (["-o", s(&missing)], "no such directory"),
        (["--folded", s(dir.path())], "it is a directory"),
        (["--html", s(&missing)], "no such directory"),
        (["--snapshot-dir", s(&nope)], "cannot write snapshots"),
    ];
    for (args, needle) in cases {
        let started = std::time::Instant::now();
        let mut all = args.to_vec();
        all.extend(["--", Fixture::Longrun.path_str()]);
        let out = run_mtrace(&all);
        out.assert_exit(2);
        out.assert_error(needle);
        assert!(started.elapsed().as_secs() < 5, "{:?}", started.elapsed());
    }
}

#[test]
fn under_sudo_the_files_are_the_invoking_users() {
    let dir = bpf_tempdir!();
    let base = profile_in(dir.path());
    let out_path = dir.path().join("mine.json");
    let status = Command::new(mtrace_path())
        .args(["report", s(&base), "--top", "1", "-o", s(&out_path)])
        .env("SUDO_UID", "65534")
        .env("SUDO_GID", "65534")
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let meta = fs::metadata(&out_path).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (65534, 65534));
    assert_eq!(meta.permissions().mode() & 0o777, 0o644);
}
