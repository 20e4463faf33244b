//! What changed between two profiles, in the totals and stack by stack:
//! new and gone stacks, entries summed, the rows' order, percentages at
//! their edges, and the gate's verdict on each.

use super::*;

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
