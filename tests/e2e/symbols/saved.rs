//! A profile saved where no debug information could be reached, its
//! stripped program's frames left as offsets (`s_strip+0x1155`), named
//! by `mtrace report` where it can be: from a real debuginfod server on
//! loopback (the stripped program gone, as on another machine: only the
//! profile's build ids, file offsets and mappings place the frames), or
//! from `/usr/lib/debug/.build-id` (the program at hand).

use std::path::{Path, PathBuf};

use crate::support::{
    mtrace::Finished,
    require,
    symbols::{
        built, caller, debuginfod, hundred, in_build_id_tree, named, rand_suffix, symbols, trace,
        trace_to, Named, Removed,
    },
    Mtrace, Profile,
};

/// `mtrace report SAVED -o OUT` with `args` and `env`: what it printed
/// and the profile it wrote.
fn report(saved: &Path, args: &[&str], env: &[(&str, &str)]) -> (Finished, Profile) {
    let out = saved.with_extension(format!("r{}.json", rand_suffix()));
    let mut all = vec![
        "report",
        saved.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ];
    all.extend(args);
    let mut cmd = crate::support::mtrace::mtrace_command(&all);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let done = Mtrace::spawn(&mut cmd).finish();
    done.assert_exit(0);
    (done, Profile::load(&out))
}

/// What [`saved_unnamed`] made.
struct Saved {
    /// The unstripped build's frames.
    want: Vec<Named>,
    strip: PathBuf,
    debug: PathBuf,
    id: String,
    /// The stripped build's profile.
    profile: PathBuf,
}

/// The unstripped build's frames, and a profile of the stripped build
/// saved with no debug information reachable (no server, an empty
/// cache): its own frames offsets, the build id missing.
fn saved_unnamed(dir: &Path, cache: &str) -> Saved {
    let (full, strip, debug, id) = built(dir);
    let (d, p) = trace(&full, &["--no-debuginfod"], &[], dir);
    let want = named(&p);
    assert_eq!(
        want[..2]
            .iter()
            .map(|(f, _, l)| (f.as_str(), *l))
            .collect::<Vec<_>>(),
        [("alpha_site", Some(2)), ("main", Some(3))],
        "{d}"
    );
    let saved = dir.join("saved.json");
    let (out, p) = trace_to(
        &strip,
        &["--no-debuginfod"],
        &[("DEBUGINFOD_CACHE_PATH", cache)],
        &saved,
    );
    let d = out.describe();
    assert!(caller(&p).starts_with("s_strip+0x"), "{d}");
    assert_eq!(symbols(&p, "not_on_servers"), 1, "{d}");
    Saved {
        want,
        strip,
        debug,
        id,
        profile: saved,
    }
}

/// Fetched at report time from a server the trace could not reach: every
/// frame named with file and line as the unstripped build's trace names
/// it, the 100 calls on one row under `alpha_site`, the fetch counted;
/// with `--no-debuginfod` no server is asked and the build id is counted
/// as missing.
#[test]
fn a_saved_profile_is_named_through_debuginfod_when_reported() {
    let dir = bpf_tempdir!();
    if !require(
        Path::new("/usr/bin/debuginfod").exists(),
        "debuginfod is missing (cargo xtask setup installs it)",
    ) {
        return;
    }
    let cache = dir.path().join("cache");
    let cache_s = cache.to_str().unwrap().to_string();
    let Saved {
        want,
        strip,
        debug,
        id,
        profile: saved,
    } = saved_unnamed(dir.path(), &cache_s);
    // Reported elsewhere: the stripped program is not there.
    std::fs::remove_file(&strip).unwrap();
    let served = dir.path().join("served");
    std::fs::create_dir(&served).unwrap();
    std::fs::rename(&debug, served.join("s.debug")).unwrap();
    let server = debuginfod(&served, &id, &dir.path().join("db.sqlite"));
    let env = [
        ("DEBUGINFOD_URLS", server.url.as_str()),
        ("DEBUGINFOD_CACHE_PATH", cache_s.as_str()),
    ];

    let (out, p) = report(&saved, &["--no-debuginfod"], &env);
    let d = out.describe();
    assert!(caller(&p).starts_with("s_strip+0x"), "{d}");
    assert_eq!(symbols(&p, "not_on_servers"), 1, "{d}");
    assert!(!cache.join(&id).exists(), "{d}");

    let (out, p) = report(&saved, &[], &env);
    let d = out.describe();
    assert_eq!(named(&p), want, "{d}");
    assert_eq!((hundred(&p).calls, hundred(&p).bytes), (100, 1600), "{d}");
    assert_eq!(symbols(&p, "fetched"), 1, "{d}");
    assert_eq!(symbols(&p, "not_on_servers"), 0, "{d}");
    assert!(
        d.contains("symbols: stripped files 1, debug info found here 0, fetched 1, missing 0,"),
        "{d}"
    );
    let table = out.report();
    let row = table
        .rows
        .iter()
        .find(|r| r.caller() == Some("alpha_site"))
        .unwrap_or_else(|| panic!("no row under alpha_site\n{d}"));
    assert_eq!(row.calls, 100, "{d}");
    assert_eq!(row.frames.get(1).map(String::as_str), Some("main"), "{d}");
    assert!(cache.join(&id).join("debuginfo").is_file(), "{d}");
}

/// Found at report time in `/usr/lib/debug/.build-id`, where it was not
/// when the program was traced: named as the unstripped build's trace
/// names it, found here and counted so.
#[test]
fn a_saved_profile_is_named_from_the_build_id_tree_when_reported() {
    let dir = bpf_tempdir!();
    let cache = dir.path().join("cache");
    let Saved {
        want,
        debug,
        id,
        profile: saved,
        ..
    } = saved_unnamed(dir.path(), cache.to_str().unwrap());
    let _placed: Removed = in_build_id_tree(&debug, &id);
    let (out, p) = report(
        &saved,
        &["--no-debuginfod"],
        &[("DEBUGINFOD_CACHE_PATH", cache.to_str().unwrap())],
    );
    let d = out.describe();
    assert_eq!(named(&p), want, "{d}");
    assert_eq!(hundred(&p).calls, 100, "{d}");
    assert_eq!(symbols(&p, "local"), 1, "{d}");
    assert_eq!(symbols(&p, "not_on_servers"), 0, "{d}");
}

/// A server that accepts and never answers, at report time: the report
/// ends one timeout later (2 s here), the frames stay offsets, the build
/// id is counted as not fetched for a failed server, and the server is
/// said once.
#[test]
fn a_silent_server_costs_the_report_one_timeout_and_is_counted() {
    let dir = bpf_tempdir!();
    let cache = dir.path().join("cache");
    let Saved { profile: saved, .. } = saved_unnamed(dir.path(), cache.to_str().unwrap());
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let began = std::time::Instant::now();
    let (out, p) = report(
        &saved,
        &[],
        &[
            ("DEBUGINFOD_URLS", url.as_str()),
            ("DEBUGINFOD_CACHE_PATH", cache.to_str().unwrap()),
            ("DEBUGINFOD_TIMEOUT", "2"),
        ],
    );
    let took = began.elapsed();
    let d = out.describe();
    assert!(took < std::time::Duration::from_secs(10), "{took:?}\n{d}");
    assert!(caller(&p).starts_with("s_strip+0x"), "{d}");
    assert_eq!(symbols(&p, "not_fetched"), 1, "{d}");
    assert_eq!(d.matches("not asked again").count(), 1, "{d}");
    assert!(d.contains("symbols: of those for a failed server 1"), "{d}");
    drop(silent);
}
