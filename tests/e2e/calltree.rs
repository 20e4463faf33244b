//! The call tree (`--tree`) and the call graph (`--dot`) of the counts
//! fixture: every function's self calls and bytes are its sites' exact
//! counts, children are in order, recursion is 20 levels deep, and the
//! graph's edges out of main carry each site's calls.

use std::{collections::BTreeMap, fs};

use tracer_offline::render::text::bytes;

use crate::{
    support::counts::{COUNTS_SITES, RECURSE_DEPTH},
    support::mtrace::{report, trace_counts},
    support::s,
    support::{Fixture, Profile},
};

/// A line of the tree: depth, total calls, self calls, self bytes (as
/// shown), function.
#[derive(Debug)]
struct TreeLine {
    depth: usize,
    total: u64,
    own: u64,
    own_bytes: String,
    name: String,
}

/// The lines of the tree in `stdout` (after its two heading lines).
fn tree_lines(stdout: &str) -> Vec<TreeLine> {
    let at = stdout.find("call tree, top-down").expect("no call tree");
    let mut lines = stdout[at..].lines();
    assert!(lines.next().unwrap().ends_with("left out)"));
    let head = lines.next().expect("the column heads");
    let name_at = head.find("function").expect("a function column");
    lines
        .take_while(|l| !l.contains(" left out ("))
        .map(|l| {
            let (numbers, name) = l.split_at(name_at);
            let n: Vec<&str> = numbers.split_whitespace().collect();
            // calls share bytes UNIT self-calls self-bytes UNIT
            assert_eq!(n.len(), 7, "{l:?}");
            let depth = name.len() - name.trim_start().len();
            assert_eq!(depth % 2, 0, "{l:?}");
            TreeLine {
                depth: depth / 2,
                total: n[0].parse().expect("calls"),
                own: n[4].parse().expect("self calls"),
                own_bytes: format!("{} {}", n[5], n[6]),
                name: name.trim().to_string(),
            }
        })
        .collect()
}

/// (caller) -> (calls, bytes) summed over the fixture's sites.
fn by_caller() -> BTreeMap<&'static str, (u64, u64)> {
    let mut m = BTreeMap::new();
    for &(_, caller, calls, b) in COUNTS_SITES {
        let e: &mut (u64, u64) = m.entry(caller).or_default();
        e.0 += calls;
        e.1 += b;
    }
    m
}

#[test]
fn call_tree_and_graph_of_the_counts_fixture() {
    let dir = bpf_tempdir!();
    let json = dir.path().join("c.json");
    let dot = dir.path().join("calls.dot");
    let out = trace_counts(
        Fixture::Counts,
        &[
            "--tree",
            "--threshold",
            "0.01",
            "--dot",
            s(&dot),
            "-o",
            s(&json),
        ],
    );
    let d = out.describe();
    let p = Profile::load(&json);
    let tree = tree_lines(&out.stdout);

    // Each caller's self is its sites' exact calls and bytes.
    for (caller, (calls, b)) in by_caller() {
        let nodes: Vec<&TreeLine> = tree.iter().filter(|l| l.name == caller).collect();
        assert_eq!(nodes.len(), 1, "{caller}\n{d}");
        assert_eq!(
            (nodes[0].own, &nodes[0].own_bytes),
            (calls, &bytes(b)),
            "{d}"
        );
        assert_eq!(nodes[0].total, calls, "{caller}: a leaf\n{d}");
    }
    // The roots hold every call, and nothing was left out.
    let roots: u64 = tree.iter().filter(|l| l.depth == 0).map(|l| l.total).sum();
    assert_eq!(roots, p.total().0, "{d}");
    assert!(!out.stdout.contains("smaller node"), "{d}");
    // Children in descending order of calls; a parent holds its children.
    for (i, line) in tree.iter().enumerate() {
        let children: Vec<&TreeLine> = tree[i + 1..]
            .iter()
            .take_while(|l| l.depth > line.depth)
            .filter(|l| l.depth == line.depth + 1)
            .collect();
        let totals: Vec<u64> = children.iter().map(|c| c.total).collect();
        assert!(totals.windows(2).all(|w| w[0] >= w[1]), "{totals:?}\n{d}");
        if !children.is_empty() {
            assert_eq!(line.total, totals.iter().sum::<u64>() + line.own, "{d}");
        }
    }
    // recurse(20): 20 nested recurse nodes, leaf_alloc under the last.
    let main = tree.iter().find(|l| l.name == "main").expect("main");
    let leaf = tree.iter().find(|l| l.name == "leaf_alloc").expect("leaf");
    assert_eq!(leaf.depth, main.depth + RECURSE_DEPTH + 1, "{d}");
    assert_eq!(
        tree.iter().filter(|l| l.name == "recurse").count(),
        RECURSE_DEPTH
    );

    // The graph, by calls: each caller's self, and main's edges.
    let g = Dot::parse(&fs::read_to_string(&dot).expect("the dot file"));
    for (caller, (calls, _)) in by_caller() {
        assert_eq!(
            g.own(caller),
            format!("{calls} call{}", if calls == 1 { "" } else { "s" })
        );
        let from = if caller == "leaf_alloc" {
            "recurse"
        } else {
            "main"
        };
        assert_eq!(g.edge(from, caller), calls, "{from} -> {caller}");
    }
    assert_eq!(g.edge("main", "recurse"), 5);
    assert_eq!(g.edge("recurse", "recurse"), 5);

    // By bytes, from the saved profile.
    let by_bytes = dir.path().join("bytes.dot");
    report(&[
        s(&json),
        "--dot",
        s(&by_bytes),
        "--weight",
        "bytes",
        "--threshold",
        "0.01",
    ]);
    let g = Dot::parse(&fs::read_to_string(&by_bytes).expect("the dot file"));
    for (caller, (_, b)) in by_caller() {
        assert_eq!(g.own(caller), bytes(b), "{caller}");
        let from = if caller == "leaf_alloc" {
            "recurse"
        } else {
            "main"
        };
        assert_eq!(g.edge(from, caller), b, "{from} -> {caller}");
    }
}

/// The nodes and edges of mtrace's dot file.
struct Dot {
    /// name -> (id, label).
    nodes: BTreeMap<String, (String, String)>,
    /// (from id, to id) -> weight.
    edges: BTreeMap<(String, String), u64>,
}

impl Dot {
    fn parse(text: &str) -> Dot {
        assert!(text.starts_with("digraph mtrace {\n") && text.ends_with("}\n"));
        let attr = |line: &str, key: &str| -> String {
            let at = line
                .find(&format!("{key}="))
                .unwrap_or_else(|| panic!("{key} in {line}"));
            let rest = &line[at + key.len() + 1..];
            if let Some(q) = rest.strip_prefix('"') {
                let end = q
                    .find("\", ")
                    .or_else(|| q.find("\"]"))
                    .expect("a closing quote");
                q[..end].to_string()
            } else {
                rest.split([',', ']']).next().unwrap().to_string()
            }
        };
        let mut nodes = BTreeMap::new();
        let mut edges = BTreeMap::new();
        for line in text.lines().map(str::trim) {
            if let Some((from, rest)) = line.split_once(" -> ") {
                let to = rest.split_whitespace().next().unwrap().to_string();
                let w = attr(line, "weight").parse().expect("a weight");
                assert!(edges.insert((from.to_string(), to), w).is_none(), "{line}");
            } else if line.starts_with('n') && line.contains(" [label=") {
                let id = line.split_whitespace().next().unwrap().to_string();
                nodes.insert(attr(line, "tooltip"), (id, attr(line, "label")));
            }
        }
        Dot { nodes, edges }
    }

    /// The self amount of `name`'s label: `self AMOUNT (P%)`.
    fn own(&self, name: &str) -> String {
        let (_, label) = &self.nodes[name];
        let line = label.split("\\n").nth(1).expect("a self line");
        let amount = line.strip_prefix("self ").expect("self");
        amount.rsplit_once(" (").expect("a share").0.to_string()
    }

    fn edge(&self, from: &str, to: &str) -> u64 {
        let id = |n: &str| {
            self.nodes
                .get(n)
                .unwrap_or_else(|| panic!("no node {n}"))
                .0
                .clone()
        };
        self.edges[&(id(from), id(to))]
    }
}
