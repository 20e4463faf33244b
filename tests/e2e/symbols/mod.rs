//! Stripped programs named from their debug information, found by build
//! id: in `/usr/lib/debug/.build-id`, or fetched from a real debuginfod
//! server (Debian's `debuginfod -F`, serving a directory on loopback) into
//! the client's cache; a server that does not answer costs a timeout, once,
//! and is counted.

mod saved;

use std::{
    net::TcpListener,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use crate::support::symbols::{
    built, caller, debuginfod, hundred, in_build_id_tree, named, stripped, symbols, trace,
    trace_out,
};
use crate::support::{protoc::Pprof, require};

/// Stripped: its frames are offsets, and say so. Fetched from a real
/// debuginfod server: every frame named with file and line as the
/// unstripped build's trace names it, the file kept in the cache, and
/// named so from the cache with the server gone. With `--no-debuginfod`, no
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
    let (full, strip, debug, id) = built(dir.path());
    // What the unstripped build's trace names, frame for frame.
    let (d, p) = trace(&full, &["--no-debuginfod"], &[], dir.path());
    let want = named(&p);
    assert!(
        want.iter().any(|(f, _, l)| f == "main" && l.is_some()),
        "{d}"
    );
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
    assert_eq!(named(&p), want, "{d}");
    assert_eq!(symbols(&p, "fetched"), 1, "{d}");
    assert!(cache.join(&id).join("debuginfo").is_file(), "{d}");

    drop(server);
    let (d, p) = trace(
        &strip,
        &[],
        &[("DEBUGINFOD_CACHE_PATH", &cache_s)],
        dir.path(),
    );
    assert_eq!(named(&p), want, "{d}");
    assert_eq!(symbols(&p, "local"), 1, "{d}");
}

/// The host engine (`--file-wide`) names a stripped program's frames from
/// the same places, and counts them the same way: its debug file in the
/// build-id tree, then fetched from a real debuginfod server.
#[test]
fn the_host_engine_names_a_stripped_program_from_its_debug_file() {
    let dir = host_tempdir!();
    if !require(
        Path::new("/usr/bin/debuginfod").exists(),
        "debuginfod is missing (cargo xtask setup installs it)",
    ) {
        return;
    }
    let (strip, debug, id) = stripped(dir.path());
    {
        let _placed = in_build_id_tree(&debug, &id);
        let (d, p) = trace(&strip, &["--file-wide", "--no-debuginfod"], &[], dir.path());
        assert_eq!(caller(&p), "alpha_site", "{d}");
        assert_eq!(symbols(&p, "local"), 1, "{d}");
    }
    let served = dir.path().join("served");
    std::fs::create_dir(&served).unwrap();
    std::fs::rename(&debug, served.join("s.debug")).unwrap();
    let cache = dir.path().join("cache");
    let server = debuginfod(&served, &id, &dir.path().join("db.sqlite"));
    let (d, p) = trace(
        &strip,
        &["--file-wide"],
        &[
            ("DEBUGINFOD_URLS", &server.url),
            ("DEBUGINFOD_CACHE_PATH", cache.to_str().unwrap()),
        ],
        dir.path(),
    );
    assert_eq!(caller(&p), "alpha_site", "{d}");
    assert_eq!(symbols(&p, "fetched"), 1, "{d}");
    assert!(
        d.contains("symbols: stripped files 1, debug info found here 0, fetched 1, missing 0,"),
        "{d}"
    );
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
    let _placed = in_build_id_tree(&debug, &id);
    let (d, p) = trace(&strip, &["--no-debuginfod"], &[], dir.path());
    assert_eq!(caller(&p), "alpha_site", "{d}");
    assert_eq!(symbols(&p, "local"), 1, "{d}");
}

/// The loaded segments (`PT_LOAD`) of an ELF file as `readelf -lW` lists
/// them: (file offset, virtual address, size in the file).
fn loads(file: &Path) -> Vec<(u64, u64, u64)> {
    let out = Command::new("readelf")
        .arg("-lW")
        .arg(file)
        .output()
        .unwrap();
    assert!(out.status.success(), "readelf -lW {}", file.display());
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.first() == Some(&"LOAD")).then(|| (hex(f[1]), hex(f[2]), hex(f[4])))
        })
        .collect()
}

/// The function `addr2line -f` names at virtual address `vaddr` of `file`.
fn addr2line(file: &Path, vaddr: u64) -> String {
    let out = Command::new("addr2line")
        .arg("-f")
        .arg("-e")
        .arg(file)
        .arg(format!("{vaddr:#x}"))
        .output()
        .expect("addr2line runs");
    assert!(out.status.success(), "addr2line {vaddr:#x}");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().next().unwrap_or_default().to_string()
}

/// The pprof of a stripped program holds what a backend that symbolizes
/// by build id (Parca, Pyroscope) needs. Each location of a frame no
/// symbol named is in a mapping with the file's build id and the target's
/// own mapping of the file (bounds and file offset, those of the loaded
/// segment's pages), flagged as not symbolized; `address - memory_start +
/// file_offset` is the return address's offset in the file. That offset
/// becomes the virtual address it was loaded at through the `PT_LOAD`
/// header holding it (`vaddr = offset - p_offset + p_vaddr`, as a
/// symbolizer does, since addr2line takes virtual addresses), less one
/// (the call instruction, as mtrace and debuggers name a caller); there
/// addr2line, in the split debug file, names the function the trace of the
/// unstripped program names at that place of the stack.
#[test]
fn pprof_mappings_let_a_backend_name_a_stripped_program() {
    let dir = host_tempdir!();
    let (full, strip, debug, id) = built(dir.path());
    let (d, p) = trace(&full, &["--no-debuginfod"], &[], dir.path());
    // The unstripped stack's names, by machine address (an inlined frame
    // with the frame it was inlined into), as pprof's locations are.
    let mut places: Vec<Vec<String>> = vec![Vec::new()];
    for f in &hundred(&p).frames {
        places.last_mut().unwrap().push(f.function.clone());
        if !f.inlined {
            places.push(Vec::new());
        }
    }
    assert!(places[..2].concat() == ["alpha_site", "main"], "{d}");

    // Both engines: the process's own probes, and the host engine's
    // (no address of the process known: the mapping is the segment's
    // pages where their file offsets are).
    for engine in [&[][..], &["--file-wide"][..]] {
        let pb = dir.path().join("strip.pb.gz");
        let mut args = engine.to_vec();
        args.extend(["--no-debuginfod", "--pprof", pb.to_str().unwrap()]);
        let (d, _) = trace(&strip, &args, &[], dir.path());
        let d = format!("{engine:?}\n{d}");
        let pprof = Pprof::decode(&pb);
        let loads = loads(&strip);
        let (locations, _) = pprof
            .samples
            .iter()
            .find(|(_, v)| v[0] == 100)
            .unwrap_or_else(|| panic!("no sample of 100 calls\n{d}"));
        let mut named_by_addr2line = Vec::new();
        // Location 0 is the allocator's; then one location per place.
        for (place, loc) in locations.iter().skip(1).enumerate() {
            let (mapping_id, address) = pprof.places[loc];
            let m = &pprof.mappings[&mapping_id];
            if m.memory_limit == 0 && m.filename.ends_with("libc.so.6") {
                continue; // The allocator's own mapping, named.
            }
            assert!(
                m.memory_start <= address && address < m.memory_limit,
                "location {loc} at {address:#x} outside its mapping {m:?}\n{d}"
            );
            if !m.filename.ends_with("/s_strip") {
                continue;
            }
            assert_eq!(m.build_id, id, "{d}");
            let offset = address - m.memory_start + m.file_offset;
            let &(p_offset, p_vaddr, p_filesz) = loads
                .iter()
                .find(|(o, _, size)| offset >= *o && offset < o + size)
                .unwrap_or_else(|| panic!("offset {offset:#x} in no PT_LOAD: {loads:x?}\n{d}"));
            // The mapping is the pages of that segment of the file.
            assert_eq!(m.file_offset, p_offset & !0xfff, "{m:?} {loads:x?}");
            assert!(
                m.file_offset + (m.memory_limit - m.memory_start) >= p_offset + p_filesz,
                "{m:?} {loads:x?}"
            );
            assert!(
                !m.has_functions && !m.has_filenames && !m.has_line_numbers,
                "{m:?}"
            );
            let names = pprof.location_names(*loc);
            if !names.iter().all(|n| n.starts_with("s_strip+0x")) {
                continue;
            }
            let vaddr = offset - p_offset + p_vaddr;
            let name = addr2line(&debug, vaddr - 1);
            assert!(
                places[place].contains(&name),
                "location {loc} ({names:?}): addr2line names {name} at {vaddr:#x}, \
                 the unstripped trace {:?}\n{d}",
                places[place]
            );
            named_by_addr2line.push(name);
        }
        assert!(
            named_by_addr2line.starts_with(&["alpha_site".to_string(), "main".to_string()]),
            "{named_by_addr2line:?}\n{d}"
        );
        // libc, named, says so.
        assert!(
            pprof
                .mappings
                .values()
                .any(|m| m.filename.ends_with("libc.so.6")
                    && m.memory_limit > 0
                    && m.has_functions),
            "{:?}",
            pprof.mappings
        );
    }
}

/// A stripped program's entry point, which no symbol names, is `_start`
/// (the ELF header's `e_entry`, the call-frame information covering it),
/// as gdb and perf name it: the outermost frame of a whole stack, in the
/// profile and in the report; the program's other frames stay offsets.
#[test]
fn a_stripped_programs_entry_point_is_start() {
    let dir = bpf_tempdir!();
    let (strip, _debug, _id) = stripped(dir.path());
    let (out, p) = trace_out(
        &strip,
        &["--no-debuginfod", "--max-stack", "64"],
        &[],
        dir.path(),
    );
    let d = out.describe();
    let frames = &hundred(&p).frames;
    let outermost = frames.last().unwrap();
    assert_eq!(outermost.function, "_start", "{d}");
    assert!(
        outermost
            .module
            .as_deref()
            .is_some_and(|m| m.ends_with("/s_strip")),
        "{d}"
    );
    assert!(frames[0].function.starts_with("s_strip+0x"), "{d}");
    let report = out.report();
    let row = report
        .rows
        .iter()
        .find(|r| r.calls == 100)
        .unwrap_or_else(|| panic!("no row of 100 calls\n{d}"));
    assert_eq!(row.frames.last().map(String::as_str), Some("_start"), "{d}");
}
