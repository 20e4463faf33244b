//! CPython frames in the stacks, read out of process: which interpreter a
//! process runs and where its frames are ([`layout`], for the BPF
//! programs), code objects read from its memory ([`code`], with their line
//! tables decoded by [`linetable`]), and the Python frames put in place of
//! the eval loop's when stacks are symbolized ([`names`]).

mod btf;
pub mod code;
pub mod files;
mod layout;
pub mod linetable;
mod names;
pub mod snap;
pub mod state;

pub use layout::{detect, Found, Interpreter};
pub use names::{runs_eval_loop, split, Names};

use tracer_common::{py_cut_words, PY_CUT_MARK};

/// Puts a stack's Python words (`py`, pairs) behind its native frames
/// (`frames`), in a stack of at most `max` words, as the BPF side does
/// (`append_python`): a native walk cut short already (`whole` false)
/// gives way to them; then as many whole frames as there is room for, the
/// last place taken by the mark of the cut when they do not all fit (or
/// none at all when not even the mark does). Returns whether frames were
/// left out.
pub fn fit(frames: &mut Vec<u64>, whole: bool, py: &[u64], max: usize) -> bool {
    let py = &py[..py.len() & !1];
    if py.is_empty() {
        return false;
    }
    if !whole && frames.len() + py.len() > max {
        frames.truncate(max.saturating_sub(py.len()));
    }
    let room = max.saturating_sub(frames.len()) / 2;
    let pairs = py.len() / 2;
    if pairs <= room {
        frames.extend_from_slice(py);
        return false;
    }
    if room == 0 {
        return true;
    }
    frames.extend_from_slice(&py[..2 * (room - 1)]);
    let marked = py[py.len() - 2] & PY_CUT_MARK != 0;
    let left = pairs - (room - 1) - marked as usize;
    frames.extend_from_slice(&py_cut_words(left as u32, marked));
    true
}

/// Says `line` on stderr once per run: a tree may start the same
/// interpreter many times.
pub fn say_once(line: &str) {
    static SAID: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    if SAID.lock().unwrap().insert(line.to_string()) {
        // (A path in it is the target's to choose.)
        crate::say!("mtrace: {}", crate::render::text::printable(line));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracer_common::{py_frame_words, MAX_FRAMES};

    /// `n` Python frames' words, the last a cut mark when `marked`.
    fn py(n: u64, marked: bool) -> Vec<u64> {
        let mut words: Vec<u64> = (0..n)
            .flat_map(|i| py_frame_words(0x1000 + i, false, 0, 0))
            .collect();
        if marked {
            words.extend(py_cut_words(0, true));
        }
        words
    }

    #[test]
    fn python_frames_fit_behind_the_native_ones_with_the_cut_marked() {
        // Room for all.
        let mut f = vec![1; 20];
        assert!(!fit(&mut f, true, &py(10, false), MAX_FRAMES));
        assert_eq!(f.len(), 40);
        // A whole native walk keeps its frames: 47 words left, 23 pairs,
        // 22 frames and the mark of the 8 left out.
        let mut f = vec![1; 80];
        assert!(fit(&mut f, true, &py(30, false), MAX_FRAMES));
        assert_eq!(f.len(), 126);
        assert_eq!(f[124..], py_cut_words(8, false));
        // A mark read already: the frames left out and more.
        let mut f = vec![1; 80];
        assert!(fit(&mut f, true, &py(47, true), MAX_FRAMES));
        assert_eq!(f[124..], py_cut_words(25, true));
        // A native walk cut short gives way: every frame read, its mark.
        let mut f = vec![1; MAX_FRAMES];
        assert!(!fit(&mut f, false, &py(47, true), MAX_FRAMES));
        assert_eq!(f.len(), MAX_FRAMES);
        assert_eq!(f[..31], [1; 31]);
        assert_eq!(f[MAX_FRAMES - 2..], py_cut_words(0, true));
        // No room even for the mark.
        let mut f = vec![1; 126];
        assert!(fit(&mut f, true, &py(2, false), MAX_FRAMES));
        assert_eq!(f.len(), 126);
    }
}
