//! Names that came from the traced process as a person is shown them:
//! made printable (nothing a terminal acts on) and cut after
//! [`NAME_CHARS`] characters, one at a time or throughout a profile.

use std::{borrow::Cow, fmt::Write as _, sync::Arc};

use foldhash::{HashMap, HashSet};

use crate::profile::{Frame, Profile};

/// Characters a terminal acts on rather than shows: C0 and C1 controls
/// and DEL (escape sequences, carriage return, bell) and the bidirectional
/// overrides and isolates, which reorder what follows them.
fn unprintable(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with every character a terminal would act on written as its
/// escape (`\u{1b}`), so that names from the traced process (its name,
/// arguments, thread names, symbols) cannot move the cursor, set the
/// title or hide text.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(unprintable) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unprintable(c) {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Calls `$f` on every name in `$profile` that the traced process chose
/// (command, executable and object paths, process and thread names), but
/// for the frames' (see [`map_names`]), by reference (`ref`) or by
/// mutable reference (`mut`): one list of the fields for reading and
/// rewriting.
macro_rules! each_name {
    (ref $profile:expr, $f:expr) => {
        each_name!(@ $profile, $f, &)
    };
    (mut $profile:expr, $f:expr) => {
        each_name!(@ $profile, $f, &mut)
    };
    (@ $profile:expr, $f:expr, $($r:tt)+) => {{
        let profile = $profile;
        #[allow(unused_mut)]
        let mut f = $f;
        let m = $($r)+ profile.meta;
        f($($r)+ m.command);
        f($($r)+ m.executable);
        f($($r)+ m.allocator_object);
        f($($r)+ m.allocator_beside);
        f($($r)+ m.python);
        for p in $($r)+ m.processes {
            f($($r)+ p.name);
            f($($r)+ p.command);
            f($($r)+ p.executable);
            f($($r)+ p.allocator_object);
        }
        for probe in $($r)+ m.probes {
            f($($r)+ probe.function);
        }
        for st in $($r)+ profile.stacks {
            f($($r)+ st.func);
            if let Some(t) = $($r)+ st.thread {
                f($($r)+ t.name);
            }
            if let Some(r) = $($r)+ st.process {
                f($($r)+ r.name);
            }
        }
    }};
}

/// `frame` with its function, file and module names passed through `fix`:
/// the same [`Arc`] when `fix` changed none of them.
fn map_frame(frame: &Arc<Frame>, fix: &impl Fn(&str) -> Cow<'_, str>) -> Arc<Frame> {
    let function = fix(&frame.function);
    let file = frame.file.as_deref().map(fix);
    let module = frame.module.as_deref().map(fix);
    let owned = |c: &Option<Cow<'_, str>>| matches!(c, Some(Cow::Owned(_)));
    if matches!(function, Cow::Borrowed(_)) && !owned(&file) && !owned(&module) {
        return frame.clone();
    }
    Arc::new(Frame {
        function: function.into_owned(),
        file: file.map(Cow::into_owned),
        module: module.map(Cow::into_owned),
        ..(**frame).clone()
    })
}

/// `profile` with every name that came from the traced process passed
/// through `fix` (those of [`each_name`] and the allocator functions') or
/// `fix_frame` (the frames' function, file and object names); borrowed
/// when they changed none. Each distinct frame (each [`Arc`] of one) is
/// looked at once, and the stacks that shared it share what it became:
/// the work and the memory grow with the distinct frames, not with the
/// frames of every stack.
pub fn map_names<'p>(
    profile: &'p Profile,
    fix: impl Fn(&str) -> Cow<'_, str>,
    fix_frame: impl Fn(&str) -> Cow<'_, str>,
) -> Cow<'p, Profile> {
    let changes = |name: &str| matches!(fix(name), Cow::Owned(_));
    let mut dirty = profile.totals.per_func.keys().any(|k| changes(k));
    each_name!(ref profile, |name: &String| dirty |= changes(name));
    let mut seen: HashSet<*const Frame> = HashSet::default();
    let mut frames = profile.stacks.iter().flat_map(|st| &st.frames);
    dirty = dirty
        || frames
            .any(|f| seen.insert(Arc::as_ptr(f)) && !Arc::ptr_eq(&map_frame(f, &fix_frame), f));
    if !dirty {
        return Cow::Borrowed(profile);
    }
    let mut clean = profile.clone();
    each_name!(mut &mut clean, |name: &mut String| {
        if let Cow::Owned(fixed) = fix(name) {
            *name = fixed;
        }
    });
    // Keyed by the address of each frame `profile` holds: `profile` is
    // borrowed throughout, so no address is freed and reused meanwhile.
    let mut fixed: HashMap<*const Frame, Arc<Frame>> = HashMap::default();
    for frame in clean.stacks.iter_mut().flat_map(|st| &mut st.frames) {
        *frame = fixed
            .entry(Arc::as_ptr(frame))
            .or_insert_with(|| map_frame(frame, &fix_frame))
            .clone();
    }
    clean.totals.per_func = std::mem::take(&mut clean.totals.per_func)
        .into_iter()
        .map(|(k, v)| (fix(&k).into_owned(), v))
        .collect();
    Cow::Owned(clean)
}

/// `profile` with every name that came from the traced process made
/// [`printable`]; borrowed when there was nothing to change. Text
/// renderers take this before they write a line.
pub fn printable_profile(profile: &Profile) -> Cow<'_, Profile> {
    map_names(profile, printable, printable)
}

/// The most characters of a name a person is shown (a function's, a
/// file's, an object's, a thread's, a command line): the table, the tree,
/// the diff, the HTML page and `mtrace top` show a longer one cut there,
/// with the count of the characters left out ([`cut`]). Real names stay
/// under it (the longest C++ names seen are some hundreds of characters);
/// a made-up one of megabytes would otherwise be printed whole, on every
/// line that names it. The JSON profile, pprof, speedscope and folded
/// stacks keep every name whole.
pub const NAME_CHARS: usize = 1024;

/// `text` as its first `n` characters and the count of those after them.
pub(super) fn split_at_chars(text: &str, n: usize) -> (&str, usize) {
    match text.char_indices().nth(n) {
        Some((at, _)) => (&text[..at], text[at..].chars().count()),
        None => (text, 0),
    }
}

/// `text` followed by the mark of `left_out` characters cut off after it,
/// `…[1047552 more characters]`; `text` alone when none were.
pub(super) fn marked(text: &str, left_out: usize) -> Cow<'_, str> {
    if left_out == 0 {
        Cow::Borrowed(text)
    } else {
        Cow::Owned(format!("{text}…[{left_out} more characters]"))
    }
}

/// `text`, or its first [`NAME_CHARS`] characters and the count of the
/// rest: `…[1047552 more characters]`.
pub fn cut(text: &str) -> Cow<'_, str> {
    let (head, left_out) = split_at_chars(text, NAME_CHARS);
    marked(head, left_out)
}

/// A name as a person is shown it: [`printable`], then [`cut`].
pub fn shown(name: &str) -> Cow<'_, str> {
    match printable(name) {
        Cow::Borrowed(name) => cut(name),
        Cow::Owned(name) => Cow::Owned(cut(&name).into_owned()),
    }
}

/// `profile` with every name that came from the traced process as a
/// person is shown it ([`shown`]): what the HTML page and `mtrace top`
/// render. The table cuts the frames' names itself (after folding
/// templates), and so does the tree.
pub fn shown_profile(profile: &Profile) -> Cow<'_, Profile> {
    map_names(profile, shown, shown)
}
