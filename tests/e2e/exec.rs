//! Launch mode across `exec`: each program the command becomes is probed
//! in its own allocator, found anew in its own link map, and symbolized
//! with its own mappings; the profile joins them.

use crate::{
    support::counts::assert_counts_sites,
    support::fixtures::JEMALLOC,
    support::live::check_live_fixture,
    support::mtrace::trace_through_env,
    support::{trace_by_pid, Fixture, FixtureProc, Profile},
};

/// Every site of the counts fixture exact, and the family named.
fn check_counts_sites_and_family(p: &Profile, d: &str, family: &str) {
    assert_counts_sites(p, d);
    assert_eq!(p.doc["meta"]["allocator_family"], family, "{d}");
}

/// The case of issue 11: `env` runs on glibc, the program it execs on a
/// preloaded jemalloc. Every call of the program is counted, under its
/// own stacks, and the profile names jemalloc.
#[test]
fn exec_into_a_preloaded_allocator_probes_the_new_program() {
    need_bpf!();
    let preload = format!("LD_PRELOAD={JEMALLOC}");
    let (out, p) = trace_through_env(&[], &[&preload], Fixture::Counts);
    let d = out.describe();
    check_counts_sites_and_family(&p, &d, "jemalloc");
    assert_eq!(p.doc["meta"]["allocator_object"], JEMALLOC, "{d}");
    assert_eq!(
        p.doc["meta"]["executable"],
        Fixture::Counts.path_str(),
        "{d}"
    );
    // env's own calls (glibc, before the exec) are in the profile too.
    assert!(
        p.allocs().any(|s| s
            .frames
            .iter()
            .any(|f| f.module.as_deref().is_some_and(|m| m.ends_with("/env")))),
        "no stack of env\n{}",
        p.dump()
    );
}

/// The same on the host engine (`--file-wide`): the root's exec is said
/// (it was not), every call of the program counted at its sites,
/// jemalloc named among the allocators called, and the program the
/// profile's executable (it was empty).
#[test]
fn exec_into_a_preloaded_allocator_is_said_and_counted_file_wide() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let preload = format!("LD_PRELOAD={JEMALLOC}");
    let (out, p) = trace_through_env(&["--file-wide"], &[&preload], Fixture::Counts);
    let d = out.describe();
    assert_counts_sites(&p, &d);
    let family = p.doc["meta"]["allocator_family"].as_str().unwrap_or("");
    assert!(family.starts_with("jemalloc"), "{family}\n{d}");
    assert_eq!(
        p.doc["meta"]["executable"],
        Fixture::Counts.path_str(),
        "{d}"
    );
}

/// Live mode across an exec: the program's blocks are followed exactly,
/// and the peak is the program's (env's heap went with its image).
#[test]
fn live_mode_follows_the_exec() {
    need_bpf!();
    let (out, p) = trace_through_env(
        &["--live", "--temporary-under", "100ms"],
        &["MTRACE_TEST=1"],
        Fixture::Live,
    );
    check_live_fixture(&p, &out);
}

/// By pid: a shell that execs the counts fixture once mtrace is attached.
/// The exec is followed (the process is held there until the fixture's
/// allocator is probed): every call of the fixture is counted.
#[test]
fn exec_by_pid_is_followed() {
    need_bpf!();
    let script = r#"echo ready; head -c 1 >/dev/null; exec "$0""#;
    let mut sh = FixtureProc::start(
        std::path::Path::new("/bin/sh"),
        &["-c", script, Fixture::Counts.path_str()],
    );
    let (out, p) = trace_by_pid(&mut sh, &["--top", "0"]);
    let d = out.describe();
    let exec_line = format!("exec'd {}:", Fixture::Counts.path_str());
    assert!(
        out.stderr.iter().any(|l| l.contains(&exec_line)),
        "no `{exec_line}`\n{d}"
    );
    check_counts_sites_and_family(&p, &d, "glibc");
}
