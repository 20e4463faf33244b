//! The text pieces' tests: folded templates, printable names, sizes,
//! durations, counts, wrapped lists and colour.

use super::*;
use crate::profile::{Frame, Profile};
use std::{borrow::Cow, sync::Arc};

/// The arrow of a Rust function type closes no generic.
#[test]
fn a_rust_fn_arrow_is_not_a_bracket() {
    let name = "<fn() -> core::result::Result<(), alloc::string::String> as core::ops::function::FnOnce<()>>::call_once";
    assert_eq!(
        fold_templates(name, 90),
        "<fn() -> core::result::Result<…> as core::ops::function::FnOnce<…>>::call_once"
    );
    assert_eq!(fold_templates(name, 20), "<…>::call_once");
}

#[test]
fn long_template_names_fold_innermost_first() {
    let name = "std::vector<std::pair<int, long>, std::allocator<std::pair<int, long> > >::_M_realloc_insert<std::pair<int, long> const&>";
    assert_eq!(fold_templates(name, 200), name);
    assert_eq!(
            fold_templates(name, 98),
            "std::vector<std::pair<…>, std::allocator<std::pair<…> > >::_M_realloc_insert<std::pair<…> const&>"
        );
    assert_eq!(
        fold_templates(name, 70),
        "std::vector<std::pair<…>, std::allocator<…> >::_M_realloc_insert<…>"
    );
    assert_eq!(
        fold_templates(name, 10),
        "std::vector<…>::_M_realloc_insert<…>"
    );
    // Operators are not brackets.
    assert_eq!(
        fold_templates("bool operator< <Foo<int> >(Foo<int> const&)", 34),
        "bool operator< <Foo<int> >(…)"
    );
    assert_eq!(
        fold_templates("Node::operator->() const", 5),
        "Node::operator->() const"
    );
}

#[test]
fn names_from_the_target_cannot_drive_the_terminal() {
    assert_eq!(printable("malloc"), Cow::Borrowed("malloc"));
    assert_eq!(
        printable("a\x1b]0;owned\x07b\rc\u{202e}d"),
        "a\\u{1b}]0;owned\\u{7}b\\u{d}c\\u{202e}d"
    );
    let mut p = Profile::default();
    p.meta.command = "./x \x1b[2J".into();
    p.stacks.push(crate::profile::StackEntry {
        func: "malloc".into(),
        frames: vec![Arc::new(Frame {
            function: "f\x1b[31m".into(),
            ..Frame::default()
        })],
        thread: Some(crate::profile::Thread {
            tid: 1,
            name: "t\x07".into(),
        }),
        ..Default::default()
    });
    let clean = printable_profile(&p);
    assert!(matches!(clean, Cow::Owned(_)));
    assert_eq!(clean.meta.command, "./x \\u{1b}[2J");
    assert_eq!(clean.stacks[0].frames[0].function, "f\\u{1b}[31m");
    assert_eq!(clean.stacks[0].thread.as_ref().unwrap().name, "t\\u{7}");
    p.meta.command = "./x".into();
    p.stacks.clear();
    assert!(matches!(printable_profile(&p), Cow::Borrowed(_)));
}

#[test]
fn sizes_in_binary_units() {
    let cases = [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (48_000, "46.9 KiB"),
        (16_384, "16.0 KiB"),
        (1 << 20, "1.0 MiB"),
        (3 * (1 << 20) + (1 << 19), "3.5 MiB"),
        ((1 << 30) * 3 / 2, "1.5 GiB"),
        (1 << 63, "8.0 EiB"),
        (u64::MAX, "16.0 EiB"),
    ];
    for (n, want) in cases {
        assert_eq!(bytes(n), want, "{n}");
    }
}

#[test]
fn durations() {
    assert_eq!(duration_ns(999), "999ns");
    assert_eq!(duration_ns(1_300), "1.3us");
    assert_eq!(duration_ns(250_000_000), "250.0ms");
    assert_eq!(duration_ns(2_500_000_000), "2.50s");
}

#[test]
fn digits_grouped_and_counts_shortened() {
    assert_eq!(thousands(0), "0");
    assert_eq!(thousands(100), "100");
    assert_eq!(thousands(1_234_567), "1,234,567");
    assert_eq!(short_count(950.0), "950");
    assert_eq!(short_count(98_100.0), "98.1k");
    assert_eq!(short_count(12_300_000.0), "12.3M");
    assert_eq!(short_count(4e9), "4.0G");
}

#[test]
fn singular_and_plural() {
    assert_eq!(count(0, "call"), "0 calls");
    assert_eq!(count(1, "call"), "1 call");
    assert_eq!(count(2, "block"), "2 blocks");
}

#[test]
fn lists_wrap_at_80_columns_with_the_label_repeated() {
    let items: Vec<String> = (0..12).map(|i| format!("item number {i}")).collect();
    let text = wrap_list("lost", &items, "none");
    for line in text.lines() {
        assert!(line.len() <= WIDTH, "{line:?}");
        assert!(line.starts_with("lost: "), "{line:?}");
    }
    let joined = text
        .lines()
        .map(|l| &l["lost: ".len()..])
        .collect::<Vec<_>>()
        .join(" ");
    assert_eq!(joined.split(", ").collect::<Vec<_>>(), items);
    assert_eq!(wrap_list("x", &[], "none"), "x: none\n");
    assert_eq!(wrap_list("x", &["a".into(), "b".into()], ""), "x: a, b\n");
}

#[test]
fn words_wrap_at_80_columns_with_the_label_repeated() {
    let words: Vec<String> = (0..40).map(|i| format!("word{i}")).collect();
    let text = wrap_words("scope", &words);
    assert!(text.lines().count() > 1, "{text}");
    for line in text.lines() {
        assert!(
            line.len() <= WIDTH && line.starts_with("scope: "),
            "{line:?}"
        );
    }
    let joined: Vec<&str> = text
        .lines()
        .flat_map(|l| l["scope: ".len()..].split(' '))
        .collect();
    assert_eq!(joined, words);
}

#[test]
fn paint_is_plain_when_off() {
    assert_eq!(Paint::new(false).strong("a"), "a");
    assert_eq!(Paint::new(true).strong("a"), "\u{1b}[1ma\u{1b}[0m");
    assert_eq!(Paint::new(true).warn(""), "");
}
