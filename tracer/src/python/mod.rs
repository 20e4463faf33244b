//! CPython frames in the stacks, read out of process: which interpreter a
//! process runs and where its frames are ([`layout`], for the BPF
//! programs), code objects read from its memory ([`code`], with their line
//! tables decoded by [`linetable`]), and the Python frames put in place of
//! the eval loop's when stacks are symbolized ([`names`]).

mod btf;
pub mod code;
mod layout;
pub mod linetable;
mod names;

pub use layout::{detect, Found};
pub use names::{split, Names};

/// Says `line` on stderr once per run: a tree may start the same
/// interpreter many times.
pub fn say_once(line: &str) {
    static SAID: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    if SAID.lock().unwrap().insert(line.to_string()) {
        crate::say!("mtrace: {line}");
    }
}
