//! Debug information for stripped files, found by their GNU build id, as
//! gdb, perf and systemd-coredump find it: in the build-id trees of the
//! debug directories (`/usr/lib/debug/.build-id/ab/cdef….debug`), in the
//! debuginfod client's cache, or fetched from the servers `DEBUGINFOD_URLS`
//! names (once per build id and run, each fetch within a timeout, a server
//! that failed once not asked again). What could not be fetched is
//! counted, never waited for beyond the timeout: its frames stay addresses.

use std::{
    collections::HashMap,
    fs::File,
    io::Read,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
    time::Duration,
};

use crate::profile::SymbolsQuality;

/// The directories whose `.build-id` trees hold split debug files.
const DEBUG_DIRS: [&str; 2] = ["/usr/lib/debug", "/lib/debug"];

/// How long one fetch may take when `DEBUGINFOD_TIMEOUT` does not say
/// (elfutils waits 90 s; a trace's report should not).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest debug file fetched; a larger answer is refused.
const MAX_FETCH: u64 = 2 << 30;

/// `--no-debuginfod`: no server is asked (the local directories and the
/// cache still are).
static NO_SERVERS: AtomicBool = AtomicBool::new(false);

/// What was looked up in this run, and how it went.
static STATE: Mutex<Option<State>> = Mutex::new(None);

#[derive(Default)]
struct State {
    /// Build id (hex) -> its debug file, or none found.
    found: HashMap<String, Option<PathBuf>>,
    /// Servers that failed (timed out, refused, answered an error other
    /// than "not found"): not asked again.
    failed_servers: Vec<String>,
    quality: SymbolsQuality,
}

/// Turns the servers off for the rest of the run (`--no-debuginfod`).
pub fn disable_servers() {
    NO_SERVERS.store(true, Ordering::Relaxed);
}

/// What the lookups of this run found and missed; `None` when no
/// stripped file was met.
pub fn quality() -> Option<SymbolsQuality> {
    let state = STATE.lock().unwrap();
    state
        .as_ref()
        .map(|s| s.quality)
        .filter(|q| *q != SymbolsQuality::default())
}

/// The debug file of the file with build id `build_id` (hex), found or
/// fetched once per run: a file whose own build id is `build_id`.
pub fn debug_file(build_id: &str) -> Option<PathBuf> {
    if build_id.len() < 4 || !build_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut guard = STATE.lock().unwrap();
    let state = guard.get_or_insert_with(State::default);
    if let Some(known) = state.found.get(build_id) {
        return known.clone();
    }
    state.quality.stripped_files += 1;
    let found = match local(build_id) {
        Some(path) => {
            state.quality.local += 1;
            Some(path)
        }
        None => {
            let fetched = fetched(build_id, state);
            if fetched.is_none() && state.failed_servers.is_empty() {
                state.quality.not_on_servers += 1;
            }
            fetched
        }
    };
    state.found.insert(build_id.to_string(), found.clone());
    found
}

/// In a debug directory's build-id tree, or in the debuginfod cache.
fn local(build_id: &str) -> Option<PathBuf> {
    let (head, tail) = build_id.split_at(2);
    DEBUG_DIRS
        .iter()
        .map(|d| {
            Path::new(d)
                .join(".build-id")
                .join(head)
                .join(format!("{tail}.debug"))
        })
        .chain(cache_dir().map(|c| c.join(build_id).join("debuginfo")))
        .find(|p| p.metadata().is_ok_and(|m| m.is_file() && m.len() > 0) && is_of(p, build_id))
}

/// Whether the file at `path` is an ELF file whose build id is `id`
/// (hex): a debug file of another build would name the wrong functions.
fn is_of(path: &Path, id: &str) -> bool {
    let Ok(file) = File::open(path) else {
        return false;
    };
    let cache = object::read::ReadCache::new(&file);
    object::File::parse(&cache)
        .ok()
        .and_then(|o| build_id_hex(&o))
        .is_some_and(|b| b == id)
}

/// The debuginfod client's cache, where elfutils' client keeps it:
/// `$DEBUGINFOD_CACHE_PATH`, else `$XDG_CACHE_HOME/debuginfod_client`,
/// else `~/.cache/debuginfod_client`.
fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(p) = env("DEBUGINFOD_CACHE_PATH") {
        return Some(p.into());
    }
    if let Some(x) = env("XDG_CACHE_HOME") {
        return Some(Path::new(&x).join("debuginfod_client"));
    }
    env("HOME").map(|h| Path::new(&h).join(".cache/debuginfod_client"))
}

/// The servers `DEBUGINFOD_URLS` names (separated by spaces).
fn servers() -> Vec<String> {
    std::env::var("DEBUGINFOD_URLS")
        .unwrap_or_default()
        .split_whitespace()
        .map(|u| u.trim_end_matches('/').to_string())
        .filter(|u| !u.is_empty())
        .collect()
}

/// The per-fetch timeout: `DEBUGINFOD_TIMEOUT` seconds, as elfutils reads
/// it, else [`DEFAULT_TIMEOUT`].
fn timeout() -> Duration {
    std::env::var("DEBUGINFOD_TIMEOUT")
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok())
        .filter(|&t| t > 0)
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs)
}

/// Asks each server that has not failed yet for the debug file, and keeps
/// the first answer in the cache. Counts what it fetched, and what it
/// could not fetch for a server that failed (now or before).
fn fetched(build_id: &str, state: &mut State) -> Option<PathBuf> {
    if NO_SERVERS.load(Ordering::Relaxed) {
        return None;
    }
    let servers = servers();
    if servers.is_empty() {
        return None;
    }
    let cache = cache_dir()?;
    for server in servers {
        if state.failed_servers.contains(&server) {
            continue;
        }
        match fetch(&server, build_id, &cache) {
            Ok(Some(path)) => {
                state.quality.fetched += 1;
                return Some(path);
            }
            Ok(None) => {}
            Err(e) => {
                crate::say!("mtrace: debuginfod {server}: {e} (not asked again in this run)");
                state.failed_servers.push(server);
            }
        }
    }
    if !state.failed_servers.is_empty() {
        state.quality.not_fetched += 1;
    }
    None
}

/// `GET SERVER/buildid/ID/debuginfo` into `CACHE/ID/debuginfo`: the file,
/// none when the server does not have it, or why the server failed.
fn fetch(server: &str, build_id: &str, cache: &Path) -> Result<Option<PathBuf>, String> {
    let url = format!("{server}/buildid/{build_id}/debuginfo");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout()))
        .http_status_as_error(false)
        .build()
        .into();
    let response = agent.get(&url).call().map_err(|e| e.to_string())?;
    match response.status().as_u16() {
        200 => {}
        404 => return Ok(None),
        code => return Err(format!("HTTP {code}")),
    }
    let dir = cache.join(build_id);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut tmp = tempfile::NamedTempFile::new_in(&dir).map_err(|e| e.to_string())?;
    let mut body = response.into_body().into_reader().take(MAX_FETCH + 1);
    let n = std::io::copy(&mut body, &mut tmp).map_err(|e| e.to_string())?;
    if n > MAX_FETCH {
        return Err(format!("a debug file over {MAX_FETCH} bytes"));
    }
    if !is_of(tmp.path(), build_id) {
        return Err("the answer is not an ELF file of that build id".into());
    }
    let path = dir.join("debuginfo");
    tmp.persist(&path).map_err(|e| e.error.to_string())?;
    Ok(Some(path))
}

/// A stripped file's debug file, and how its file offsets become the
/// virtual addresses the debug file's symbols and DWARF are at.
#[derive(Clone, Debug)]
pub struct Split {
    pub path: PathBuf,
    /// `(file offset, size in the file, virtual address)` of each loaded
    /// segment.
    segments: Vec<(u64, u64, u64)>,
}

impl Split {
    /// The virtual address of file offset `offset` (itself where no loaded
    /// segment holds it).
    pub fn virtual_address(&self, offset: u64) -> u64 {
        self.segments
            .iter()
            .find(|&&(start, size, _)| offset >= start && offset - start < size)
            .map_or(offset, |&(start, _, vaddr)| offset - start + vaddr)
    }
}

thread_local! {
    /// What [`split_for`] found for each file, by its identity.
    static SPLITS: std::cell::RefCell<HashMap<crate::tracee::FileId, Option<Split>>> =
        std::cell::RefCell::new(HashMap::new());
}

/// The debug file of `file` when it is stripped (no `.symtab`, no
/// `.debug_info`) and has one; looked up once per file identity `id`.
pub fn split_for(file: &File, id: Option<crate::tracee::FileId>) -> Option<Split> {
    super::once_per_file(&SPLITS, id, || find_split(file))
}

fn find_split(file: &File) -> Option<Split> {
    use object::Object;
    let cache = object::read::ReadCache::new(file);
    let obj = object::File::parse(&cache).ok()?;
    if obj.section_by_name(".symtab").is_some() || obj.section_by_name(".debug_info").is_some() {
        return None;
    }
    let id = build_id_hex(&obj)?;
    let segments = loaded_segments(&obj);
    let path = debug_file(&id)?;
    Some(Split { path, segments })
}

/// The placing of `file`'s loaded segments, when its build id is
/// `build_id` (hex), with `debug` as its debug file: how a saved frame's
/// file offset in it becomes an address of `debug` where the file itself
/// is at hand.
pub fn split_of(file: &File, build_id: &str, debug: PathBuf) -> Option<Split> {
    let cache = object::read::ReadCache::new(file);
    let obj = object::File::parse(&cache).ok()?;
    (build_id_hex(&obj)? == build_id).then(|| Split {
        path: debug,
        segments: loaded_segments(&obj),
    })
}

/// The GNU build id of `obj`, in hex.
pub fn build_id_hex<'d, R: object::ReadRef<'d>>(obj: &object::File<'d, R>) -> Option<String> {
    use object::Object;
    Some(
        obj.build_id()
            .ok()??
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
    )
}

/// `(file offset, size in the file, virtual address)` of each loaded
/// segment of `obj`.
fn loaded_segments<'d, R: object::ReadRef<'d>>(obj: &object::File<'d, R>) -> Vec<(u64, u64, u64)> {
    use object::{Object, ObjectSegment};
    obj.segments()
        .map(|s| {
            let (offset, size) = s.file_range();
            (offset, size, s.address())
        })
        .collect()
}
