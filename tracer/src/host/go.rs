//! The Go programs of the host scope: their own heap (what they allocate
//! passes through no allocator file), found among the scope's processes
//! and read as a trace by pid reads it ([`crate::golang`]).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::files::{self, FileKey};
use crate::{
    golang::{self, GoProcess},
    profile::{ProcessRef, Profile, Unseen},
    tracee,
};

/// Go programs whose heap cannot be read that are named, at most.
const UNSEEN_KEPT: usize = 64;

/// The scope's Go programs and what was found of them.
#[derive(Default)]
pub struct GoHeaps {
    /// By pid, read at each reading.
    running: BTreeMap<u32, Box<GoProcess>>,
    /// Executables looked at, by file: whether each is a Go program.
    exes: HashMap<FileKey, bool>,
    /// Programs made known at their exec stop whose exec the kernel's
    /// word has not told yet.
    execd: HashSet<u32>,
    /// Programs whose heap cannot be read, one line each (at most
    /// [`UNSEEN_KEPT`]).
    unseen: Vec<Unseen>,
    /// Programs ended without rows (gone before their heap was read, or
    /// sampling nothing), by why.
    unread: Unread,
    /// Processes whose runtime's own heap (a JVM's, V8's) was said, with
    /// that heap's name.
    said_unseen: HashSet<(u32, String)>,
}

impl GoHeaps {
    /// What process `pid` (its mappings `maps`, its `/proc/PID/maps`)
    /// keeps unseen beside malloc's calls: a JVM's Java heap, V8's
    /// JavaScript heap, a JVM's stacks past its first Java frame; said
    /// once per process, as a trace by pid says it.
    pub fn look_unseen(&mut self, pid: u32, maps: &str) {
        if !maps.contains("libjvm.so") && !maps.contains("node") {
            return;
        }
        let mappings = tracee::parse_maps(maps);
        let name = tracee::comm(pid);
        let exe = tracee::executable(pid);
        for u in golang::unseen::detect(pid, &name, &exe, &mappings) {
            if self.unseen.len() < UNSEEN_KEPT && self.said_unseen.insert((pid, u.heap.clone())) {
                self.unseen.push(u);
            }
        }
    }

    /// Whether process `pid` is a Go program, whose own heap is then read
    /// at each reading (`new`: it exec'd after mtrace came, and counts
    /// from its start). Each executable is looked at once.
    pub fn look(&mut self, pid: u32, new: bool) {
        if self.running.contains_key(&pid) {
            return;
        }
        let Some(key) = files::key_of_path(std::path::Path::new(&format!("/proc/{pid}/exe")))
        else {
            return;
        };
        if self.exes.get(&key) == Some(&false) {
            return;
        }
        let Ok(maps) = tracee::read_maps(pid) else {
            return;
        };
        match golang::detect(pid, &maps) {
            golang::Found::None => {
                self.exes.insert(key, false);
            }
            golang::Found::Go(mut go) => {
                self.exes.insert(key, true);
                if new {
                    go.count_from_start();
                }
                log::debug!("pid {pid}: {}, its own heap read", go.version());
                self.running.insert(pid, go);
            }
            golang::Found::Unreadable(u) => {
                self.exes.insert(key, true);
                if self.unseen.len() < UNSEEN_KEPT {
                    self.unseen.push(u);
                }
            }
        }
    }

    /// A followed tree's process exec'd a Go program and waits at its
    /// exec stop: the program it ran before has ended, this one counts
    /// from its start. The ended one's rows, if any.
    pub fn started_at_exec(&mut self, pid: u32) -> Option<Profile> {
        let before = self.ended(pid);
        self.look(pid, true);
        self.execd.insert(pid);
        before
    }

    /// A followed tree's Go program waits at its exit: read once more.
    pub fn exiting(&mut self, pid: u32) {
        if let Some(go) = self.running.get_mut(&pid) {
            go.keep_exit_reading();
        }
    }

    /// The kernel's word that `pid` exec'd: the Go program it ran before
    /// has ended (unless this exec's program is the one made known at its
    /// exec stop). Its rows, if any.
    pub fn execd(&mut self, pid: u32) -> Option<Profile> {
        if self.execd.remove(&pid) {
            return None;
        }
        self.ended(pid)
    }

    /// The look for processes gone (every 5 s): the rows of those gone,
    /// as last read; the others are read now (a program that ends before
    /// the next look is shown as of this one, said `read last before it
    /// ended`).
    pub fn fold(&mut self) -> Vec<Profile> {
        let gone: Vec<u32> = self
            .running
            .keys()
            .copied()
            .filter(|&t| !tracee::cgroup::is_alive(t))
            .collect();
        let parts = gone
            .iter()
            .filter_map(|&pid| {
                self.execd.remove(&pid);
                self.ended(pid)
            })
            .collect();
        for go in self.running.values() {
            go.refresh();
        }
        parts
    }

    /// Program `pid` has ended or exec'd: its rows and record as last
    /// read, to join those of processes gone; `None` when it has none
    /// (then why is one line with the others of that why).
    fn ended(&mut self, pid: u32) -> Option<Profile> {
        let mut go = self.running.remove(&pid)?;
        go.ended();
        let mut part = Profile::default();
        if go.has_reading() {
            add_rows(&go, &mut part);
        } else {
            // Gone before any reading (it lived less than the 5 s
            // between them).
            part.unseen.push(Unseen {
                pid: go.pid,
                name: go.name.clone(),
                heap: "go heap".into(),
                why: "gone before mtrace read its heap (it reads each every 5 s, and at a followed tree's exits)".into(),
            });
        }
        if part.stacks.is_empty() && part.go_heaps.is_empty() {
            for u in part.unseen {
                self.unread.push(u);
            }
            return None;
        }
        Some(part)
    }

    /// A reading: the rows and records of the programs known, read now,
    /// and the lines of those that cannot be read, added to `live`. Those
    /// ended (held at their exit) without rows join the lines of those
    /// gone so.
    pub fn add_to(&self, live: &mut Profile) {
        let mut unread = self.unread.clone();
        for go in self.running.values() {
            let mut part = Profile::default();
            add_rows(go, &mut part);
            if go.has_reading() && part.stacks.is_empty() && part.go_heaps.is_empty() {
                for u in part.unseen {
                    unread.push(u);
                }
                continue;
            }
            live.stacks.extend(part.stacks);
            live.go_heaps.extend(part.go_heaps);
            live.unseen.extend(part.unseen);
        }
        live.unseen.extend(self.unseen.iter().cloned());
        live.unseen.extend(unread.lines());
    }
}

/// A Go program's rows, each under its process, and its record, added to
/// `profile` (their calls are the runtime's samples, scaled: not in the
/// totals of calls the probes counted).
fn add_rows(go: &GoProcess, profile: &mut Profile) {
    let from = profile.stacks.len();
    go.add_to(profile);
    for st in &mut profile.stacks[from..] {
        st.process = Some(ProcessRef {
            pid: go.pid,
            name: go.name.clone(),
        });
    }
}

/// Go programs ended without rows, by why (a handful of reasons: bounded
/// whatever the number of programs): how many, and the last one.
#[derive(Clone, Default)]
struct Unread {
    by_why: BTreeMap<String, (u64, Unseen)>,
}

impl Unread {
    fn push(&mut self, u: Unseen) {
        let entry = self.by_why.entry(u.why.clone()).or_insert((0, u.clone()));
        entry.0 += 1;
        entry.1 = u;
    }

    /// A line per why: the last one's, with how many more.
    fn lines(&self) -> impl Iterator<Item = Unseen> + '_ {
        self.by_why.values().map(|(n, u)| Unseen {
            name: match n {
                1 => u.name.clone(),
                n => format!("{} and {} more Go programs", u.name, n - 1),
            },
            ..u.clone()
        })
    }
}
