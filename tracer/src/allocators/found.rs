//! The answers of [`find_in_process`], by the objects a process maps.

use super::AllocatorObject;
use crate::tracee::{path_in_target, FileId, Kept};

/// The objects in link-map order, each with its identity (`None`
/// when it could not be looked at: such a key is never stored).
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Key {
    python: bool,
    objects: Vec<(String, Option<FileId>)>,
}

impl Key {
    pub(super) fn of(pid: u32, objects: &[String], python: bool) -> Key {
        let objects = objects
            .iter()
            .map(|path| (path.clone(), FileId::of(&path_in_target(pid, path))))
            .collect();
        Key { python, objects }
    }

    fn whole(&self) -> bool {
        self.objects.iter().all(|(_, id)| id.is_some())
    }
}

type Answer = Option<AllocatorObject>;

/// The answers kept (32 sets of objects).
static FOUND: Kept<Key, Answer> = Kept::new(32);

pub(super) fn get(key: &Key) -> Option<Answer> {
    key.whole().then(|| FOUND.get(key)).flatten()
}

pub(super) fn put(key: Key, answer: Answer) {
    if key.whole() {
        FOUND.put(key, answer);
    }
}
