//! The diff as a person reads it: the table of totals and top stacks,
//! stacks shortened in messages, and the differential folded stacks and
//! flame graph.

use super::*;

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
