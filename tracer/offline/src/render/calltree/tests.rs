//! The call tree's and the call graph's tests: totals and self per node,
//! the text by calls and by bytes, deep and wide trees, the graph's
//! weights and its `dot` text.

use super::super::test_util::{entry, profile};
use super::tree::MAX_INDENT;
use super::*;
use crate::profile::{Counts, Profile};
use crate::render::{SortKey, StackWeight};

/// main -> a -> malloc (10 calls, 100 bytes), main -> a -> b -> malloc
/// (5, 5000), main -> c -> calloc (1, 1), and a thread's start -> w.
fn sample() -> Profile {
    profile(vec![
        entry("malloc", &["a", "main", "_start"], 10, 100),
        entry("malloc", &["b", "a", "main", "_start"], 5, 5000),
        entry("calloc", &["c", "main", "_start"], 1, 1),
        entry("malloc", &["w", "start_thread"], 4, 40),
        entry("free", &["a", "main", "_start"], 99, 0),
    ])
}

#[test]
fn totals_and_self_per_node() {
    let p = sample();
    let tree = build(&p);
    let root = tree.root();
    assert_eq!(
        root.total,
        Counts {
            calls: 20,
            bytes: 5141
        }
    );
    let start = tree.child(root, "_start").unwrap();
    let main = tree.child(start, "main").unwrap();
    assert_eq!(
        main.total,
        Counts {
            calls: 16,
            bytes: 5101
        }
    );
    assert_eq!(main.own, Counts::default());
    let a = tree.child(main, "a").unwrap();
    assert_eq!(
        a.total,
        Counts {
            calls: 15,
            bytes: 5100
        }
    );
    assert_eq!(
        a.own,
        Counts {
            calls: 10,
            bytes: 100
        }
    );
}

#[test]
fn tree_text_by_calls_and_by_bytes() {
    let text = render_tree(&sample(), SortKey::Calls, 0.0);
    let expected = "\
call tree, top-down (nodes under 1% of calls left out)
    calls  share       bytes  self calls   self bytes  function
       16  80.0%     5.0 KiB           0          0 B  _start
       16  80.0%     5.0 KiB           0          0 B    main
       15  75.0%     5.0 KiB          10        100 B      a
        5  25.0%     4.9 KiB           5      4.9 KiB        b
        1   5.0%         1 B           1          1 B      c
        4  20.0%        40 B           0          0 B  start_thread
        4  20.0%        40 B           4         40 B    w
";
    assert_eq!(text, expected);
    // By bytes, over 1%: c (1 byte) and start_thread (40) are left
    // out, and said so.
    let text = render_tree(&sample(), SortKey::Bytes, 0.0);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].ends_with("(nodes under 1% of bytes left out)"));
    assert!(
        lines[2].ends_with("  _start") && lines[2].contains(" 99.2%"),
        "{text}"
    );
    assert!(!text.contains("  c\n"), "{text}");
    assert_eq!(
        lines.last().copied(),
        Some("2 smaller nodes left out (5 calls, 41 B; --threshold to change)")
    );
    // A higher threshold prunes more, a lower one less.
    let text = render_tree(&sample(), SortKey::Calls, 50.0);
    assert!(
        !text.contains("start_thread") && text.contains("    a\n"),
        "{text}"
    );
    let text = render_tree(&sample(), SortKey::Bytes, 0.01);
    assert!(
        text.contains("      c\n") && !text.contains("left out ("),
        "{text}"
    );
}

#[test]
fn deep_trees_stop_indenting() {
    let names: Vec<String> = (0..40).map(|i| format!("f{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let text = render_tree(
        &profile(vec![entry("malloc", &refs, 1, 1)]),
        SortKey::Calls,
        0.0,
    );
    let last = text.lines().last().unwrap();
    assert!(
        last.ends_with(&format!("{}[39] f0", "  ".repeat(MAX_INDENT))),
        "{last}"
    );
}

#[test]
fn a_stack_of_100k_frames_is_written_whole() {
    let p = crate::profile::synthetic::one_deep_stack(100_000);
    let text = render_tree(&p, SortKey::Calls, 0.0);
    assert_eq!(text.lines().count(), 2 + 100_000);
    let last = text.lines().last().unwrap();
    assert!(last.ends_with("[99999] f0"), "{last}");
    // The tree is dropped without recursing, too.
    assert_eq!(build(&p).nodes.len(), 1 + 100_000);
}

#[test]
fn a_node_of_100k_children() {
    let p = crate::profile::synthetic::siblings(100_000);
    let tree = build(&p);
    let main = tree.child(tree.root(), "main").unwrap();
    assert_eq!(main.children.len(), 100_000);
    assert_eq!(main.total.calls, 100_000);
    let text = render_tree(&p, SortKey::Calls, 0.0);
    assert!(
        text.ends_with(
            "100000 smaller nodes left out (100000 calls, 781.2 KiB; --threshold to change)\n"
        ),
        "{text}"
    );
    let text = render_tree(&p, SortKey::Calls, 0.0001);
    assert_eq!(text.lines().count(), 3 + 100_000);
}

#[test]
fn graph_weights_functions_and_edges() {
    let g = graph(&sample(), StackWeight::Calls);
    assert_eq!(g.all, 20);
    assert_eq!(g.funcs["a"], FuncWeight { own: 10, total: 15 });
    assert_eq!(g.funcs["main"], FuncWeight { own: 0, total: 16 });
    assert_eq!(g.edges[&("main".into(), "a".into())], 15);
    assert_eq!(g.edges[&("a".into(), "b".into())], 5);
    // Recursion counts a stack once per function and per edge.
    let rec = profile(vec![entry("malloc", &["r", "r", "r", "main"], 3, 3)]);
    let g = graph(&rec, StackWeight::Calls);
    assert_eq!(g.funcs["r"], FuncWeight { own: 3, total: 3 });
    assert_eq!(g.edges[&("r".into(), "r".into())], 3);
    let g = graph(&sample(), StackWeight::Bytes);
    assert_eq!(
        g.funcs["b"],
        FuncWeight {
            own: 5000,
            total: 5000
        }
    );
}

#[test]
fn dot_text() {
    let mut p = sample();
    p.meta.command = "./app \"x\"".into();
    let dot = render_dot(&p, StackWeight::Calls, 0.0);
    assert!(dot.starts_with("digraph mtrace {\n") && dot.ends_with("}\n"));
    assert!(dot.contains("label=\"mtrace: ./app \\\"x\\\" (pid 0)\\n20 calls in all (calls)"));
    // Nodes in name order: _start, a, b, c, main, start_thread, w.
    assert!(
        dot.contains(
            "  n1 [label=\"a\\nself 10 calls (50.0%)\\ntotal 15 calls (75.0%)\", tooltip=\"a\", \
             fillcolor=\"#e79090\", fontsize=17];"
        ),
        "{dot}"
    );
    assert!(
        dot.contains("  n4 -> n1 [label=\"15 calls\", weight=15, penwidth=4.75];"),
        "{dot}"
    );
    assert!(dot.contains("fillcolor=\"#f8f8f8\""), "{dot}");
    // Bytes: c (1 byte of 5141), start_thread and w (40 bytes) are
    // under 1%: they and their edges are gone.
    let dot = render_dot(&p, StackWeight::Bytes, 0.0);
    for gone in ["c", "w", "start_thread"] {
        assert!(!dot.contains(&format!("tooltip=\"{gone}\"")), "{dot}");
    }
    assert!(dot.contains("  n1 -> n2 [label=\"4.9 KiB\", weight=5000, penwidth=4.92];"));
    assert_eq!(dot.matches(" -> ").count(), 3, "{dot}");
}
