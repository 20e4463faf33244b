//! The JSON profile written by `mtrace -o FILE.json`: loaded, validated
//! against tracer/schema/profile.schema.json, and queried. This is what the
//! tests assert on; the human table has tests of its own (tests/e2e/table.rs).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
};

use serde::{de::DeserializeOwned, Deserialize};
use serde_json::Value;

/// `tracer/schema/NAME`.
fn schema_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("schema")
        .join(name)
}

/// Loads the JSON document at `path` and asserts that it validates
/// against `tracer/schema/SCHEMA` (listing every error).
pub fn validate_against(path: &Path, schema: &str) -> Value {
    let schema_path = schema_path(schema);
    let schema_text = fs::read_to_string(&schema_path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", schema_path.display()));
    let schema: Value = serde_json::from_str(&schema_text).expect("the schema is not JSON");
    let validator = jsonschema::validator_for(&schema).expect("the schema does not compile");
    let text =
        fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let doc: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    let errors: Vec<String> = validator
        .iter_errors(&doc)
        .map(|e| format!("  at {:?}: {e}", e.instance_path().to_string()))
        .collect();
    assert!(
        errors.is_empty(),
        "{} does not validate against {}:\n{}",
        path.display(),
        schema_path.display(),
        errors.join("\n")
    );
    doc
}

/// Loads the profile at `path`, asserts that it validates against the
/// schema (listing every error), and returns it with each stack's frames
/// in the stack (see [`inline_frames`]).
pub fn validate_profile(path: &Path) -> Value {
    let mut doc = validate_against(path, "profile.schema.json");
    inline_frames(&mut doc);
    doc
}

/// Replaces each stack's frame indexes (schema version 2) by the frames
/// they name in the `frames` table, as version 1 held them: the tests
/// read a stack's frames from the stack.
fn inline_frames(doc: &mut Value) {
    let Some(Value::Array(table)) = doc.get("frames").cloned() else {
        return;
    };
    let inline = |stacks: &mut Value| {
        for stack in stacks.as_array_mut().into_iter().flatten() {
            for f in stack["frames"].as_array_mut().expect("frames").iter_mut() {
                let i = f.as_u64().expect("a frame index") as usize;
                *f = table.get(i).cloned().expect("a frame index in the table");
            }
        }
    };
    inline(&mut doc["stacks"]);
    if let Some(delta) = doc
        .get_mut("snapshot")
        .and_then(|s| s.get_mut("delta_stacks"))
    {
        inline(delta);
    }
}

/// The allocator function whose stacks are frees, not allocations.
pub const FREE: &str = "free";

#[derive(Clone, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct Frame {
    pub function: String,
    pub file: Option<String>,
    pub line: Option<u64>,
    pub module: Option<String>,
    pub inlined: bool,
    /// Where no line is known: the offset in its function.
    #[serde(default)]
    pub symbol_offset: Option<u64>,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct Thread {
    pub tid: u32,
    pub name: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProcessRef {
    pub pid: u32,
    pub name: String,
}

/// One entry of `stacks`.
#[derive(Clone, Debug, Deserialize)]
pub struct Stack {
    /// The allocator function.
    pub function: String,
    /// Innermost first: `frames[0]` is the direct caller.
    pub frames: Vec<Frame>,
    pub truncated: bool,
    pub thread: Option<Thread>,
    #[serde(default)]
    pub process: Option<ProcessRef>,
    pub calls: u64,
    pub bytes: u64,
    /// Live mode: the stack's live statistics.
    pub live: Option<Value>,
    /// A Go heap row: its objects (`calls`) and bytes in use.
    #[serde(default)]
    pub in_use: Option<Counts>,
    /// A Go heap row: the size of each of its objects.
    #[serde(default)]
    pub object_size: Option<u64>,
}

impl Stack {
    /// The direct caller's function.
    pub fn caller(&self) -> Option<&str> {
        self.names().first().copied()
    }

    /// Function names of the frames, innermost first.
    pub fn names(&self) -> Vec<&str> {
        self.frames.iter().map(|f| f.function.as_str()).collect()
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
pub struct Counts {
    pub calls: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Totals {
    pub per_func: BTreeMap<String, Counts>,
    pub allocs: Counts,
    pub frees: u64,
    #[serde(default = "yes")]
    pub frees_counted: bool,
    pub nested: u64,
}

fn yes() -> bool {
    true
}

/// `doc[name]` as a `T`.
fn typed<T: DeserializeOwned>(doc: &Value, name: &str, path: &Path) -> T {
    serde_json::from_value(doc[name].clone())
        .unwrap_or_else(|e| panic!("{name} of {}: {e}", path.display()))
}

/// A profile: the whole document, and its stacks, totals and losses typed.
#[derive(Debug)]
pub struct Profile {
    pub doc: Value,
    /// Every entry of `stacks`, frees included (see [`Profile::allocs`]).
    pub stacks: Vec<Stack>,
    pub totals: Totals,
    /// The `losses` object: what was lost, by kind.
    pub losses: BTreeMap<String, u64>,
}

impl Profile {
    /// Loads and validates the profile at `path`.
    pub fn load(path: &Path) -> Profile {
        let doc = validate_profile(path);
        Profile {
            stacks: typed(&doc, "stacks", path),
            totals: typed(&doc, "totals", path),
            losses: typed(&doc, "losses", path),
            doc,
        }
    }

    /// `meta.mode`: `count` or `live`.
    pub fn mode(&self) -> &str {
        self.doc["meta"]["mode"].as_str().expect("meta.mode")
    }

    /// `meta.pid`.
    pub fn pid(&self) -> u32 {
        self.doc["meta"]["pid"].as_u64().expect("meta.pid") as u32
    }

    /// The stacks of allocations (every function but `free`).
    pub fn allocs(&self) -> impl Iterator<Item = &Stack> {
        self.stacks.iter().filter(|s| s.function != FREE)
    }

    /// Allocation stacks of `func` whose direct caller is `caller`.
    pub fn stacks_at(&self, func: &str, caller: &str) -> Vec<&Stack> {
        self.allocs()
            .filter(|s| s.function == func && s.caller() == Some(caller))
            .collect()
    }

    /// Summed (calls, bytes) of `func` called from `caller` (a compiler may
    /// have made one source loop into several call sites).
    pub fn site(&self, func: &str, caller: &str) -> (u64, u64) {
        self.stacks_at(func, caller)
            .iter()
            .fold((0, 0), |(c, b), s| (c + s.calls, b + s.bytes))
    }

    /// Every distinct (allocator function, direct caller) of allocations.
    pub fn sites(&self) -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = self
            .allocs()
            .map(|s| (s.function.clone(), s.caller().unwrap_or("").to_string()))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// `totals.allocs` as (calls, bytes).
    pub fn total(&self) -> (u64, u64) {
        (self.totals.allocs.calls, self.totals.allocs.bytes)
    }

    /// Calls of one allocator function in `totals.per_func`.
    pub fn calls_of(&self, func: &str) -> Option<u64> {
        self.totals.per_func.get(func).map(|c| c.calls)
    }

    /// Calls summed over `totals.per_func`, frees left out.
    pub fn per_func_alloc_calls(&self) -> u64 {
        self.totals
            .per_func
            .iter()
            .filter(|(f, _)| *f != FREE)
            .map(|(_, c)| c.calls)
            .sum()
    }

    /// Every kind of loss is there, and zero: six, and the host engine's
    /// seven more.
    pub fn assert_no_losses(&self) {
        let kinds = if self.losses.contains_key("exec_events_lost") {
            13
        } else {
            6
        };
        assert_eq!(self.losses.len(), kinds, "losses: {:?}", self.losses);
        assert!(
            self.losses.values().all(|n| *n == 0),
            "losses: {:?}",
            self.losses
        );
        // Nothing lost, said or not.
        if self.mode() == "count" {
            self.assert_rows_hold_the_totals(&self.dump());
        }
    }

    /// Every call the totals count is in a row (count mode, nothing
    /// lost): no walk was left unfinished or dropped, said or not.
    pub fn assert_rows_hold_the_totals(&self, what: &str) {
        let rows: u64 = self.allocs().map(|s| s.calls).sum();
        assert_eq!(rows, self.total().0, "the rows against the totals\n{what}");
    }

    /// For assertion messages: one line per stack.
    pub fn dump(&self) -> String {
        let mut s = String::new();
        for st in &self.stacks {
            let _ = writeln!(
                s,
                "{} calls {} bytes {} {:?} {:?}{}",
                st.calls,
                st.bytes,
                st.function,
                st.thread,
                st.names(),
                if st.truncated { " [truncated]" } else { "" }
            );
        }
        let _ = writeln!(s, "stack quality: {}", self.doc["stack_quality"]);
        s
    }
}

/// The processes the profile lists: (pid, ppid, name, traced, exit code).
pub fn processes(p: &Profile) -> Vec<(u64, u64, String, bool, Option<i64>)> {
    p.doc["meta"]["processes"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    (
                        e["pid"].as_u64().unwrap(),
                        e["ppid"].as_u64().unwrap(),
                        e["name"].as_str().unwrap().to_string(),
                        e["traced"].as_bool().unwrap(),
                        e["exit_code"].as_i64(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}
