//! Allocations by test and by group: a profile's stacks summed under
//! names, without touching the traced code.
//!
//! - **Tests** ([`tests`]), a built-in preset: each stack belongs to at
//!   most one test, found among its frames. A Rust test's is the frame
//!   libtest's `__rust_begin_short_backtrace` calls (past `core`, `std`
//!   and `test` frames): `crate::tests::name::{{closure}}`, named
//!   `tests::name` as libtest names it (read from the frames, not from the
//!   thread's name, which the kernel cuts to 15 characters, and which a
//!   run with `--test-threads=1` does not have). A pytest test's is the
//!   Python frame `pytest_pyfunc_call` calls, named `file.py::name`
//!   (`file.py::Class::name` for a method) as pytest names it. A
//!   GoogleTest test's is the frame of its `Suite_Name_Test::TestBody`,
//!   named `Suite_Name` (the class, without `_Test`). Allocations of a
//!   test's fixtures and of the harness between tests are in no test.
//! - **Groups** ([`Rule`], [`groups`]): a user's rules `NAME=PATTERN`,
//!   where the pattern is matched against every frame's function
//!   (`myapp::parser::*`), or with `thread:` in front against the thread's
//!   name (of a profile split per thread). A stack counts in every group
//!   one of whose rules matches it, once however many of its frames
//!   match: a group's figures include everything called under it (the
//!   parser's allocations include those of the JSON library it calls),
//!   and groups may overlap, so they need not add up to the total.
//!
//! A pattern is a glob on the whole name: `*` stands for any run of
//! characters, every other character for itself (function names are full
//! of `<`, `(`, `.`, `[` and `+`, which a regular expression would read).

use std::{borrow::Cow, collections::BTreeMap};

use serde::{Deserialize, Serialize};

use super::{is_allocation, is_go_heap, short_path, Counts, Frame, Profile, StackEntry};

/// One test's or group's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupTotals {
    pub name: String,
    /// Allocating calls and their requested bytes.
    #[serde(flatten)]
    pub counts: Counts,
    /// Live mode: what became of its blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<GroupLive>,
}

/// Live mode: a test's or group's blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLive {
    /// Tracked allocations that succeeded, and of those the ones freed.
    pub allocations: u64,
    pub frees: u64,
    /// Blocks still allocated when tracing ended, and their bytes.
    pub outstanding: u64,
    pub outstanding_bytes: u64,
}

impl GroupTotals {
    fn add(&mut self, entry: &StackEntry) {
        self.counts.add(entry.counts);
        if let Some(l) = &entry.live {
            let live = self.live.get_or_insert_with(GroupLive::default);
            live.allocations += l.allocations;
            live.frees += l.frees;
            live.outstanding += l.outstanding;
            live.outstanding_bytes += l.outstanding_bytes;
        }
    }
}

/// What a rule's pattern is matched against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Every frame's function.
    Frame,
    /// The thread's name.
    Thread,
}

/// A `--group NAME=PATTERN` rule.
#[derive(Clone, Debug)]
pub struct Rule {
    pub name: String,
    pub target: Target,
    /// As written, after `thread:`.
    pub pattern: String,
    glob: regex::Regex,
}

impl PartialEq for Rule {
    fn eq(&self, o: &Rule) -> bool {
        (&self.name, self.target, &self.pattern) == (&o.name, o.target, &o.pattern)
    }
}

impl Rule {
    /// Parses `NAME=PATTERN` or `NAME=thread:PATTERN`.
    pub fn parse(text: &str) -> Result<Rule, String> {
        let bad = |why: &str| format!("bad --group '{text}': {why}");
        let (name, pattern) = text
            .split_once('=')
            .ok_or_else(|| bad("expected NAME=PATTERN, e.g. 'parser=myapp::parser::*'"))?;
        let name = name.trim();
        if name.is_empty() {
            return Err(bad("the group's name is empty"));
        }
        let (target, pattern) = match pattern.strip_prefix("thread:") {
            Some(p) => (Target::Thread, p),
            None => (Target::Frame, pattern),
        };
        if pattern.is_empty() {
            return Err(bad("the pattern is empty"));
        }
        let glob = pattern
            .split('*')
            .map(regex::escape)
            .collect::<Vec<_>>()
            .join(".*");
        let glob = regex::Regex::new(&format!("^(?s:{glob})$")).map_err(|e| bad(&e.to_string()))?;
        Ok(Rule {
            name: name.to_string(),
            target,
            pattern: pattern.to_string(),
            glob,
        })
    }

    /// Whether the rule matches `entry`.
    pub fn matches(&self, entry: &StackEntry) -> bool {
        match self.target {
            Target::Frame => entry.frames.iter().any(|f| self.glob.is_match(&f.function)),
            Target::Thread => entry
                .thread
                .as_ref()
                .is_some_and(|t| self.glob.is_match(&t.name)),
        }
    }
}

/// `profile` with its tests (`per_test`) and its groups by `rules` (when
/// there are any) summed anew; otherwise as it is, with the figures it was
/// saved with, if any.
pub fn apply<'a>(profile: &'a Profile, per_test: bool, rules: &[Rule]) -> Cow<'a, Profile> {
    if !per_test && rules.is_empty() {
        return Cow::Borrowed(profile);
    }
    let mut grouped = profile.clone();
    if per_test {
        grouped.tests = tests(profile);
    }
    if !rules.is_empty() {
        grouped.groups = groups(profile, rules);
    }
    Cow::Owned(grouped)
}

/// The rows that count allocations: every stack but frees and Go heap
/// rows (which are estimates of another heap).
fn allocations(profile: &Profile) -> impl Iterator<Item = &StackEntry> {
    profile
        .stacks
        .iter()
        .filter(|e| is_allocation(e) && !is_go_heap(e))
}

/// Each group's figures, in the order the groups are first named by
/// `rules` (a group named by several rules is one group: a stack any of
/// them matches counts once). A group nothing matched has a row of zeros.
pub fn groups(profile: &Profile, rules: &[Rule]) -> Vec<GroupTotals> {
    let mut out: Vec<GroupTotals> = Vec::new();
    for rule in rules {
        if !out.iter().any(|g| g.name == rule.name) {
            out.push(GroupTotals {
                name: rule.name.clone(),
                ..GroupTotals::default()
            });
        }
    }
    for entry in allocations(profile) {
        for group in &mut out {
            if rules
                .iter()
                .any(|r| r.name == group.name && r.matches(entry))
            {
                group.add(entry);
            }
        }
    }
    out
}

/// Each thread's figures (of a profile split per thread), named `NAME
/// (TID)`, by tid; stacks of no thread are left out.
pub fn threads(profile: &Profile) -> Vec<GroupTotals> {
    let mut by_thread: BTreeMap<(u32, &str), GroupTotals> = BTreeMap::new();
    for entry in allocations(profile) {
        if let Some(t) = &entry.thread {
            by_thread
                .entry((t.tid, &t.name))
                .or_insert_with(|| GroupTotals {
                    name: format!("{} ({})", t.name, t.tid),
                    ..GroupTotals::default()
                })
                .add(entry);
        }
    }
    by_thread.into_values().collect()
}

/// Each test's figures, by name.
pub fn tests(profile: &Profile) -> Vec<GroupTotals> {
    let mut by_name: BTreeMap<String, GroupTotals> = BTreeMap::new();
    for entry in allocations(profile) {
        if let Some(name) = test_of(&entry.frames) {
            by_name
                .entry(name.clone())
                .or_insert_with(|| GroupTotals {
                    name,
                    ..GroupTotals::default()
                })
                .add(entry);
        }
    }
    by_name.into_values().collect()
}

/// The calls and bytes of `profile` in no test of `tests`.
pub fn outside(profile: &Profile, tests: &[GroupTotals]) -> Counts {
    let mut inside = Counts::default();
    for t in tests {
        inside.add(t.counts);
    }
    let mut all = Counts::default();
    for e in allocations(profile) {
        all.add(e.counts);
    }
    Counts {
        calls: all.calls.saturating_sub(inside.calls),
        bytes: all.bytes.saturating_sub(inside.bytes),
    }
}

/// The test a stack (innermost frame first) runs in, if any.
pub fn test_of(frames: &[std::sync::Arc<Frame>]) -> Option<String> {
    rust_test(frames)
        .or_else(|| pytest_test(frames))
        .or_else(|| gtest_test(frames))
}

/// The frame libtest calls each test's function from.
const LIBTEST_RUNNER: &str = "test::__rust_begin_short_backtrace";

/// Namespaces of the frames between libtest's runner and a test's own.
const RUST_RUNTIME: [&str; 5] = ["core::", "std::", "alloc::", "test::", "<"];

fn rust_test(frames: &[std::sync::Arc<Frame>]) -> Option<String> {
    let runner = frames
        .iter()
        .rposition(|f| f.function.starts_with(LIBTEST_RUNNER))?;
    let own = frames[..runner]
        .iter()
        .rev()
        .find(|f| !RUST_RUNTIME.iter().any(|p| f.function.starts_with(p)))?;
    let mut name = own.function.as_str();
    // The test's closure (`tests::name::{{closure}}` or `{closure#0}`),
    // and generic arguments, are not part of its name.
    for suffix in ["::{{closure}}", "::{closure#0}"] {
        name = name.strip_suffix(suffix).unwrap_or(name);
    }
    if let Some(i) = name.find("::<") {
        name = &name[..i];
    }
    // libtest names a test by its path without the crate's name.
    Some(match name.split_once("::") {
        Some((_, path)) => path.to_string(),
        None => name.to_string(),
    })
}

/// The pytest function that calls each test's function.
const PYTEST_CALLER: &str = "pytest_pyfunc_call";

fn is_python(f: &Frame) -> bool {
    f.file.as_deref().is_some_and(|p| p.ends_with(".py"))
}

fn pytest_test(frames: &[std::sync::Arc<Frame>]) -> Option<String> {
    let caller = frames.iter().rposition(|f| {
        f.function == PYTEST_CALLER
            && f.file
                .as_deref()
                .is_some_and(|p| p.ends_with("_pytest/python.py"))
    })?;
    let own = frames[..caller].iter().rev().find(|f| is_python(f))?;
    let file = short_path(own.file.as_deref()?);
    Some(format!("{file}::{}", own.function.replace('.', "::")))
}

fn gtest_test(frames: &[std::sync::Arc<Frame>]) -> Option<String> {
    frames.iter().rev().find_map(|f| {
        let name = f.function.split('(').next()?;
        let class = name.strip_suffix("::TestBody")?;
        let class = class.rsplit("::").next().unwrap_or(class);
        Some(class.strip_suffix("_Test").unwrap_or(class).to_string())
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::profile::{LiveStats, Thread};

    fn frame(function: &str, file: Option<&str>) -> Arc<Frame> {
        Arc::new(Frame {
            function: function.into(),
            file: file.map(str::to_string),
            ..Frame::default()
        })
    }

    fn entry(func: &str, frames: Vec<Arc<Frame>>, calls: u64, bytes: u64) -> StackEntry {
        StackEntry {
            func: func.into(),
            frames,
            counts: Counts { calls, bytes },
            ..StackEntry::default()
        }
    }

    /// A stack of a libtest test, as a debug build's frames read.
    fn rust_stack(test: &str) -> Vec<Arc<Frame>> {
        vec![
            frame("alloc::alloc::alloc", None),
            frame("alloc::boxed::Box<T>::new", None),
            frame("rusttests::tests::boxes", None),
            frame(&format!("rusttests::tests::{test}"), None),
            frame(&format!("rusttests::tests::{test}::{{{{closure}}}}"), None),
            frame("core::ops::function::FnOnce::call_once", None),
            frame(
                "<fn() -> core::result::Result<(), alloc::string::String> as core::ops::function::FnOnce<()>>::call_once",
                None,
            ),
            frame(
                "test::__rust_begin_short_backtrace::<core::result::Result<(), alloc::string::String>, fn() -> core::result::Result<(), alloc::string::String>>",
                None,
            ),
            frame("test::run_test::{closure#0}", None),
            frame("std::sys::backtrace::__rust_begin_short_backtrace", None),
            frame("start_thread", None),
        ]
    }

    #[test]
    fn a_rust_test_is_named_as_libtest_names_it() {
        assert_eq!(
            test_of(&rust_stack("allocates_one_thousand_boxes")).as_deref(),
            Some("tests::allocates_one_thousand_boxes")
        );
        // The harness's own stacks (main, the runner) are in no test.
        let harness = vec![
            frame("alloc::vec::Vec<T>::push", None),
            frame("test::run_test::{closure#0}", None),
            frame("std::sys::backtrace::__rust_begin_short_backtrace", None),
        ];
        assert_eq!(test_of(&harness), None);
    }

    #[test]
    fn a_pytest_test_is_named_as_pytest_names_it() {
        let stack = |own: &str| {
            vec![
                frame("PyList_Append", None),
                frame("helper", Some("/t/test_mod.py")),
                frame(own, Some("/t/test_mod.py")),
                frame("_PyObject_Call", None),
                frame(
                    "pytest_pyfunc_call",
                    Some("/usr/lib/python3/dist-packages/_pytest/python.py"),
                ),
                frame(
                    "_multicall",
                    Some("/usr/lib/python3/dist-packages/pluggy/_callers.py"),
                ),
            ]
        };
        assert_eq!(
            test_of(&stack("test_parse")).as_deref(),
            Some("test_mod.py::test_parse")
        );
        assert_eq!(
            test_of(&stack("TestParser.test_parse")).as_deref(),
            Some("test_mod.py::TestParser::test_parse")
        );
        // A function of that name elsewhere is not pytest's.
        let elsewhere = vec![
            frame("test_parse", Some("/t/test_mod.py")),
            frame("pytest_pyfunc_call", Some("/t/mine.py")),
        ];
        assert_eq!(test_of(&elsewhere), None);
    }

    #[test]
    fn a_googletest_test_is_its_class() {
        let stack = vec![
            frame("operator new(unsigned long)", None),
            frame("ParserTest_ParsesNumbers_Test::TestBody()", None),
            frame("testing::Test::Run()", None),
        ];
        assert_eq!(test_of(&stack).as_deref(), Some("ParserTest_ParsesNumbers"));
    }

    #[test]
    fn tests_sum_their_stacks_and_leave_out_frees() {
        let mut p = Profile {
            stacks: vec![
                entry("malloc", rust_stack("a"), 1000, 8000),
                entry("malloc", rust_stack("a"), 1, 8000),
                entry("malloc", rust_stack("b"), 5, 40),
                entry("free", rust_stack("b"), 7, 0),
                entry("malloc", vec![frame("main", None)], 3, 30),
            ],
            ..Profile::default()
        };
        p.stacks[2].live = Some(LiveStats {
            allocations: 5,
            frees: 4,
            outstanding: 1,
            outstanding_bytes: 8,
            ..LiveStats::default()
        });
        let t = tests(&p);
        assert_eq!(
            t.iter()
                .map(|t| (t.name.as_str(), t.counts.calls, t.counts.bytes))
                .collect::<Vec<_>>(),
            [("tests::a", 1001, 16000), ("tests::b", 5, 40)]
        );
        assert_eq!(t[0].live, None);
        assert_eq!(
            t[1].live,
            Some(GroupLive {
                allocations: 5,
                frees: 4,
                outstanding: 1,
                outstanding_bytes: 8
            })
        );
        assert_eq!(
            outside(&p, &t),
            Counts {
                calls: 3,
                bytes: 30
            }
        );
    }

    #[test]
    fn rules_parse_or_say_why_not() {
        let r = Rule::parse("parser=myapp::parser::*").unwrap();
        assert_eq!((r.name.as_str(), r.target), ("parser", Target::Frame));
        let r = Rule::parse("io=thread:io-*").unwrap();
        assert_eq!((r.pattern.as_str(), r.target), ("io-*", Target::Thread));
        for (bad, why) in [
            ("parser", "expected NAME=PATTERN"),
            ("=x", "name is empty"),
            ("p=", "pattern is empty"),
            ("p=thread:", "pattern is empty"),
        ] {
            let e = Rule::parse(bad).unwrap_err();
            assert!(e.starts_with(&format!("bad --group '{bad}': ")), "{e}");
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn a_glob_matches_the_whole_name_and_nothing_else_is_special() {
        let r = Rule::parse("g=<*>::parse(*").unwrap();
        let e = |f: &str| entry("malloc", vec![frame(f, None)], 1, 1);
        assert!(r.matches(&e("<Vec<u8> as Parser>::parse(int)")));
        assert!(!r.matches(&e("x<Vec<u8> as Parser>::parse(int)")));
        let r = Rule::parse("g=a.b").unwrap();
        assert!(r.matches(&e("a.b")));
        assert!(!r.matches(&e("axb")));
    }

    #[test]
    fn groups_overlap_count_a_stack_once_and_keep_their_order() {
        let parse = frame("app::parser::parse", None);
        let json = frame("serde_json::from_str", None);
        let mut p = Profile {
            stacks: vec![
                // The parser calls the JSON library: in both groups.
                entry("malloc", vec![json.clone(), parse.clone()], 10, 100),
                entry("malloc", vec![parse.clone(), parse.clone()], 1, 1),
                entry("malloc", vec![json], 2, 20),
                entry("malloc", vec![frame("main", None)], 5, 5),
            ],
            ..Profile::default()
        };
        p.stacks[3].thread = Some(Thread {
            tid: 7,
            name: "io-worker".into(),
        });
        let rules: Vec<Rule> = [
            "parser=app::parser::*",
            "json=serde_json::*",
            "io=thread:io-*",
            // A second rule of the parser's: a stack both match counts once.
            "parser=*::parse",
            "none=nothing",
        ]
        .iter()
        .map(|r| Rule::parse(r).unwrap())
        .collect();
        let g = groups(&p, &rules);
        assert_eq!(
            g.iter()
                .map(|g| (g.name.as_str(), g.counts.calls, g.counts.bytes))
                .collect::<Vec<_>>(),
            [
                ("parser", 11, 101),
                ("json", 12, 120),
                ("io", 5, 5),
                ("none", 0, 0)
            ]
        );
    }
}
