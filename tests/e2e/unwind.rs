//! Whole stacks without frame pointers (tests/fixtures/unwind/, built
//! `-O2 -fomit-frame-pointer` like Debian's libraries): every stack mtrace
//! reports is, frame for frame, what gdb's backtrace shows at a breakpoint
//! on the allocator (support/gdb.rs), with the same number of calls; and
//! the stack-quality line counts what stops short on purpose.

use std::path::{Path, PathBuf};

use crate::support::{
    gdb::{stacks_in_profile, stacks_under_gdb, Stacks},
    run_profiled, trace_by_pid,
    unwind::{Program, CHAINS, CXX, DEEP, DEEPER, DLOPEN, JIT, MEMO, MIXED, NO_CFI, RUST},
    Finished, FixtureProc, Profile,
};

fn paths(objects: &[PathBuf]) -> Vec<&Path> {
    objects.iter().map(PathBuf::as_path).collect()
}

/// Every stack of `p` against gdb's, calls included; all of them whole.
fn assert_like_gdb(
    p: &Profile,
    gdb: &Stacks,
    objects: &[PathBuf],
    keep: impl Fn(&[String]) -> bool,
) {
    let own = paths(objects);
    let pick = |s: &Stacks| -> Stacks {
        s.iter()
            .filter(|((_, frames), _)| keep(frames))
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    };
    let ours = pick(&stacks_in_profile(p, &own));
    let theirs = pick(gdb);
    assert!(!theirs.is_empty(), "no stack to compare");
    if ours != theirs {
        let show = |s: &Stacks| {
            s.iter()
                .map(|((f, frames), n)| format!("  {n:>4} {f} <- {}", frames.join(" <- ")))
                .collect::<Vec<_>>()
                .join("\n")
        };
        panic!(
            "mtrace's stacks differ from gdb's\n--- mtrace ---\n{}\n--- gdb ---\n{}\n{}",
            show(&ours),
            show(&theirs),
            p.dump()
        );
    }
    let q = &p.doc["stack_quality"];
    assert_eq!(q["whole"], q["calls"], "stack quality: {q}");
}

/// Launch mode with `args`, every stack against gdb's; mtrace's output.
fn check_launch(program: Program, args: &[&str]) -> Finished {
    check_launch_profiled(program, args).0
}

/// [`check_launch`], and the profile.
fn check_launch_profiled(program: Program, args: &[&str]) -> (Finished, Profile) {
    let objects = program.objects();
    let gdb = stacks_under_gdb(&paths(&objects), &[], "");
    let mut all = args.to_vec();
    all.extend(["--top", "0", "--", objects[0].to_str().unwrap()]);
    let (out, p) = run_profiled(&all);
    out.assert_exit(0);
    assert_like_gdb(&p, &gdb, &objects, |_| true);
    (out, p)
}

#[test]
fn c_chains_recursion_libc_and_threads_count_mode() {
    need_bpf!();
    chains_with_holes(&[]);
}

/// The same on the host's engine (`--file-wide`, alone).
#[test]
fn c_chains_recursion_libc_and_threads_on_the_hosts_engine() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    chains_with_holes(&["--file-wide"]);
}

/// chains.c's stacks, gdb's, with `engine`.
fn chains_with_holes(engine: &[&str]) {
    let mut args = engine.to_vec();
    args.push("-v");
    let out = check_launch(CHAINS, &args);
    // The third thread's first walk through its big frame went to the
    // tracer with holes in its copy of the stack (chains.c), and its stack
    // is gdb's all the same.
    let holes = out.stderr.iter().find_map(|l| {
        let (before, _) = l.split_once(" with pages that could not be read")?;
        before.rsplit(' ').next()?.parse::<u64>().ok()
    });
    assert!(
        holes.is_some_and(|n| n >= 1),
        "{engine:?}: no copy with holes: {holes:?}\n{}",
        out.describe()
    );
}

/// Calls from one place whose stacks differ further up (memo.c): each
/// keeps its own stack, as gdb shows, although most reuse a remembered
/// walk instead of walking.
#[test]
fn remembered_walks_keep_stacks_that_differ_further_up() {
    need_bpf!();
    for mode in [&["-v"][..], &["-v", "--live"][..]] {
        let (out, p) = check_launch_profiled(MEMO, mode);
        // 42 calls from 8 places: the stack of some was a remembered
        // walk's.
        let q = &p.doc["stack_quality"];
        let walked = q["walked_in_kernel"].as_u64().unwrap();
        assert_eq!(q["calls"], 42, "{mode:?}: {q}\n{}", out.describe());
        assert!(
            (8..42).contains(&walked),
            "{mode:?}: {q}\n{}",
            out.describe()
        );
    }
}

/// The same on the host's engine (`--file-wide`): its walks are
/// remembered too, by process, and each call keeps gdb's stack.
#[test]
fn remembered_walks_on_the_hosts_engine_keep_stacks_that_differ_further_up() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let (out, p) = check_launch_profiled(MEMO, &["--file-wide"]);
    let q = &p.doc["stack_quality"];
    let walked = q["walked_in_kernel"].as_u64().unwrap();
    assert_eq!(q["calls"], 42, "{q}\n{}", out.describe());
    assert!((8..42).contains(&walked), "{q}\n{}", out.describe());
}

/// `program`'s three calls, each a stack gdb's, whole, the first of them
/// walked by the tracer.
fn whole_from_the_first_walk(program: Program, mode: &[&str]) {
    let (out, p) = check_launch_profiled(program, mode);
    let q = &p.doc["stack_quality"];
    assert_eq!(q["calls"], 3, "{mode:?}: {q}\n{}", out.describe());
    assert!(
        q["finished_by_tracer"].as_u64().is_some_and(|n| n >= 1),
        "{mode:?}: no walk went to the tracer: {q}\n{}",
        out.describe()
    );
}

/// A stack deeper than 64 KiB at the allocation (deep.c: 60 frames of 2
/// KiB): the first walk goes to the tracer with a copy of all of it, and
/// every stack is gdb's, whole, in count and live mode.
#[test]
fn stack_deeper_than_64_kib_is_whole_from_its_first_walk() {
    need_bpf!();
    for mode in [&["-v"][..], &["-v", "--live"][..]] {
        whole_from_the_first_walk(DEEP, mode);
    }
}

/// A stack deeper than the largest copy (256 KiB): a frame of 400 KiB
/// under main, then 40 frames of 2 KiB. The first walk goes to the
/// tracer with the stack's first and last bytes; the frames above the
/// large one are read from the last, and every stack is gdb's, whole.
#[test]
fn stack_deeper_than_the_copy_is_whole_from_its_first_walk() {
    need_bpf!();
    whole_from_the_first_walk(DEEPER, &["-v"]);
}

#[test]
fn c_chains_live_mode() {
    need_bpf!();
    check_launch(CHAINS, &["--live"]);
}

#[test]
fn c_chains_sampled_mode_every_call() {
    need_bpf!();
    check_launch(CHAINS, &["--sample-every", "1"]);
}

#[test]
fn cxx_new_map_and_vector() {
    need_bpf!();
    check_launch(CXX, &[]);
}

#[test]
fn rust_release_build() {
    need_bpf!();
    check_launch(RUST, &[]);
}

#[test]
fn mixed_frame_pointer_and_no_frame_pointer_libraries() {
    need_bpf!();
    check_launch(MIXED, &[]);
}

/// By pid, a library the target loads after mtrace attached: its frames
/// are unwound as well (the stacks through plugin_work; what the program
/// allocated before mtrace attached is not compared).
#[test]
fn library_dlopened_after_attach_by_pid() {
    need_bpf!();
    let objects = DLOPEN.objects();
    let plugin = objects[1].to_str().unwrap();
    let gdb = stacks_under_gdb(&paths(&objects), &[plugin], "go\n");
    let mut target = FixtureProc::start(&objects[0], &[plugin]);
    let (_, p) = trace_by_pid(&mut target, &["--top", "0"]);
    assert_like_gdb(&p, &gdb, &objects, |frames| {
        frames.iter().any(|f| f == "plugin_work")
    });
}

/// Code a program wrote at run time into anonymous memory (as a JIT
/// compiler does), two frames deep, each keeping a frame pointer: the walk
/// passes both by their frame pointers (the call before each return
/// address is read from the target's memory) and reaches `_start`; the
/// frames are named as anonymous code, not as the file that was once
/// mapped at that address (the dynamic linker's `ld.so.cache`, here).
/// gdb's backtrace is no oracle here (it shows two junk frames between
/// them); the fixture's code is: the return addresses lie 0xc into each
/// of two trampolines 0x40 apart. Both engines: on the host engine the
/// tracer judges the process's JIT code by the first walk through it
/// (the frame pointer checks out) and the kernel follows it from then on;
/// the process, gone within milliseconds, is held at its exit until that
/// walk is finished in its memory.
#[test]
fn jit_code_in_anonymous_memory_is_passed_by_its_frame_pointer() {
    // The host engine's run probes file-wide: alone.
    if !crate::support::require_bpf_alone() {
        return;
    }
    let objects = JIT.objects();
    for engine in [&[][..], &["--file-wide"][..]] {
        let mut args = engine.to_vec();
        args.extend(["--top", "0", "--", objects[0].to_str().unwrap()]);
        let (out, p) = run_profiled(&args);
        out.assert_exit(0);
        let d = format!("{engine:?}\n{}", p.dump());
        assert_eq!(p.site("malloc", "jit_leaf"), (5, 240), "{d}");
        let stacks = p.stacks_at("malloc", "jit_leaf");
        assert_eq!(stacks.len(), 1, "{d}");
        let st = stacks[0];
        let names = st.names();
        assert_eq!(
            names.len(),
            7,
            "jit_leaf, 2 JIT frames, main and libc's start: {d}"
        );
        let jit_addr = |name: &str| {
            name.strip_prefix("[anonymous code 0x")
                .and_then(|a| a.strip_suffix(']'))
                .and_then(|a| u64::from_str_radix(a, 16).ok())
                .unwrap_or_else(|| panic!("not anonymous code: {name}\n{d}"))
        };
        let (inner, outer) = (jit_addr(names[1]), jit_addr(names[2]));
        assert_eq!(outer & 0xfff, 0xc, "{d}");
        assert_eq!(inner, outer + 0x40, "{d}");
        assert_eq!(
            names[3..],
            [
                "main",
                "__libc_start_call_main",
                "__libc_start_main_impl",
                "_start"
            ],
            "{d}"
        );
        assert!(!st.truncated, "{d}");
        assert!(
            st.frames[1..3].iter().all(|f| f.module.is_none()),
            "no file named for JIT code: {d}"
        );
        let q = &p.doc["stack_quality"];
        assert_eq!(q["calls"], q["whole"], "{q}");
    }
}

/// A function with no CFI (assembly) stops the walk: exactly its 9 calls
/// are cut short, counted as `no_cfi`, and shown on the stacks line; the
/// 4 others are whole.
#[test]
fn code_without_cfi_is_counted_as_cut_short() {
    need_bpf!();
    let objects = NO_CFI.objects();
    let (out, p) = run_profiled(&["--top", "0", "--", objects[0].to_str().unwrap()]);
    out.assert_exit(0);
    let d = p.dump();
    assert_eq!(p.site("malloc", "through_nocfi_leaf"), (9, 360), "{d}");
    assert_eq!(p.site("malloc", "direct_leaf"), (4, 320), "{d}");
    assert_eq!(p.site("malloc", "through_fp_leaf"), (6, 144), "{d}");
    // Code without CFI that keeps a frame pointer is passed by it, to
    // the thread's first frame.
    for st in p.stacks_at("malloc", "through_fp_leaf") {
        assert_eq!(
            st.names()[..3],
            ["through_fp_leaf", "nocfi_fp_call", "main"],
            "{d}"
        );
        assert_eq!(st.names().last().copied(), Some("_start"), "{d}");
        assert!(!st.truncated, "{d}");
    }
    let q = &p.doc["stack_quality"];
    assert_eq!(q["truncated"]["no_cfi"], 9, "{q}");
    assert_eq!(
        q["calls"].as_u64().unwrap() - q["whole"].as_u64().unwrap(),
        9,
        "{q}"
    );
    let r = out.report();
    assert!(
        r.cut_short.contains(&("no_cfi".to_string(), 9)),
        "{:?}\n{}",
        r.cut_short,
        out.describe()
    );
}

/// `--max-stack N` keeps the direct caller and N frames above it: gdb's
/// stacks cut there, their calls added up, in the kernel's walks and in
/// those the tracer finishes for want of a rule alike (one row per cut
/// stack). The stacks cut are counted as `max_frames`, and the quality
/// line names the limit; 0 is the caller alone. Both engines (the host
/// engine's run probes file-wide: alone).
#[test]
fn max_stack_keeps_the_first_frames_of_gdbs_stacks() {
    if !crate::support::require_bpf_alone() {
        return;
    }
    let objects = CHAINS.objects();
    let gdb = stacks_under_gdb(&paths(&objects), &[], "");
    let engines = [&[][..], &["--file-wide"][..]];
    for (engine, n) in engines.iter().flat_map(|e| [(e, 3usize), (e, 0)]) {
        let mut cut = Stacks::new();
        let mut deeper = 0;
        for ((func, frames), calls) in &gdb {
            if frames.len() > n + 1 {
                deeper += calls;
            }
            let kept = frames[..frames.len().min(n + 1)].to_vec();
            *cut.entry((func.clone(), kept)).or_default() += calls;
        }
        assert!(deeper > 0, "no stack deeper than {n} frames: {gdb:?}");
        let limit = n.to_string();
        let mut args = engine.to_vec();
        args.extend(["--max-stack", &limit, "--top", "0", "--"]);
        args.push(objects[0].to_str().unwrap());
        let (out, p) = run_profiled(&args);
        out.assert_exit(0);
        let d = p.dump();
        let ours = stacks_in_profile(&p, &paths(&objects));
        assert_eq!(
            ours, cut,
            "{engine:?} --max-stack {n}: mtrace's stacks (left) against gdb's cut (right)\n{d}"
        );
        // A walk the tracer finished and one the kernel made of the same
        // stack are one row: no two rows with the same return addresses.
        let rows = p.doc["stacks"].as_array().expect("stacks");
        let distinct: std::collections::BTreeSet<String> = rows
            .iter()
            .map(|r| {
                let addrs: Vec<String> = r["frames"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|f| f["address"].to_string())
                    .collect();
                format!("{} {}", r["function"], addrs.join(" "))
            })
            .collect();
        assert_eq!(
            distinct.len(),
            rows.len(),
            "--max-stack {n}: a stack in two rows\n{d}"
        );
        let q = &p.doc["stack_quality"];
        assert_eq!(q["frame_limit"].as_u64(), Some(n as u64), "{q}");
        assert_eq!(q["truncated"]["max_frames"].as_u64(), Some(deeper), "{q}");
        assert_eq!(
            q["calls"].as_u64().unwrap() - q["whole"].as_u64().unwrap(),
            deeper,
            "{q}"
        );
        if n > 0 {
            // The first walks meet return addresses without rules and are
            // finished by the tracer, which must cut them at the same place.
            assert!(q["finished_by_tracer"].as_u64().unwrap() > 0, "{q}");
        }
        let line = if n == 0 {
            "the direct caller only (--max-stack 0)".to_string()
        } else {
            format!("at most {n} frames above the caller (--max-stack {n})")
        };
        assert_eq!(out.report().stack_limit, Some(line), "{}", out.describe());
    }
}
