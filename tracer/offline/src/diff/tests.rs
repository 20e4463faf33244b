use super::gate::*;
use super::*;
use crate::profile::Thread;
use crate::profile::{Counts, Frame, Profile, StackEntry, Weight};
use crate::render::diff_table::render_table;
use crate::render::flamegraph::{self, Kind};
use crate::render::folded;
use crate::render::test_util::{entry, on_thread, profile};

/// A frame as symbolization makes it, with everything that must not
/// matter filled in.
fn sym(function: &str, module: &str, addr: u64, line: u32) -> Frame {
    Frame {
        function: function.into(),
        file: Some(format!("/src/{function}.c")),
        line: Some(line),
        module: Some(module.into()),
        build_id: Some(format!("{addr:x}")),
        file_offset: Some(addr & 0xfff),
        addr,
        inlined: false,
        mapping: None,
        symbol_offset: None,
    }
}

fn stack(func: &str, frames: Vec<Frame>, calls: u64, bytes: u64) -> StackEntry {
    StackEntry {
        func: func.into(),
        frames: frames.into_iter().map(Arc::new).collect(),
        truncated: false,
        thread: None,
        process: None,
        counts: Counts { calls, bytes },
        live: None,
        in_use: None,
        object_size: None,
    }
}

/// alloc_small: 1000 calls of 48 bytes; alloc_big: 100 calls of 4096;
/// zeroed: 50 callocs of 10. `small` scales alloc_small's calls.
fn run(small: u64, module_dir: &str, addr_shift: u64) -> Profile {
    let m = format!("{module_dir}/fixture");
    let f = |name: &str, addr: u64, line: u32| sym(name, &m, addr + addr_shift, line);
    profile(vec![
        stack(
            "malloc",
            vec![f("alloc_small", 0x1100, 10), f("main", 0x1500, 40)],
            small,
            small * 48,
        ),
        stack(
            "malloc",
            vec![f("alloc_big", 0x1200, 20), f("main", 0x1510, 41)],
            100,
            409600,
        ),
        stack(
            "calloc",
            vec![f("zeroed", 0x1300, 30), f("main", 0x1520, 42)],
            50,
            500,
        ),
        stack("free", vec![f("drop", 0x1400, 5)], 900, 0),
    ])
}

fn cond(s: &str) -> Condition {
    parse_condition(s).unwrap()
}

fn names(key: &StackKey) -> Vec<&str> {
    key.frames.iter().map(|f| f.function.as_str()).collect()
}

// -- diff ---------------------------------------------------------------

#[test]
fn identical_profiles_have_no_change() {
    let d = diff(&run(1000, "/tmp", 0), &run(1000, "/tmp", 0));
    assert_eq!(d.total.base, d.total.new);
    assert_eq!(
        d.total.new,
        Counts {
            calls: 1150,
            bytes: 458100
        }
    );
    assert_eq!(d.in_stacks, d.total);
    assert_eq!(d.rows.len(), 3, "free is not a row");
    assert!(d.rows.iter().all(|r| r.change.is_unchanged()));
    let conds = [cond("calls>+5%"), cond("bytes>+0"), cond("calls>0%")];
    assert!(check(&d, &conds, false).is_empty());
    assert!(check(&d, &conds, true).is_empty());
    let table = render_table(&d, 0);
    assert_eq!(
        table,
        "total: calls 1150 -> 1150 (+0, +0.00%), bytes 458100 -> 458100 (+0, +0.00%)\n\
         \n\
         no stack changed\n\
         3 stacks unchanged\n"
    );
}

#[test]
fn one_site_up_twenty_percent() {
    let base = profile(vec![
        stack(
            "malloc",
            vec![
                sym("alloc_small", "/b/fixture", 1, 1),
                sym("main", "/b/fixture", 2, 2),
            ],
            1000,
            48000,
        ),
        stack("malloc", vec![sym("other", "/b/fixture", 3, 3)], 1000, 1000),
    ]);
    let new = profile(vec![
        stack(
            "malloc",
            vec![
                sym("alloc_small", "/b/fixture", 1, 1),
                sym("main", "/b/fixture", 2, 2),
            ],
            1200,
            57600,
        ),
        stack("malloc", vec![sym("other", "/b/fixture", 3, 3)], 1000, 1000),
    ]);
    let d = diff(&base, &new);
    assert_eq!(d.total.base.calls, 2000);
    assert_eq!(d.total.new.calls, 2200);
    assert_eq!(d.rows[0].change.delta(Weight::Calls), 200);
    assert_eq!(d.rows[0].change.delta(Weight::Bytes), 9600);
    assert_eq!(names(&d.rows[0].key), ["alloc_small", "main"]);

    // Totals: +10%.
    let v = check(&d, &[cond("calls>+5%")], false);
    assert_eq!(
        v,
        [Violation {
            condition: "calls>+5%".into(),
            metric: Weight::Calls,
            stack: None,
            group: None,
            base: 2000,
            new: 2200,
            moved: vec![Moved {
                key: d.rows[0].key.clone(),
                delta: 200
            }],
        }]
    );
    assert_eq!(
        v[0].to_string(),
        "regression: calls>+5%: total calls 2000 -> 2200 (+200, +10.00%); \
         grew most: +200 malloc <- alloc_small <- main"
    );
    assert!(check(&d, &[cond("calls>+10%")], false).is_empty());
    assert_eq!(check(&d, &[cond("calls>=+10%")], false).len(), 1);

    // Per stack: exactly that stack, and not the totals.
    let v = check(&d, &[cond("calls>+5%")], true);
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].stack.as_ref(), Some(&d.rows[0].key));
    assert_eq!((v[0].base, v[0].new), (1000, 1200));
    assert_eq!(
        v[0].to_string(),
        "regression: calls>+5%: malloc <- alloc_small <- main: 1000 -> 1200 (+200, +20.00%)"
    );
    assert!(check(&d, &[cond("calls>+20%")], true).is_empty());
    assert_eq!(check(&d, &[cond("calls>=20%")], true).len(), 1);
}

#[test]
fn exact_totals_and_stack_sums_are_both_kept() {
    let base = run(1000, "/tmp", 0);
    let mut new = run(1000, "/tmp", 0);
    // 30 allocations found the map full: in the totals, in no stack.
    new.totals.allocs.calls += 30;
    new.totals.allocs.bytes += 300;
    let d = diff(&base, &new);
    assert_eq!(d.total.new.calls, 1180);
    assert_eq!(d.in_stacks.new.calls, 1150);
    assert!(d.rows.iter().all(|r| r.change.is_unchanged()));
    // The gate reads the exact totals.
    assert_eq!(check(&d, &[cond("calls>+2%")], false).len(), 1);
    assert!(check(&d, &[cond("calls>+2%")], true).is_empty());
    let table = render_table(&d, 0);
    assert!(table.lines().any(|l| l.starts_with(
        "in stacks: calls 1150 -> 1150 (+0, +0.00%), bytes 458100 -> 458100 (+0, +0.00%)"
    )));
}

#[test]
fn matching_ignores_addresses_lines_threads_and_module_directories() {
    let base = run(1000, "/home/ci/build-1", 0);
    let mut new = run(1000, "/home/ci/build-2", 0x40);
    for (i, e) in new.stacks.iter_mut().enumerate() {
        for f in &mut e.frames {
            let f = Arc::make_mut(f);
            f.line = f.line.map(|l| l + 7);
            f.file = Some("/elsewhere/x.c".into());
            f.inlined = true;
        }
        e.thread = Some(Thread {
            tid: 100 + i as u32,
            name: "w".into(),
        });
    }
    Arc::make_mut(&mut new.stacks[0].frames[1]).module =
        Some("/home/ci/build-2/fixture (deleted)".into());
    let d = diff(&base, &new);
    assert_eq!(d.rows.len(), 3);
    assert!(d.rows.iter().all(|r| r.change.is_unchanged()), "{d:#?}");
    assert_eq!(d.rows[0].key.frames[0].module.as_deref(), Some("fixture"));
}

/// Frames without names line up across runs: a code object, anonymous
/// code and an address in no mapping without their per-run addresses, a
/// stripped program's place by offset whatever the program's file name.
#[test]
fn unnamed_frames_line_up_across_runs_and_file_names() {
    let unnamed = |exe: &str, addr: u64, offset: u64| {
        let name = exe.rsplit('/').next().unwrap();
        let frame = |function: String, module: Option<&str>| Frame {
            function,
            module: module.map(String::from),
            addr,
            ..Frame::default()
        };
        let mut p = profile(vec![stack(
            "malloc",
            vec![
                frame(format!("[python code {addr:#x}]"), None),
                frame(format!("[anonymous code {addr:#x}]"), Some("[anon:jit]")),
                frame(format!("[unknown {addr:#x}]"), None),
                frame(format!("{name}+{offset:#x}"), Some(exe)),
                frame(format!("libz.so.1+{offset:#x}"), Some("/lib/libz.so.1")),
            ],
            10,
            10,
        )]);
        p.meta.executable = exe.into();
        p
    };
    let d = diff(
        &unnamed("/a/hf_strip", 0x1000, 0x142a),
        &unnamed("/b/hf_renamed", 0x7f00, 0x142a),
    );
    assert_eq!(d.rows.len(), 1, "{d:#?}");
    assert!(d.rows[0].change.is_unchanged());
    assert_eq!(
        names(&d.rows[0].key),
        [
            "[python code]",
            "[anonymous code]",
            "[unknown]",
            "<program>+0x142a",
            "libz.so.1+0x142a"
        ]
    );
    // Another place in the file is another frame.
    let d = diff(
        &unnamed("/a/hf_strip", 0x1000, 0x142a),
        &unnamed("/a/hf_strip", 0x1000, 0x1500),
    );
    assert_eq!(d.rows.len(), 2, "{d:#?}");
}

/// A Python frame named in one run and unnamed, or named by the code
/// object that took its place, in another: the stacks are one, and their
/// counts are still compared. Where two stacks could be the one, neither is
/// chosen.
#[test]
fn python_frames_named_in_one_run_only_line_up() {
    let py = |name: &str| Frame {
        function: name.into(),
        file: Some("<frozen getpath>".into()),
        ..Frame::default()
    };
    let one = |name: &str, calls: u64| {
        stack(
            "malloc",
            vec![sym("_Py_wfopen", "/usr/bin/python3.11", 1, 1), py(name)],
            calls,
            calls * 10,
        )
    };
    let base = profile(vec![one("<module>", 5)]);
    for other in ["[python code 0x36344040]", "safe_path"] {
        let d = diff(&base, &profile(vec![one(other, 5)]));
        assert_eq!(d.rows.len(), 1, "{d:#?}");
        assert!(d.rows[0].change.is_unchanged());
        let d = diff(&base, &profile(vec![one(other, 6)]));
        assert_eq!(d.rows.len(), 1, "{d:#?}");
        assert_eq!(d.rows[0].change.delta(Weight::Calls), 1);
    }
    let two = profile(vec![one("a", 5), one("b", 5)]);
    assert_eq!(diff(&base, &two).rows.len(), 3);
}

/// An unnamed Python frame in one run may be any named one of its shape
/// in the other, and the calls of one name may sit under it in one run and
/// under the name in another (found by a flapping per-stack gate on
/// Debian's python3): the rows of that shape are compared as one, and a
/// real change among them is still seen.
#[test]
fn an_unnamed_python_frame_blurs_the_named_ones_of_its_shape() {
    let py = |name: &str| Frame {
        function: name.into(),
        file: Some("x.py".into()),
        ..Frame::default()
    };
    let one = |name: &str, calls: u64| {
        stack(
            "malloc",
            vec![
                sym("_PyObject_MakeTpCall", "/usr/bin/python3.11", 1, 1),
                py(name),
            ],
            calls,
            calls * 768,
        )
    };
    let unnamed = "[python code 0x7f82994b1980]";
    let named = profile(vec![one("a", 3), one("b", 3)]);
    for (new, delta) in [
        (vec![one(unnamed, 3), one("b", 3)], 0),
        (vec![one(unnamed, 3), one("a", 3)], 0),
        (vec![one(unnamed, 6)], 0),
        (vec![one(unnamed, 3), one("b", 10)], 7),
    ] {
        let new = profile(new);
        for (a, b, sign) in [(&named, &new, 1), (&new, &named, -1)] {
            let d = diff(a, b);
            assert_eq!(d.rows.len(), 1, "{d:#?}");
            assert_eq!(
                d.rows[0].change.delta(Weight::Calls),
                sign * delta,
                "{d:#?}"
            );
            assert_eq!(
                names(&d.rows[0].key),
                ["_PyObject_MakeTpCall", "[python code]"]
            );
        }
    }
    // Named on both sides, the rows stay apart.
    let d = diff(&named, &named);
    assert_eq!(d.rows.len(), 2, "{d:#?}");
}

#[test]
fn matching_respects_function_and_module_names() {
    let base = profile(vec![stack(
        "malloc",
        vec![sym("a", "/x/libfoo.so", 1, 1)],
        10,
        10,
    )]);
    for changed in [
        stack("malloc", vec![sym("b", "/x/libfoo.so", 1, 1)], 10, 10),
        stack("malloc", vec![sym("a", "/x/libbar.so", 1, 1)], 10, 10),
        stack("calloc", vec![sym("a", "/x/libfoo.so", 1, 1)], 10, 10),
        stack(
            "malloc",
            vec![sym("a", "/x/libfoo.so", 1, 1), sym("main", "/x/m", 2, 2)],
            10,
            10,
        ),
    ] {
        let d = diff(&base, &profile(vec![changed.clone()]));
        assert_eq!(d.rows.len(), 2, "{changed:?}");
        assert!(d.rows.iter().all(|r| !r.change.is_unchanged()));
    }
    let mut cut = stack("malloc", vec![sym("a", "/x/libfoo.so", 1, 1)], 10, 10);
    cut.truncated = true;
    assert_eq!(diff(&base, &profile(vec![cut])).rows.len(), 2);
}

#[test]
fn entries_with_the_same_key_are_summed() {
    // Per-thread splits, and two call sites on one line (two addresses).
    let base = profile(vec![
        on_thread(entry("malloc", &["a", "main"], 10, 100), 1, "t1"),
        on_thread(entry("malloc", &["a", "main"], 20, 200), 2, "t2"),
    ]);
    let mut second = entry("malloc", &["a", "main"], 5, 50);
    Arc::make_mut(&mut second.frames[0]).addr = 0x99;
    let new = profile(vec![entry("malloc", &["a", "main"], 30, 300), second]);
    let d = diff(&base, &new);
    assert_eq!(d.rows.len(), 1);
    assert_eq!(
        d.rows[0].change.base,
        Counts {
            calls: 30,
            bytes: 300
        }
    );
    assert_eq!(
        d.rows[0].change.new,
        Counts {
            calls: 35,
            bytes: 350
        }
    );
}

#[test]
fn new_and_gone_stacks() {
    let base = profile(vec![
        entry("malloc", &["kept"], 100, 100),
        entry("malloc", &["gone"], 7, 70),
    ]);
    let new = profile(vec![
        entry("malloc", &["kept"], 100, 100),
        entry("malloc", &["leak", "main"], 3, 3000),
    ]);
    let d = diff(&base, &new);
    let gone = d
        .rows
        .iter()
        .find(|r| r.key.frames[0].function == "gone")
        .unwrap();
    assert_eq!(gone.change.new, Counts::default());
    let leak = d
        .rows
        .iter()
        .find(|r| r.key.frames[0].function == "leak")
        .unwrap();
    assert_eq!(leak.change.base, Counts::default());

    // A new stack is an infinite percentage increase...
    let v = check(&d, &[cond("calls>+1000000%")], true);
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].stack.as_ref(), Some(&leak.key));
    assert_eq!(
        v[0].to_string(),
        "regression: calls>+1000000%: malloc <- leak <- main: 0 -> 3 (+3, new)"
    );
    // ... but absolute thresholds still apply as written.
    assert!(check(&d, &[cond("calls>+3")], true).is_empty());
    assert_eq!(check(&d, &[cond("calls>=+3")], true).len(), 1);
    // A gone stack never violates: only growth is gated.
    assert!(check(&d, &[cond("calls>=0%")], true)
        .iter()
        .all(|v| v.stack.as_ref() != Some(&gone.key)));

    let table = render_table(&d, 0);
    assert!(
        table.contains(
            "#1  calls -7 (-100.00%, 7 -> 0)  bytes -70 (-100.00%, 70 -> 0)  malloc\n    \
             gone\n"
        ),
        "{table}"
    );
    assert!(
        table.contains(
            "#2  calls +3 (new, 0 -> 3)  bytes +3000 (new, 0 -> 3000)  malloc\n    \
             leak\n    main\n"
        ),
        "{table}"
    );
    assert!(table.ends_with("\n1 stack unchanged\n"));
}

#[test]
fn empty_base_totals_are_an_infinite_increase() {
    let d = diff(
        &Profile::default(),
        &profile(vec![entry("malloc", &["a"], 1, 1)]),
    );
    let v = check(&d, &[cond("calls>+50%")], false);
    assert_eq!(
        v[0].to_string(),
        "regression: calls>+50%: total calls 0 -> 1 (+1, new); grew most: +1 malloc <- a"
    );
    let both_empty = diff(&Profile::default(), &Profile::default());
    assert!(check(&both_empty, &[cond("calls>+0%"), cond("bytes>0")], false).is_empty());
    assert_eq!(
        render_table(&both_empty, 0),
        "total: calls 0 -> 0 (+0, +0.00%), bytes 0 -> 0 (+0, +0.00%)\n\nno stack changed\n"
    );
}

#[test]
fn rows_sort_by_absolute_calls_then_bytes_then_key() {
    let base = profile(vec![
        entry("malloc", &["down"], 50, 0),
        entry("malloc", &["up"], 10, 0),
        entry("malloc", &["bytes_only"], 10, 10),
        entry("malloc", &["b_tie"], 10, 10),
        entry("malloc", &["a_tie"], 10, 10),
        entry("malloc", &["same"], 10, 10),
    ]);
    let new = profile(vec![
        entry("malloc", &["down"], 10, 0),
        entry("malloc", &["up"], 40, 0),
        entry("malloc", &["bytes_only"], 10, 9000),
        entry("malloc", &["b_tie"], 15, 20),
        entry("malloc", &["a_tie"], 5, 0),
        entry("malloc", &["same"], 10, 10),
    ]);
    let d = diff(&base, &new);
    let order: Vec<&str> = d
        .rows
        .iter()
        .map(|r| r.key.frames[0].function.as_str())
        .collect();
    assert_eq!(
        order,
        ["down", "up", "a_tie", "b_tie", "bytes_only", "same"]
    );
}

#[test]
fn several_conditions_and_bytes_units() {
    let base = profile(vec![entry("malloc", &["a"], 100, 10 << 20)]);
    let new = profile(vec![entry("malloc", &["a"], 100, (10 << 20) + (1 << 20))]);
    let d = diff(&base, &new); // +1 MiB = +1048576 bytes, +10%
    let fails = |s: &str| !check(&d, &[cond(s)], false).is_empty();
    assert!(!fails("bytes>+1MiB"));
    assert!(fails("bytes>=+1MiB"));
    assert!(fails("bytes>+1MB"));
    assert!(fails("bytes>+1023KiB"));
    assert!(!fails("bytes>+1024KiB"));
    assert!(fails("bytes>+1048575"));
    assert!(fails("bytes>+1048575B"));
    assert!(!fails("bytes>+1048576b"));
    assert!(fails("bytes>+0.0009GiB"));
    assert!(!fails("bytes>+0.001GiB"));
    assert!(fails("bytes>+1.048575MB"));
    assert!(!fails("bytes>+1.048576MB"));
    assert!(!fails("bytes>10%"));
    assert!(fails("bytes>=10%"));
    assert!(fails("bytes>9.999999999%"));
    assert!(!fails("calls>0"));
    let v = check(
        &d,
        &[
            cond("calls>0"),
            cond("bytes>512KiB"),
            cond("bytes > +2 MB"),
            cond("bytes>+5%"),
        ],
        false,
    );
    let texts: Vec<&str> = v.iter().map(|v| v.condition.as_str()).collect();
    assert_eq!(texts, ["bytes>512KiB", "bytes>+5%"]);
    assert_eq!(
        v[0].to_string(),
        "regression: bytes>512KiB: total bytes 10.0 MiB -> 11.0 MiB (+1.0 MiB, +10.00%); \
         grew most: +1.0 MiB malloc <- a"
    );
}

#[test]
fn percent_edges_are_exact() {
    let fails = |c: &str, b: u64, n: u64| cond(c).violated_by(b, n);
    assert!(!fails("calls>+5%", 1000, 1050));
    assert!(fails("calls>+5%", 1000, 1051));
    assert!(fails("calls>=+5%", 1000, 1050));
    assert!(!fails("calls>0.1%", 3000, 3003));
    assert!(fails("calls>0.1%", 3000, 3004));
    assert!(!fails("calls>+5%", 1000, 900));
    assert!(fails("calls>1.5", 10, 12));
    assert!(!fails("calls>1.5", 10, 11));
    assert!(fails("calls>=1.5", 10, 12));
    assert!(!fails("calls>=1.5", 10, 11));
    // Largest values do not overflow.
    assert!(fails("calls>999999999999999999%", 1, u64::MAX));
    assert!(!fails("calls>999999999999999999%", u64::MAX, u64::MAX));
    assert!(fails("bytes>+1", 0, u64::MAX));
    assert!(!fails("bytes>+999999999999999999GiB", 0, u64::MAX));
}

// -- parsing ------------------------------------------------------------

#[test]
fn parses_conditions() {
    let c = cond("calls>+5%");
    assert_eq!(c.metric, Weight::Calls);
    assert!(!c.inclusive);
    assert_eq!(c.threshold, Threshold::Percent(Ratio { num: 5, den: 1 }));
    assert_eq!(c.to_string(), "calls>+5%");

    let c = cond("  bytes >= 1.5 MiB ");
    assert_eq!(c.text, "bytes >= 1.5 MiB");
    assert_eq!(c.metric, Weight::Bytes);
    assert!(c.inclusive);
    assert_eq!(
        c.threshold,
        Threshold::Amount(Ratio {
            num: 15 << 20,
            den: 10
        })
    );
    assert_eq!(
        cond("bytes>+2MB").threshold,
        Threshold::Amount(Ratio {
            num: 2_000_000,
            den: 1
        })
    );
    assert_eq!(
        cond("bytes>+512KiB").threshold,
        Threshold::Amount(Ratio {
            num: 512 << 10,
            den: 1
        })
    );
    assert_eq!(
        cond("bytes>3gb").threshold,
        Threshold::Amount(Ratio {
            num: 3_000_000_000,
            den: 1
        })
    );
    assert_eq!(
        cond("calls>+100").threshold,
        Threshold::Amount(Ratio { num: 100, den: 1 })
    );
    assert_eq!(
        cond("calls>5%"),
        Condition {
            text: "calls>5%".into(),
            ..cond("calls>+5%")
        }
    );
    assert_eq!(
        cond("CALLS>.5%").threshold,
        Threshold::Percent(Ratio { num: 5, den: 10 })
    );
    assert_eq!(
        cond("calls>007").threshold,
        Threshold::Amount(Ratio { num: 7, den: 1 })
    );
    assert_eq!(
        cond("calls>2.25%").threshold,
        Threshold::Percent(Ratio { num: 225, den: 100 })
    );
    assert_eq!(Ratio { num: 225, den: 100 }.as_f64(), 2.25);
}

#[test]
fn parse_errors_name_the_bad_part() {
    let err = |s: &str| parse_condition(s).unwrap_err();
    assert_eq!(
        err("calls>>5"),
        "bad --fail-if 'calls>>5': expected a number after '>'"
    );
    assert_eq!(
        err("calls>="),
        "bad --fail-if 'calls>=': expected a number after '>='"
    );
    assert_eq!(
        err("calls>%"),
        "bad --fail-if 'calls>%': expected a number after '>'"
    );
    assert_eq!(
        err(""),
        "bad --fail-if '': empty condition; expected for example 'calls>+5%' or 'bytes>+1MiB'"
    );
    assert_eq!(
        err("allocs>5%"),
        "bad --fail-if 'allocs>5%': unknown measure 'allocs': expected 'calls' or 'bytes'"
    );
    assert_eq!(
        err(">5%"),
        "bad --fail-if '>5%': expected 'calls' or 'bytes' at the start"
    );
    assert_eq!(
        err("calls"),
        "bad --fail-if 'calls': expected '>' or '>=' after 'calls'"
    );
    assert_eq!(
        err("calls<5%"),
        "bad --fail-if 'calls<5%': expected '>' or '>=' after 'calls', found '<' (only increases are gated)"
    );
    assert_eq!(
        err("calls=5"),
        "bad --fail-if 'calls=5': expected '>' or '>=' after 'calls', found '=' (only increases are gated)"
    );
    assert_eq!(
        err("calls 5"),
        "bad --fail-if 'calls 5': expected '>' or '>=' after 'calls', found '5' (only increases are gated)"
    );
    assert_eq!(
        err("calls>-5%"),
        "bad --fail-if 'calls>-5%': the threshold is an increase ('+5%' or '5%'), not '-5%'"
    );
    assert_eq!(
        err("calls>1.2.3"),
        "bad --fail-if 'calls>1.2.3': '1.2.3' is not a number"
    );
    assert_eq!(
        err("calls>5."),
        "bad --fail-if 'calls>5.': '5.' is not a number"
    );
    assert_eq!(
        err("calls>."),
        "bad --fail-if 'calls>.': '.' is not a number"
    );
    assert_eq!(
        err("calls>0.0000000001%"),
        "bad --fail-if 'calls>0.0000000001%': '0.0000000001' has too many decimals (at most 9)"
    );
    assert_eq!(
        err("calls>1000000000000000000"),
        "bad --fail-if 'calls>1000000000000000000': '1000000000000000000' is too large"
    );
    assert_eq!(
        err("bytes>5XB"),
        "bad --fail-if 'bytes>5XB': unknown unit 'XB' after '5': expected %, B, KiB, MiB, GiB, KB, MB or GB"
    );
    assert_eq!(
        err("bytes>5M"),
        "bad --fail-if 'bytes>5M': ambiguous unit 'M': write MiB (powers of 1024) or MB (powers of 1000)"
    );
    assert_eq!(
        err("calls>5MiB"),
        "bad --fail-if 'calls>5MiB': 'calls' takes a plain count or a percentage, not 'MiB'"
    );
    assert_eq!(
        err("calls>5%%"),
        "bad --fail-if 'calls>5%%': unexpected '%%' after '5': expected a plain count or a percentage"
    );
    assert_eq!(
        err("bytes>5% extra"),
        "bad --fail-if 'bytes>5% extra': unknown unit '% extra' after '5': expected %, B, KiB, MiB, GiB, KB, MB or GB"
    );
}

// -- report -------------------------------------------------------------

#[test]
fn table_shows_totals_top_stacks_and_the_rest() {
    let base = run(1000, "/tmp", 0);
    let mut new = run(1200, "/tmp", 0);
    new.stacks[1].counts = Counts {
        calls: 90,
        bytes: 368640,
    };
    new.stacks.push(stack(
        "malloc",
        vec![sym("fresh", "/tmp/fixture", 9, 9)],
        1,
        16,
    ));
    new = profile(new.stacks);
    let d = diff(&base, &new);
    assert_eq!(
        render_table(&d, 0),
        "total: calls 1150 -> 1341 (+191, +16.61%), bytes 458100 -> 426756 (-31344, -6.84%)\n\
         \n\
         #1  calls +200 (+20.00%, 1000 -> 1200)  bytes +9600 (+20.00%, 48000 -> 57600)  malloc\n    \
         alloc_small [fixture]\n    \
         main [fixture]\n\
         \n\
         #2  calls -10 (-10.00%, 100 -> 90)  bytes -40960 (-10.00%, 409600 -> 368640)  malloc\n    \
         alloc_big [fixture]\n    \
         main [fixture]\n\
         \n\
         #3  calls +1 (new, 0 -> 1)  bytes +16 (new, 0 -> 16)  malloc\n    \
         fresh [fixture]\n\
         \n\
         1 stack unchanged\n"
    );
    let top1 = render_table(&d, 1);
    assert!(top1.contains("#1  "));
    assert!(!top1.contains("#2"));
    assert!(top1.ends_with(
        "\n\n2 more changed stacks (calls -9, bytes -40944) hidden by --top\n1 stack unchanged\n"
    ));
    assert_eq!(render_table(&d, 3), render_table(&d, 0));
    assert_eq!(render_table(&d, 30), render_table(&d, 0));
}

#[test]
fn table_marks_truncated_and_frameless_stacks() {
    let mut cut = entry("malloc", &["a"], 2, 20);
    cut.truncated = true;
    let d = diff(
        &Profile::default(),
        &profile(vec![cut, entry("calloc", &[], 1, 1)]),
    );
    let t = render_table(&d, 0);
    assert!(t.contains("#1  calls +2 (new, 0 -> 2)  bytes +20 (new, 0 -> 20)  malloc  [stack truncated]\n    a\n"), "{t}");
    assert!(t.contains("calloc\n    [no frames]\n"), "{t}");
}

#[test]
fn long_stacks_are_shortened_in_messages() {
    let deep: Vec<String> = (0..12).map(|i| format!("f{i}")).collect();
    let deep: Vec<&str> = deep.iter().map(String::as_str).collect();
    let mut e = entry("malloc", &deep, 1, 1);
    let key = StackKey::of(&e, None);
    assert_eq!(
        key.chain(),
        "malloc <- f0 <- f1 <- f2 <- f3 <- f4 <- f5 <- f6 <- f7 <- ... (+4 frames)"
    );
    e.frames.truncate(9);
    e.truncated = true;
    assert_eq!(
        StackKey::of(&e, None).chain(),
        "malloc <- f0 <- f1 <- f2 <- f3 <- f4 <- f5 <- f6 <- f7 <- ... (+1 frame) [stack truncated]"
    );
}

// -- differential flame graph -------------------------------------------

#[test]
fn differential_folded_format() {
    let base = profile(vec![
        entry("malloc", &["leaf", "mid", "main"], 10, 100),
        entry("calloc", &["gone", "main"], 4, 0),
        entry("free", &["leaf", "main"], 9, 0),
    ]);
    let mut odd = entry("malloc", &["<[u8; 8] as Foo>::bar", ""], 1, 8);
    Arc::make_mut(&mut odd.frames[0]).module = Some("/lib/a.so".into());
    let mut odd_elsewhere = odd.clone();
    Arc::make_mut(&mut odd_elsewhere.frames[0]).module = Some("/lib/b.so".into());
    let new = profile(vec![
        entry("malloc", &["leaf", "mid", "main"], 12, 96),
        entry("malloc", &["fresh", "main"], 3, 30),
        odd,
        odd_elsewhere,
    ]);
    let d = diff(&base, &new);
    assert_eq!(
        folded::differential(&d, Weight::Calls),
        "[unknown];<[u8: 8] as Foo>::bar;malloc 0 2\n\
         main;fresh;malloc 0 3\n\
         main;gone;calloc 4 0\n\
         main;mid;leaf;malloc 10 12\n"
    );
    // Bytes: the calloc had 0 bytes on both sides and is left out.
    assert_eq!(
        folded::differential(&d, Weight::Bytes),
        "[unknown];<[u8: 8] as Foo>::bar;malloc 0 16\n\
         main;fresh;malloc 0 30\n\
         main;mid;leaf;malloc 100 96\n"
    );
    assert_eq!(folded::differential(&Diff::default(), Weight::Calls), "");
}

#[test]
fn differential_flamegraph_draws_an_svg() -> anyhow::Result<()> {
    let base = run(1000, "/tmp", 0);
    let new = run(1200, "/tmp", 0);
    let folded = folded::differential(&diff(&base, &new), Weight::Calls);
    let svg = flamegraph::render(
        &folded,
        "mtrace diff test",
        Weight::Calls,
        Kind::Differential,
    )?;
    let svg = String::from_utf8(svg)?;
    assert!(svg.contains("<svg"));
    assert!(svg.contains("mtrace diff test"));
    assert!(svg.contains("alloc_small"));
    // The grown allocator frame is titled with its change: +200 of
    // 1350 new calls.
    assert!(
        svg.contains("malloc (1,200 calls, 88.89%; +200 calls, +14.81%)"),
        "{svg}"
    );
    // Red for growth: inferno's color_scale gives r = 255, g = b < 250.
    assert!(svg.contains("fill=\"rgb(255,100,100)\""), "{svg}");
    assert_eq!(
        svg,
        String::from_utf8(flamegraph::render(
            &folded,
            "mtrace diff test",
            Weight::Calls,
            Kind::Differential
        )?)?
    );

    let bytes = flamegraph::render(
        "main;malloc 10 20\n",
        "t",
        Weight::Bytes,
        Kind::Differential,
    )?;
    assert!(String::from_utf8(bytes)?.contains("bytes"));
    Ok(())
}

#[test]
fn differential_flamegraph_refuses_nothing_to_draw() {
    assert!(flamegraph::render("", "t", Weight::Calls, Kind::Differential).is_err());
    assert!(flamegraph::render("\n \n", "t", Weight::Calls, Kind::Differential).is_err());
    let err = flamegraph::render("main;malloc 5 0\n", "t", Weight::Calls, Kind::Differential)
        .unwrap_err();
    assert!(err.to_string().contains("new profile"));
}
