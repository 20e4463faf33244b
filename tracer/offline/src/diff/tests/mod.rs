//! The diff's tests and the profiles they compare: a fixture's run of
//! three allocation sites, frames as symbolization makes them, and the
//! conditions of the gate. Each concern is a file of its own: what changed
//! and the gate's verdict on it in `totals.rs`, how stacks are matched
//! across runs in `matching.rs`, the `--fail-if` language in
//! `parsing.rs`, and the table and the differential flame graph in
//! `formats.rs`.

use super::gate::*;
use super::*;
use crate::profile::Thread;
use crate::profile::{Counts, Frame, Profile, StackEntry, Weight};
use crate::render::diff_table::render_table;
use crate::render::flamegraph::{self, Kind};
use crate::render::folded;
use crate::render::test_util::{entry, on_thread, profile};

mod formats;
mod matching;
mod parsing;
mod totals;

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

/// [`entry`] with frames of its own.
fn stack(func: &str, frames: Vec<Frame>, calls: u64, bytes: u64) -> StackEntry {
    StackEntry {
        frames: frames.into_iter().map(Arc::new).collect(),
        ..entry(func, &[], calls, bytes)
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
