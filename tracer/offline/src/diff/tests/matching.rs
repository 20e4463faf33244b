//! How stacks are matched across runs and builds: what is left out of a
//! stack's key (addresses, lines, threads, directories), frames without
//! names, Python frames named in one run only, and what still tells two
//! stacks apart.

use super::*;

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
