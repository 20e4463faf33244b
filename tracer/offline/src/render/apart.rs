//! Rows a reader can tell apart. Several calls in one function without
//! line information (three `malloc(64)` in zlib's `deflateInit2_`) give
//! stacks whose frames print the same: the same functions, files and
//! lines, at different return addresses. Where such rows' frames differ
//! in their offset from their function's start (`symbol_offset`), each of
//! those frames shows it (`deflateInit2_+0x189`). The table, `mtrace top`
//! and the leak suspects print rows this way.

use std::{collections::HashSet, hash::Hash, sync::Arc};

use foldhash::HashMap;

use crate::profile::Frame;

/// The frames, as (row, depth), that show their offset: those where rows
/// that print the same (the same `key`, the allocator function and whose
/// row it is, and the same frames' names, files and lines) differ in
/// their offsets. `rows` yields each row's key and frames, in order.
pub fn told_apart<'a, K: Hash + Eq>(
    rows: impl IntoIterator<Item = (K, &'a [Arc<Frame>])>,
) -> HashSet<(usize, usize)> {
    type Shown<'a> = (&'a str, &'a Option<String>, Option<u32>, bool);
    let mut frames_of: Vec<&[Arc<Frame>]> = Vec::new();
    // Hashed with foldhash: every row's every frame's name is hashed here,
    // thousands of rows of 30-60 frames in a trace of deep stacks.
    let mut same: HashMap<(K, Vec<Shown>), Vec<usize>> = HashMap::default();
    for (i, (key, frames)) in rows.into_iter().enumerate() {
        let shown: Vec<Shown> = frames
            .iter()
            .map(|f| (f.function.as_str(), &f.file, f.line, f.inlined))
            .collect();
        same.entry((key, shown)).or_default().push(i);
        frames_of.push(frames);
    }
    let mut apart = HashSet::new();
    for alike in same.values().filter(|g| g.len() > 1) {
        for (d, first) in frames_of[alike[0]].iter().enumerate() {
            let offset = |i: usize| frames_of[i][d].symbol_offset;
            let first = first.symbol_offset;
            if alike.iter().any(|&i| offset(i) != first) {
                apart.extend(
                    alike
                        .iter()
                        .filter(|&&i| offset(i).is_some())
                        .map(|&i| (i, d)),
                );
            }
        }
    }
    apart
}

/// `frame` named with its offset in its function (`sites+0x1d`), where
/// it has one.
pub fn with_offset(frame: &Frame) -> Frame {
    match frame.symbol_offset {
        Some(offset) => Frame {
            function: format!("{}+{offset:#x}", frame.function),
            ..frame.clone()
        },
        None => frame.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(function: &str, offset: Option<u64>) -> Arc<Frame> {
        Arc::new(Frame {
            function: function.into(),
            symbol_offset: offset,
            ..Frame::default()
        })
    }

    /// Three rows alike but for the first frame's offset: those frames
    /// show it; the frame they share, and a row that prints otherwise, do
    /// not; rows of another key are not compared.
    #[test]
    fn only_the_frames_that_differ_show_their_offset() {
        let main = frame("main", Some(0x20));
        let rows: Vec<Vec<Arc<Frame>>> = [0x13, 0x1d, 0x27]
            .iter()
            .map(|&o| vec![frame("sites", Some(o)), main.clone()])
            .chain([vec![frame("other", Some(0x5)), main.clone()]])
            .collect();
        let keyed = rows.iter().map(|r| ("malloc", r.as_slice()));
        let apart = told_apart(keyed);
        let mut got: Vec<_> = apart.into_iter().collect();
        got.sort_unstable();
        assert_eq!(got, [(0, 0), (1, 0), (2, 0)]);
        assert_eq!(with_offset(&rows[1][0]).function, "sites+0x1d");
        assert_eq!(with_offset(&frame("x", None)).function, "x");
        let by_thread = rows.iter().enumerate().map(|(i, r)| (i, r.as_slice()));
        assert!(told_apart(by_thread).is_empty());
    }
}
