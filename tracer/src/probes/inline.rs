//! The probes of CPython's inlined copies of its allocator: each guard's
//! cookie, and in live mode the places where a copy's block is known,
//! numbered so that copies sharing a place share its probe.

use std::collections::{HashMap, HashSet};

use tracer_common::{
    Role, COOKIE_ARGS_SHIFT, COOKIE_INLINE_ID_SHIFT, COOKIE_INLINE_SIZE_SHIFT, COOKIE_ROLE_SHIFT,
};

use crate::allocators::inlined::{InlineSite, SizeAt};

/// Live mode: the number of the copies (`COOKIE_INLINE_ID_SHIFT`) that
/// may take their block at each place (by file offset). Copies that share
/// a place share a number, and each place is probed once: one probe where
/// the code of two guarded copies meets takes up the call of either.
pub(super) fn inline_numbers<'a>(
    copies: impl Iterator<Item = &'a InlineSite>,
) -> HashMap<u64, u64> {
    // Union-find over the places, each copy's places joined.
    let mut places: Vec<u64> = Vec::new();
    let mut parent: Vec<usize> = Vec::new();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    for copy in copies {
        let mut first = None;
        for b in &copy.blocks {
            let i = match places.iter().position(|p| *p == b.file_offset) {
                Some(i) => i,
                None => {
                    places.push(b.file_offset);
                    parent.push(parent.len());
                    places.len() - 1
                }
            };
            match first {
                None => first = Some(i),
                Some(f) => {
                    let (a, b) = (root(&mut parent, f), root(&mut parent, i));
                    parent[b] = a;
                }
            }
        }
    }
    let mut numbers: HashMap<usize, u64> = HashMap::new();
    let mut out = HashMap::new();
    for (i, place) in places.iter().enumerate() {
        let r = root(&mut parent, i);
        let next = numbers.len() as u64 + 1;
        let n = *numbers.entry(r).or_insert(next);
        if n <= MAX_INLINE_LIVE {
            out.insert(*place, n << COOKIE_INLINE_ID_SHIFT);
        }
    }
    out
}

/// An inlined copy's probes, for the function `func`: its guard's cookie,
/// and in live mode the places its block is known not probed yet (file
/// offset and cookie each; `numbers` from [`inline_numbers`], `probed`
/// the places probed so far). `None`: not probed (in live mode, a copy
/// whose block's places were not found).
pub(super) fn inline_probes(
    copy: &InlineSite,
    func: u32,
    live: bool,
    numbers: &HashMap<u64, u64>,
    probed: &mut HashSet<u64>,
) -> Option<(u64, Vec<(u64, u64)>)> {
    let guard = func as u64 | copy.cookie_bits();
    if !live || copy.size.frees() {
        return Some((guard, Vec::new()));
    }
    // A copy of realloc leaves its block at several places; live mode
    // sees the static malloc and free it calls instead (see
    // `allocators::inlined`).
    if matches!(copy.size, SizeAt::Resize { .. }) {
        return None;
    }
    let id = *numbers.get(&copy.blocks.first()?.file_offset)?;
    let known = copy
        .blocks
        .iter()
        .filter(|b| probed.insert(b.file_offset))
        .map(|b| {
            let cookie = func as u64
                | b.reg << COOKIE_ARGS_SHIFT
                | b.at_disp << COOKIE_INLINE_SIZE_SHIFT
                | (Role::Size as u64) << COOKIE_ROLE_SHIFT;
            (b.file_offset, cookie | id)
        });
    Some((guard | id, known.collect()))
}

/// Most inlined copies numbered in live mode (the cookie's bits from
/// [`COOKIE_INLINE_ID_SHIFT`]; 0 is no copy).
const MAX_INLINE_LIVE: u64 = (1 << (64 - COOKIE_INLINE_ID_SHIFT)) - 1;
