//! A frame as one line of text, `function (file:line)`, with the
//! templates and parameter lists of a long name folded until the line
//! fits, and each frame's text made once however many rows name it.

use std::sync::Arc;

use foldhash::HashMap;

use crate::profile::Frame;

use super::names::{cut, marked, split_at_chars, NAME_CHARS};
use super::Paint;

/// `function (file:line)`, the place faint, ` [inlined]` after an inlined
/// function.
pub fn frame_text(frame: &Frame, paint: Paint) -> String {
    let place = frame.place(cut);
    // A table line is indented by 4: the name's templates are folded
    // until the line fits 80 columns (the JSON and folded stacks keep
    // the name whole). Folding looks at the first FOLD_CHARS characters
    // only; what is left is cut after NAME_CHARS.
    let inlined = if frame.inlined { " [inlined]".len() } else { 0 };
    let room = FRAME_COLUMNS.saturating_sub(place.chars().count() + inlined);
    let (head, beyond) = split_at_chars(&frame.function, FOLD_CHARS);
    let folded = fold_templates(head, room);
    let (name, more) = split_at_chars(&folded, NAME_CHARS);
    let mut text = format!("{}{}", marked(name, more + beyond), paint.faint(&place));
    if frame.inlined {
        text.push_str(&paint.faint(" [inlined]"));
    }
    text
}

/// Characters of a name whose templates are folded, at most: folding
/// takes time that grows with their square.
const FOLD_CHARS: usize = 4 * NAME_CHARS;

/// The [`frame_text`] of each frame of a profile, made once per [`Arc`]
/// of it: a frame named in many rows (or many times in one) is folded,
/// cut and counted once.
pub struct FrameTexts<'a> {
    paint: Paint,
    made: HashMap<*const Frame, String>,
    /// The frames whose addresses are keys of `made` stay borrowed while
    /// this lives: no address is freed and reused meanwhile.
    _frames: std::marker::PhantomData<&'a Frame>,
}

impl<'a> FrameTexts<'a> {
    pub fn new(paint: Paint) -> FrameTexts<'a> {
        FrameTexts {
            paint,
            made: HashMap::default(),
            _frames: std::marker::PhantomData,
        }
    }

    /// How the texts are painted.
    pub fn paint(&self) -> Paint {
        self.paint
    }

    /// [`frame_text`] of `frame`.
    pub fn get(&mut self, frame: &'a Arc<Frame>) -> &str {
        let paint = self.paint;
        self.made
            .entry(Arc::as_ptr(frame))
            .or_insert_with(|| frame_text(frame, paint))
    }
}

/// Columns a frame's text may take in the table (80, less its indent).
const FRAME_COLUMNS: usize = 76;

/// `name` with its parameter lists folded to `(…)`, then the arguments
/// of its innermost templates to `<…>`, innermost first, until it is at
/// most `width` characters or nothing is left to fold: `std::vector<std::pair<int, long>>::_M_realloc_insert`
/// becomes `std::vector<std::pair<…>>::_M_realloc_insert`, then
/// `std::vector<…>::_M_realloc_insert`. Only brackets that pair up are
/// folded (`operator<` and `operator->` are left as they are).
pub fn fold_templates(name: &str, width: usize) -> std::borrow::Cow<'_, str> {
    if name.chars().count() <= width {
        return std::borrow::Cow::Borrowed(name);
    }
    // Parameter lists first (the function is named without them), then
    // templates.
    let mut s: Vec<char> = name.chars().collect();
    for (open_ch, close_ch) in [('(', ')'), ('<', '>')] {
        if s.len() > width {
            fold_pairs(&mut s, width, open_ch, close_ch);
        }
    }
    std::borrow::Cow::Owned(s.into_iter().collect())
}

/// Folds the innermost pairs of `open_ch`/`close_ch` in `s` to `…`, level
/// by level, until `s` is at most `width` long or nothing is left. Each
/// level is one pass over `s`.
fn fold_pairs(s: &mut Vec<char>, width: usize, open_ch: char, close_ch: char) {
    let folded = |s: &[char], (o, c): (usize, usize)| c == o + 2 && s[o + 1] == '…';
    loop {
        // The innermost pairs not yet folded: pairs ('<' matched by the
        // next unmatched '>' that is not the arrow of a Rust `fn() -> T`),
        // neither folded nor empty, with no such pair
        // inside them. Each '<' waiting for its match notes whether one
        // closed inside it.
        let mut waiting: Vec<(usize, bool)> = Vec::new();
        let mut innermost = Vec::new();
        for (i, &ch) in s.iter().enumerate() {
            if ch == open_ch {
                waiting.push((i, false));
            } else if ch == close_ch && !(ch == '>' && i > 0 && s[i - 1] == '-') {
                if let Some((o, open_inside)) = waiting.pop() {
                    let open = !folded(s, (o, i)) && i > o + 1;
                    if open && !open_inside {
                        innermost.push((o, i));
                    }
                    if let Some(outer) = waiting.last_mut() {
                        outer.1 |= open || open_inside;
                    }
                }
            }
        }
        if innermost.is_empty() {
            break;
        }
        // The last first: the indices of the earlier ones stay put.
        for &(o, c) in innermost.iter().rev() {
            s.splice(o + 1..c, ['…']);
        }
        if s.len() <= width {
            break;
        }
    }
}
