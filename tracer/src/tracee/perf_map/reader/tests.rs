//! The reader's tests, on maps this process writes: only whole appended
//! lines are read, a map truncated, rewritten, replaced or removed is read
//! again or on, a map whose process ended is still read, a link or a FIFO
//! at the map's path is not, and long lines and many lines are read in
//! slices.

use std::{io::Write, time::Duration};

use super::*;

/// A map in a directory of its own, written by this process.
struct Map {
    dir: tempfile::TempDir,
    shared: Arc<Shared>,
}

impl Map {
    fn new() -> Map {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("perf.map").to_str().unwrap().to_string();
        let shared = Shared::at(path, None, Some(unsafe { libc::getuid() }));
        Map { dir, shared }
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("perf.map")
    }

    fn append(&self, text: &[u8]) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path())
            .unwrap();
        f.write_all(text).unwrap();
    }

    /// Reads to the end, as the end of a trace does (it must be done
    /// in a few seconds).
    fn read(&self) -> PerfMapQuality {
        self.shared.ask();
        self.shared.wait(Instant::now() + Duration::from_secs(10));
        let state = self.shared.state();
        assert_eq!(state.done, state.asked, "not read in time");
        drop(state);
        self.shared.quality().unwrap_or_default()
    }

    fn name(&self, addr: u64) -> Option<String> {
        self.shared.name(addr)
    }
}

#[test]
fn reads_only_what_was_appended_and_whole_lines() {
    let m = Map::new();
    m.append(b"1000 10 first\njunk\n2000 10 sec");
    let q = m.read();
    assert_eq!((q.lines, q.bad_lines, q.kept), (1, 1, 1));
    assert_eq!(
        q.unread_bytes,
        "2000 10 sec".len() as u64,
        "the unfinished line waits"
    );
    assert_eq!(m.name(0x1000).as_deref(), Some("first"));
    assert_eq!(m.name(0x2000), None);
    m.append(b"ond\n1000 20 first recompiled\n");
    let q = m.read();
    assert_eq!((q.lines, q.bad_lines, q.kept, q.unread_bytes), (3, 1, 2, 0));
    assert_eq!(m.name(0x2000).as_deref(), Some("second"));
    assert_eq!(m.name(0x101f).as_deref(), Some("first recompiled"));
    assert_eq!(q.rereads, 0);
}

#[test]
fn a_map_truncated_rewritten_or_replaced_is_read_again_from_its_start() {
    let m = Map::new();
    m.append(b"1000 10 old one\n2000 10 old two\n");
    m.read();
    // Truncated, then written longer than it was: its first line
    // changed.
    std::fs::write(
        m.path(),
        b"1000 10 new one\n3000 10 new three\n4000 10 four\n",
    )
    .unwrap();
    let q = m.read();
    assert_eq!((q.rereads, q.kept), (1, 3));
    assert_eq!(m.name(0x1000).as_deref(), Some("new one"));
    assert_eq!(m.name(0x2000), None, "what the old map said is gone");
    // Another file renamed over it.
    let other = m.dir.path().join("other");
    std::fs::write(&other, b"5000 10 five\n").unwrap();
    std::fs::rename(&other, m.path()).unwrap();
    let q = m.read();
    assert_eq!((q.rereads, q.kept), (2, 1));
    assert_eq!(m.name(0x5000).as_deref(), Some("five"));
    assert_eq!(m.name(0x1000), None);
    // Shrunk.
    std::fs::write(m.path(), b"6000 1 six\n7000 1 seven\n").unwrap();
    let q = m.read();
    assert_eq!((q.rereads, q.kept), (3, 2));
    assert_eq!(m.name(0x6000).as_deref(), Some("six"));
    // Rewritten with the same first line, longer: the line before
    // where reading stopped changed.
    std::fs::write(m.path(), b"6000 1 six\n7000 1 SEVEN\n8000 1 eight\n").unwrap();
    let q = m.read();
    assert_eq!((q.rereads, q.kept), (4, 3));
    assert_eq!(m.name(0x7000).as_deref(), Some("SEVEN"));
    // Rewritten the same, and longer: read on.
    std::fs::write(
        m.path(),
        b"6000 1 six\n7000 1 SEVEN\n8000 1 eight\n9000 1 nine\n",
    )
    .unwrap();
    let q = m.read();
    assert_eq!((q.rereads, q.kept, q.lines), (4, 4, 12));
}

#[test]
fn a_removed_map_is_read_on_from_the_file_held_open() {
    let m = Map::new();
    m.append(b"1000 10 one\n");
    m.read();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(m.path())
        .unwrap();
    std::fs::remove_file(m.path()).unwrap();
    f.write_all(b"2000 10 two\n").unwrap();
    let q = m.read();
    assert_eq!((q.kept, q.rereads), (2, 0));
    assert_eq!(m.name(0x2000).as_deref(), Some("two"));
}

/// A process writes its map, then exits before the map was first
/// read (`jcmd PID Compiler.perfmap` just before the end): the map is
/// found through this process's /tmp, the target's namespace being
/// this one.
#[test]
fn a_map_written_just_before_its_process_ended_is_read_after() {
    let mut child = std::process::Command::new("cat")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let shared = Shared::new(child.id());
    shared.ask();
    shared.wait(Instant::now() + Duration::from_secs(10));
    assert!(shared.quality().is_none(), "a map before it was written");
    let path = format!("/tmp/perf-{}.map", child.id());
    std::fs::write(&path, b"1000 10 last_words\n").unwrap();
    drop(child.stdin.take());
    child.wait().unwrap();
    shared.ask();
    shared.wait(Instant::now() + Duration::from_secs(10));
    let name = shared.name(0x1004);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(name.as_deref(), Some("last_words"));
}

#[test]
fn a_symbolic_link_or_fifo_at_its_path_is_not_read() {
    let m = Map::new();
    let target = m.dir.path().join("target");
    std::fs::write(&target, b"1000 10 through a link\n").unwrap();
    std::os::unix::fs::symlink(&target, m.path()).unwrap();
    m.read();
    assert_eq!(m.shared.quality(), None);
    assert_eq!(m.name(0x1000), None);
    std::fs::remove_file(m.path()).unwrap();
    // No writer: opening it to read would block without O_NONBLOCK;
    // it is not even opened.
    let c = std::ffi::CString::new(m.path().to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    m.read();
    assert_eq!(m.shared.quality(), None);
    // A regular file then is read.
    std::fs::remove_file(m.path()).unwrap();
    m.append(b"1000 10 a file\n");
    assert_eq!(m.read().kept, 1);
    assert_eq!(m.name(0x1000).as_deref(), Some("a file"));
}

#[test]
fn a_line_longer_than_a_slice_is_skipped_and_counted() {
    let m = Map::new();
    let mut text = b"1000 10 before\n2000 10 ".to_vec();
    text.resize(text.len() + 2 * SLICE + 100, b'x');
    text.extend_from_slice(b"\n3000 10 after\n");
    m.append(&text);
    let q = m.read();
    assert_eq!((q.lines, q.bad_lines, q.kept, q.unread_bytes), (2, 1, 2, 0));
    assert_eq!(m.name(0x1000).as_deref(), Some("before"));
    assert_eq!(m.name(0x2000), None);
    assert_eq!(m.name(0x3000).as_deref(), Some("after"));
}

#[test]
fn many_lines_are_read_in_slices_into_one_table() {
    let m = Map::new();
    let mut text = Vec::new();
    let n = 3 * BATCH_LINES as u64 + 17;
    for i in 0..n {
        writeln!(text, "{:x} 10 f{i}", 0x10_0000 + i * 0x10).unwrap();
    }
    m.append(&text);
    let q = m.read();
    assert_eq!((q.lines, q.kept, q.unread_bytes), (n, n, 0));
    for i in [0, 1, n / 2, n - 1] {
        assert_eq!(m.name(0x10_0000 + i * 0x10 + 5), Some(format!("f{i}")));
    }
}
