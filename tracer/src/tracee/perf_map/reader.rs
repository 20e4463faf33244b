//! The thread that reads every traced process's perf map, off the
//! session's loop: a map asked to be read is queued; the thread reads a
//! slice of it at a time (what was appended since its last read), the
//! maps with more to read taking turns, and puts the names into the
//! map's table. The loop never waits for it, but the end of a trace
//! waits for it a little ([`super::CATCH_UP`]).

use std::{
    collections::VecDeque,
    fs::File,
    os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt},
    sync::{Arc, Condvar, Mutex, MutexGuard, Weak},
    time::Instant,
};

use super::{
    parse_line,
    table::{Batch, Table},
};
use crate::profile::PerfMapQuality;

/// Most bytes read at once. A longer line is no perf map's: it is
/// skipped to its end and counted as not understood.
const SLICE: usize = 4 << 20;

/// Most lines parsed before they go into the table.
const BATCH_LINES: usize = 1 << 16;

/// Bytes remembered of the map's beginning and of what precedes where
/// reading stopped: when either changed, the map was rewritten in place.
const CHECK: usize = 64;

/// One process's perf map.
pub struct Shared {
    /// In the target's /tmp, under its pid there.
    path: String,
    /// The same file through this process's /tmp, when the target shares
    /// its mount namespace: the map is still found there once the target
    /// is gone (a map written just before the end is read after it).
    gone_path: Option<String>,
    /// The target's real user, as it was when the map was first asked for.
    uid: Option<u32>,
    table: Mutex<Table>,
    state: Mutex<State>,
    /// Told when a read is done.
    read: Condvar,
    /// Taken by the reading thread only, for as long as it reads a slice.
    source: Mutex<Source>,
}

/// What the session and the reading thread share of a map.
#[derive(Default)]
struct State {
    /// Reads asked for, and those done: a read asked is done once the map
    /// was read to the end it had after it was asked.
    asked: u64,
    done: u64,
    /// In the reading thread's queue, or being read.
    queued: bool,
    /// What reading met (`kept` and `unread_bytes` are filled in when
    /// asked for).
    quality: PerfMapQuality,
    /// The file read (once one was found), and how far.
    file: Option<Arc<File>>,
    offset: u64,
    /// When the read under way began, and where.
    began: Option<(Instant, u64)>,
}

/// Where reading stands in the file.
#[derive(Default)]
struct Source {
    file: Option<Arc<File>>,
    /// Its device and inode.
    id: (u64, u64),
    /// Bytes read, always up to the end of a line.
    offset: u64,
    /// Up to [`CHECK`] bytes of its beginning, and of what precedes
    /// `offset`, as read.
    head: Vec<u8>,
    before: Vec<u8>,
    /// In a line longer than a slice, to be skipped to its end.
    skipping: bool,
}

/// One slice read.
#[derive(Default)]
struct Step {
    batch: Batch,
    quality: PerfMapQuality,
    /// The map is another file, or was rewritten: what the table holds
    /// goes, and reading starts over.
    reset: bool,
    /// Every whole line up to the end of the file was read.
    at_end: bool,
}

impl Shared {
    pub fn new(pid: u32) -> Arc<Shared> {
        let ns_pid = namespace_pid(pid).unwrap_or(pid);
        let gone_path = same_mount_namespace(pid).then(|| format!("/tmp/perf-{ns_pid}.map"));
        Shared::at(
            format!("/proc/{pid}/root/tmp/perf-{ns_pid}.map"),
            gone_path,
            target_uid(pid),
        )
    }

    /// The map at `path` (else at `gone_path`), written by `uid`.
    fn at(path: String, gone_path: Option<String>, uid: Option<u32>) -> Arc<Shared> {
        Arc::new(Shared {
            path,
            gone_path,
            uid,
            table: Mutex::default(),
            state: Mutex::default(),
            read: Condvar::new(),
            source: Mutex::default(),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks for the map to be read to its end; returns at once.
    pub fn ask(self: &Arc<Self>) {
        let mut state = self.state();
        state.asked += 1;
        if !state.queued {
            state.queued = true;
            drop(state);
            queue(Arc::downgrade(self));
        }
    }

    /// Waits until every read asked for is done, or `deadline`.
    pub fn wait(&self, deadline: Instant) {
        let mut state = self.state();
        let goal = state.asked;
        while state.done < goal {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            state = self
                .read
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub fn name(&self, addr: u64) -> Option<String> {
        self.table().name(addr).map(str::to_string)
    }

    pub fn quality(&self) -> Option<PerfMapQuality> {
        let (mut quality, size, offset) = {
            let state = self.state();
            let size = state.file.as_ref()?.metadata().map_or(0, |m| m.len());
            (state.quality, size, state.offset)
        };
        quality.unread_bytes = size.saturating_sub(offset);
        quality.kept = self.table().len() as u64;
        Some(quality)
    }

    /// Reads one slice (the reading thread); returns whether there is
    /// more to read.
    fn read_slice(&self, buf: &mut Vec<u8>) -> bool {
        let goal = {
            let mut state = self.state();
            let offset = state.offset;
            state.began.get_or_insert((Instant::now(), offset));
            state.asked
        };
        let mut source = self.source.lock().unwrap_or_else(|e| e.into_inner());
        let step = source.step(self, buf);
        let evicted = {
            let mut table = self.table();
            if step.reset {
                *table = Table::default();
            }
            table.add(step.batch)
        };
        let mut state = self.state();
        let q = &mut state.quality;
        q.lines += step.quality.lines;
        q.bad_lines += step.quality.bad_lines;
        q.names_cut += step.quality.names_cut;
        q.rereads += step.quality.rereads;
        q.evicted += evicted;
        state.file.clone_from(&source.file);
        state.offset = source.offset;
        if !step.at_end {
            return true;
        }
        let (began, from) = state.began.take().unwrap_or((Instant::now(), 0));
        if state.offset != from {
            log::debug!(
                "{}: read to {} bytes in {:.1} ms ({} lines so far)",
                self.path,
                state.offset,
                began.elapsed().as_secs_f64() * 1e3,
                state.quality.lines
            );
        }
        state.done = state.done.max(goal);
        self.read.notify_all();
        if state.asked > goal {
            return true;
        }
        state.queued = false;
        false
    }
}

impl Source {
    /// Reads the next slice of `map`: the file at its path when it is one
    /// to read and not the one read so far, else the one read so far
    /// (also once the process is gone, or the path was taken away).
    fn step(&mut self, map: &Shared, buf: &mut Vec<u8>) -> Step {
        let mut step = Step::default();
        let found = match std::fs::symlink_metadata(&map.path) {
            Ok(meta) => Some((map.path.as_str(), meta)),
            // The target is gone (its /proc/PID/root with it), or the map
            // is not there.
            Err(_) => map
                .gone_path
                .as_deref()
                .and_then(|p| Some((p, std::fs::symlink_metadata(p).ok()?))),
        };
        if let Some((file, id)) = found.and_then(|(p, meta)| self.other_file(p, meta, map.uid)) {
            if self.file.is_some() {
                step.reset = true;
                step.quality.rereads += 1;
            }
            *self = Source {
                file: Some(Arc::new(file)),
                id,
                ..Source::default()
            };
        }
        let Some(file) = self.file.clone() else {
            step.at_end = true;
            return step;
        };
        let Ok(size) = file.metadata().map(|m| m.len()) else {
            step.at_end = true;
            return step;
        };
        if size < self.offset || !self.unchanged(&file) {
            step.reset = true;
            step.quality.rereads += 1;
            *self = Source {
                file: Some(file.clone()),
                id: self.id,
                ..Source::default()
            };
        }
        let from = self.offset;
        let want = (size - from).min(SLICE as u64) as usize;
        buf.resize(want, 0);
        let got = read_at(&file, buf, from);
        buf.truncate(got);
        let mut pos = 0;
        let mut full = false;
        while let Some(nl) = memchr::memchr(b'\n', &buf[pos..]) {
            let line = &buf[pos..pos + nl];
            pos += nl + 1;
            if std::mem::take(&mut self.skipping) {
                step.quality.bad_lines += 1;
                continue;
            }
            match parse_line(line) {
                Some((start, size, name)) => {
                    step.quality.lines += 1;
                    if step.batch.push(start, size, name) {
                        step.quality.names_cut += 1;
                    }
                }
                None => step.quality.bad_lines += 1,
            }
            if step.batch.len() >= BATCH_LINES || step.batch.name_bytes() >= SLICE {
                full = true;
                break;
            }
        }
        if pos == 0 && got == SLICE {
            self.skipping = true;
            pos = got;
        }
        if from == 0 {
            self.head = buf[..pos.min(CHECK)].to_vec();
        }
        if pos > 0 {
            self.before = buf[pos.saturating_sub(CHECK)..pos].to_vec();
        }
        self.offset += pos as u64;
        // (A last line without its newline yet is read once it has one;
        // a read cut short, the file shrinking or failing, ends the read
        // here, and the next one looks again.)
        step.at_end = !full && (got < want || from + want as u64 >= size);
        step
    }

    /// The file at `path`, opened, when it is a regular file of the
    /// target's user or of root and not the one read so far. Looked at
    /// before it is opened (a device is never opened), opened without
    /// following a symbolic link or blocking, and checked again once open.
    fn other_file(
        &self,
        path: &str,
        meta: std::fs::Metadata,
        uid: Option<u32>,
    ) -> Option<(File, (u64, u64))> {
        let id = (meta.dev(), meta.ino());
        if self.file.is_some() && id == self.id {
            return None;
        }
        let acceptable =
            |m: &std::fs::Metadata| m.is_file() && (m.uid() == 0 || Some(m.uid()) == uid);
        if !acceptable(&meta) {
            log::debug!("{path}: not a regular file of the target's user or root: not read");
            return None;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .ok()?;
        let meta = file.metadata().ok()?;
        (acceptable(&meta) && (meta.dev(), meta.ino()) == id).then_some((file, id))
    }

    /// Whether the bytes remembered are still there: the file was not
    /// rewritten in place (truncated, then written past where it was).
    fn unchanged(&self, file: &File) -> bool {
        let same = |at: u64, bytes: &[u8]| {
            let mut now = vec![0; bytes.len()];
            read_at(file, &mut now, at) == bytes.len() && now == bytes
        };
        same(0, &self.head) && same(self.offset - self.before.len() as u64, &self.before)
    }
}

/// Reads into `buf` from `at`, until it is full or the file ends; the
/// bytes read.
fn read_at(file: &File, buf: &mut [u8], at: u64) -> usize {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], at + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    got
}

/// Maps asked to be read, in turn.
static QUEUE: Mutex<VecDeque<Weak<Shared>>> = Mutex::new(VecDeque::new());
static QUEUED: Condvar = Condvar::new();
static STARTED: std::sync::Once = std::sync::Once::new();

fn queue(map: Weak<Shared>) {
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("perf-maps".into())
            .spawn(read_maps);
        if let Err(e) = spawned {
            log::warn!("no thread to read perf maps: {e}");
        }
    });
    QUEUE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push_back(map);
    QUEUED.notify_one();
}

/// The reading thread: a slice of the first map in the queue, which goes
/// to the back while it has more to read.
fn read_maps() {
    let mut buf = Vec::new();
    loop {
        let next = {
            let mut queue = QUEUE.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(next) = queue.pop_front() {
                    break next;
                }
                // Nothing to read: the slice's memory goes back.
                buf = Vec::new();
                queue = QUEUED.wait(queue).unwrap_or_else(|e| e.into_inner());
            }
        };
        let Some(map) = next.upgrade() else {
            continue;
        };
        if map.read_slice(&mut buf) {
            QUEUE
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back(next);
        }
    }
}

/// The target's pid in its own pid namespace (the last of `NSpid`).
fn namespace_pid(pid: u32) -> Option<u32> {
    status_field(pid, "NSpid:")?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// Whether the target's mount namespace is this process's.
fn same_mount_namespace(pid: u32) -> bool {
    let id = |p: String| std::fs::metadata(p).map(|m| (m.dev(), m.ino())).ok();
    let theirs = id(format!("/proc/{pid}/ns/mnt"));
    theirs.is_some() && theirs == id("/proc/self/ns/mnt".to_string())
}

/// The target's real user id.
fn target_uid(pid: u32) -> Option<u32> {
    status_field(pid, "Uid:")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn status_field(pid: u32, name: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(name).map(str::to_string))
}

#[cfg(test)]
mod tests;
