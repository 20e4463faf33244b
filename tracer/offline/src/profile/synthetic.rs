//! Profiles no trace makes quickly, for the tests and measurements of
//! scale: many deep distinct stacks, one very deep stack, a node of very
//! many children.

use std::sync::Arc;

use super::{Counts, Frame, Profile, StackEntry};

/// A frame of `function` in a made-up program, at `site` (which sets its
/// line and address).
fn frame(function: String, site: u64) -> Arc<Frame> {
    let addr = 0x40_0000 + site * 0x40;
    Arc::new(Frame {
        function,
        file: Some("/home/user/src/app/handlers.c".into()),
        line: Some(site as u32),
        module: Some("/usr/local/bin/app".into()),
        build_id: Some("0f3a5c7e9b1d2f4a6c8e0b2d4f6a8c0e1b3d5f7a".into()),
        file_offset: Some(addr - 0x40_0000),
        addr,
        inlined: false,
        mapping: None,
        symbol_offset: None,
    })
}

/// A count-mode profile of one `malloc` of 8 bytes under each of `stacks`
/// (frames innermost first), its totals their sum.
fn profile(stacks: impl Iterator<Item = Vec<Arc<Frame>>>) -> Profile {
    let mut p = Profile::default();
    p.meta.mode = "count".into();
    p.meta.command = "./app".into();
    p.stacks = stacks
        .map(|frames| StackEntry {
            func: "malloc".into(),
            frames,
            counts: Counts { calls: 1, bytes: 8 },
            ..Default::default()
        })
        .collect();
    let all = Counts {
        calls: p.stacks.len() as u64,
        bytes: 8 * p.stacks.len() as u64,
    };
    p.totals.allocs = all;
    p.totals.per_func.insert("malloc".into(), all);
    p
}

/// `stacks` distinct stacks of `depth` frames, as a program whose every
/// level of calls has ten call sites makes them: frame `l` of stack `i` is
/// one of the ten sites of level `l`, chosen by `i`'s decimal digits at
/// the innermost six levels (every stack up to a million is distinct) and
/// by a hash of `i` above. Its 10 × `depth` frames recur in every stack.
pub fn deep_stacks(stacks: usize, depth: usize) -> Profile {
    let sites: Vec<Arc<Frame>> = (0..depth * 10)
        .map(|s| frame(format!("level{}_site{}", s / 10, s % 10), s as u64))
        .collect();
    profile((0..stacks).map(|i| {
        (0..depth)
            .map(|l| {
                let site = if l < 6 {
                    i / 10usize.pow(l as u32) % 10
                } else {
                    (i.wrapping_mul(2_654_435_761) >> (l % 20)) % 10
                };
                sites[l * 10 + site].clone()
            })
            .collect()
    }))
}

/// One stack of `depth` frames, `f0` (innermost) to `f{depth-1}`.
pub fn one_deep_stack(depth: usize) -> Profile {
    profile(std::iter::once(
        (0..depth)
            .map(|l| frame(format!("f{l}"), l as u64))
            .collect(),
    ))
}

/// `n` stacks `leaf{i}` <- `main`: a node of `n` children.
pub fn siblings(n: usize) -> Profile {
    profile((0..n).map(|i| {
        vec![
            frame(format!("leaf{i}"), i as u64 + 1),
            frame("main".into(), 0),
        ]
    }))
}

/// One frame whose function's name is `name`, in stacks 1, 2, ... frames
/// deep (every frame of each is that one) until it is named at least
/// `names` times: a file that names it once and a model that copied it
/// into every stack differ by a factor of `names`.
pub fn one_frame_named_often(name: String, names: usize) -> Profile {
    let shared = frame(name, 1);
    let mut depths = Vec::new();
    let mut named = 0;
    while named < names {
        depths.push(depths.len() + 1);
        named += depths.len();
    }
    profile(depths.into_iter().map(|depth| vec![shared.clone(); depth]))
}
