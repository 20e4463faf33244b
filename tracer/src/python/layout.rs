//! Which CPython a process runs, and where its threads' frames are: the
//! [`PythonLayout`] the BPF programs follow, by the interpreter's own
//! version number.

use object::{Object, ObjectSegment, ObjectSymbol};
use tracer_common::{py_entry, PythonLayout, PY_FRAME_READ};

use crate::tracee::{path_in_target, Mapping};

/// A CPython interpreter found in a process.
#[derive(Clone, Debug)]
pub struct Interpreter {
    /// The object that defines `_PyRuntime` (the executable, or libpython).
    pub path: String,
    pub minor: u8,
    pub layout: PythonLayout,
    /// Its symbol table lacks `_PyObject_Malloc`: a stripped build, where
    /// link-time optimisation may have copied the object allocator into its
    /// callers (Debian's), out of reach of probes on its entry points.
    pub allocator_hidden: bool,
    /// Its file has no symbols of its own functions and no debug file is
    /// installed for it: the interpreter's C frames are addresses.
    pub unnamed: bool,
    /// The target's root is a Debian system (`/etc/debian_version`).
    pub debian: bool,
}

impl Interpreter {
    /// `CPython 3.X in OBJECT`.
    pub fn name(&self) -> String {
        format!("CPython 3.{} in {}", self.minor, self.path)
    }

    /// For the report's header: `CPython 3.X in OBJECT`, and what to
    /// install when the interpreter's own frames cannot be named.
    pub fn describe(&self) -> String {
        let mut said = self.name();
        if self.unnamed {
            let remedy = if self.debian {
                format!("Debian's python3.{}-dbg of the same version", self.minor)
            } else {
                "its distribution's debug symbols".to_string()
            };
            said.push_str(&format!(
                " (stripped, no debug file installed: its own C functions show as addresses; {remedy} names them)"
            ));
        }
        said
    }
}

/// Whether `file` (at `path` in `pid`'s root) has neither a symbol table
/// nor a debug file where debuggers look: by build id under
/// /usr/lib/debug/.build-id, or by its `.gnu_debuglink` name beside it,
/// in its `.debug` directory or under /usr/lib/debug.
fn without_symbols(pid: u32, path: &str, file: &object::File) -> bool {
    if file.section_by_name(".symtab").is_some() || file.section_by_name(".debug_info").is_some() {
        return false;
    }
    let root = |p: &str| path_in_target(pid, p);
    if let Ok(Some(id)) = file.build_id() {
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        if hex.len() > 2 {
            let by_id = format!("/usr/lib/debug/.build-id/{}/{}.debug", &hex[..2], &hex[2..]);
            if root(&by_id).exists() {
                return false;
            }
        }
    }
    if let Ok(Some((name, _))) = file.gnu_debuglink() {
        let name = String::from_utf8_lossy(name);
        let dir = path.rsplit_once('/').map_or("", |(d, _)| d);
        let found = [
            format!("{dir}/{name}"),
            format!("{dir}/.debug/{name}"),
            format!("/usr/lib/debug{dir}/{name}"),
        ]
        .iter()
        .any(|p| root(p).is_file());
        if found {
            return false;
        }
    }
    true
}

/// What a process holds of Python.
#[derive(Clone, Debug)]
pub enum Found {
    /// No CPython interpreter mapped.
    None,
    Known(Interpreter),
    /// An interpreter whose frames mtrace cannot read: why, in one line.
    Unknown(String),
}

/// Offsets by minor version (CPython 3.x on x86_64, release builds), from
/// the interpreters' debug information.
fn layout_of(minor: u8) -> Option<PythonLayout> {
    let mut l = PythonLayout {
        tstate_next: 8,
        tstate_interp: 0x10,
        ..PythonLayout::default()
    };
    match minor {
        8..=10 => {
            l.interp_head = 0x20;
            l.tstate_id = 0x100;
            l.threads_head = 0x8;
            // `thread_id`: pthread_self(), compared with the fs base.
            l.tstate_tid = 0xb0;
            l.tid_is_pthread = 1;
            // `PyThreadState.frame`, a PyFrameObject: f_back, f_code, f_lasti.
            l.tstate_frame = 0x18;
            l.frame_back = 0x18;
            l.frame_code = 0x20;
            l.frame_instr = if minor == 10 { 0x60 } else { 0x68 };
            l.entry = py_entry::EVERY;
        }
        11 => {
            l.interp_head = 0x28;
            l.threads_head = 0x10;
            l.tstate_id = 0xf0;
            l.tstate_tid = 0xa0;
            l.tstate_frame = 0x38;
            l.via_cframe = 1;
            l.cframe_frame = 0x8;
            l.frame_code = 0x20;
            l.frame_back = 0x30;
            l.frame_instr = 0x38;
            l.frame_entry = 0x44;
            l.entry = py_entry::FLAG;
            l.instr_is_ptr = 1;
        }
        12 | 13 => {
            l.interp_head = 0x28;
            l.threads_head = 0x48;
            l.tstate_id = 0xe0;
            l.tstate_tid = 0x90;
            l.tstate_frame = 0x38;
            l.via_cframe = 1;
            l.cframe_frame = 0;
            l.frame_code = 0;
            l.frame_back = 0x8;
            l.frame_instr = 0x38;
            l.frame_entry = 0x46;
            l.entry = py_entry::SHIM;
            l.instr_is_ptr = 1;
            if minor == 13 {
                // The frames as 3.12's; the thread state holds the current
                // frame itself (no _PyCFrame), further along.
                l.interp_head = 0x278;
                l.threads_head = 0x1cb0;
                l.tstate_tid = 0xa0;
                l.tstate_frame = 0x48;
                l.via_cframe = 0;
            }
        }
        _ => return None,
    }
    let code = super::code::CodeLayout::for_minor(minor as u32)?;
    l.code_firstlineno = code.co_firstlineno as u32;
    l.code_filename = code.co_filename as u32;
    l.minor = minor as u32;
    l.code_name = code.co_qualname.unwrap_or(code.co_name) as u32;
    l.code_linetable = code.co_linetable as u32;
    l.code_code = code.co_code.unwrap_or(0) as u32;
    let last = [l.frame_code, l.frame_back, l.frame_instr]
        .into_iter()
        .map(|o| o + 8)
        .chain([l.frame_entry + 1])
        .max()
        .unwrap_or(0);
    l.frame_read = last.min(PY_FRAME_READ as u32);
    Some(l)
}

/// Looks for a CPython interpreter among the objects `pid` maps: the one
/// that defines `_PyRuntime`, its version from `Py_Version` (3.11 and
/// later) or from its name (`libpython3.X`).
pub fn detect(pid: u32, maps: &[Mapping]) -> Found {
    let mut seen: Vec<&str> = Vec::new();
    for m in maps.iter().filter(|m| m.is_file() && m.offset == 0) {
        let name = crate::profile::short_path(&m.path);
        if !name.contains("python") || seen.contains(&m.path.as_str()) {
            continue;
        }
        seen.push(&m.path);
        // Mapped, not read: libpython is tens of MiB, and a test suite
        // starts many interpreters.
        let Ok(f) = std::fs::File::open(path_in_target(pid, &m.path)) else {
            continue;
        };
        // SAFETY: a read-only mapping of a file the target maps, only read
        // as bytes (see unwind::object_cfi for the caveat).
        let Ok(data) = (unsafe { memmap2::Mmap::map(&f) }) else {
            continue;
        };
        let Ok(file) = object::File::parse(&*data) else {
            continue;
        };
        let symbol = |wanted: &str| {
            file.dynamic_symbols()
                .chain(file.symbols())
                .find(|s| s.name() == Ok(wanted) && s.address() != 0)
        };
        let Some(runtime) = symbol("_PyRuntime") else {
            continue;
        };
        let Some(first_load) = file.segments().map(|s| s.address()).min() else {
            continue;
        };
        let bias = m.start.wrapping_sub(first_load & !0xfff);
        let version = symbol("Py_Version")
            .and_then(|s| read_u32_at(&file, &data, s.address()))
            .map(|v| ((v >> 24) as u8, (v >> 16) as u8))
            .or_else(|| version_in_name(name));
        let Some((major, minor)) = version else {
            return Found::Unknown(format!(
                "a Python interpreter of unknown version in {}: native frames only",
                m.path
            ));
        };
        let Some(mut layout) = (major == 3).then(|| layout_of(minor)).flatten() else {
            return Found::Unknown(format!(
                "Python {major}.{minor} in {}, whose frames mtrace cannot read yet: native frames only",
                m.path
            ));
        };
        if minor >= 13 {
            // 3.13 publishes its own offsets at the start of _PyRuntime:
            // what they say must be what the table says (a free-threaded
            // or otherwise configured build lays its structures out
            // differently).
            let offsets = read_bytes_at(&file, &data, runtime.address(), DEBUG_OFFSETS_LEN);
            if let Err(why) = offsets
                .ok_or("unreadable")
                .and_then(|d| debug_offsets_agree(d, &layout))
            {
                return Found::Unknown(format!(
                    "Python 3.{minor} in {}, whose own debug offsets ({why}) are not the ones mtrace knows: native frames only",
                    m.path
                ));
            }
        }
        layout.runtime = bias.wrapping_add(runtime.address());
        if layout.tid_is_pthread != 0 {
            match super::btf::task_fsbase_offset() {
                Some(off) => layout.task_fsbase = off,
                None => {
                    return Found::Unknown(format!(
                        "Python 3.{minor} in {}, whose threads only the kernel's BTF (/sys/kernel/btf/vmlinux) tells apart: native frames only",
                        m.path
                    ))
                }
            }
        }
        return Found::Known(Interpreter {
            path: m.path.clone(),
            minor,
            layout,
            allocator_hidden: symbol("_PyObject_Malloc").is_none(),
            unnamed: without_symbols(pid, &m.path, &file),
            debian: path_in_target(pid, "/etc/debian_version").exists(),
        });
    }
    Found::None
}

/// `(3, X)` from `libpython3.X.so…` or `python3.X`.
fn version_in_name(name: &str) -> Option<(u8, u8)> {
    let rest = &name[name.find("python3.")? + "python3.".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some((3, digits.parse().ok()?))
}

/// The `u32` at virtual address `vaddr` of the file (little-endian).
fn read_u32_at(file: &object::File, data: &[u8], vaddr: u64) -> Option<u32> {
    let b = read_bytes_at(file, data, vaddr, 4)?;
    Some(u32::from_le_bytes(b.try_into().ok()?))
}

/// `len` bytes at virtual address `vaddr` of the file, where its
/// segments hold them (initialised data).
fn read_bytes_at<'a>(
    file: &object::File,
    data: &'a [u8],
    vaddr: u64,
    len: u64,
) -> Option<&'a [u8]> {
    file.segments().find_map(|seg| {
        let (off, size) = seg.file_range();
        let addr = seg.address();
        if vaddr < addr || vaddr + len > addr + size {
            return None;
        }
        let at = (off + vaddr - addr) as usize;
        data.get(at..at + len as usize)
    })
}

/// Bytes of 3.13's `_Py_DebugOffsets` read: up to its code object part.
const DEBUG_OFFSETS_LEN: u64 = 352;

/// Whether 3.13's `_Py_DebugOffsets` (`d`, as the interpreter's file
/// initialises it) give the offsets of `layout` and of the code-object
/// table; else which one differs.
fn debug_offsets_agree(d: &[u8], layout: &PythonLayout) -> Result<(), &'static str> {
    let word = |at: usize| u64::from_le_bytes(d[at..at + 8].try_into().unwrap());
    if &d[..8] != b"xdebugpy" {
        return Err("no cookie");
    }
    if word(16) != 0 {
        return Err("free-threaded");
    }
    let code = super::code::CodeLayout::for_minor(13).ok_or("no code layout")?;
    let checks: [(&'static str, usize, u64); 13] = [
        ("interpreters_head", 40, layout.interp_head as u64),
        ("threads_head", 72, layout.threads_head as u64),
        ("next", 168, layout.tstate_next as u64),
        ("interp", 176, layout.tstate_interp as u64),
        ("current_frame", 184, layout.tstate_frame as u64),
        ("native_thread_id", 200, layout.tstate_tid as u64),
        ("previous", 232, layout.frame_back as u64),
        ("executable", 240, layout.frame_code as u64),
        ("instr_ptr", 248, layout.frame_instr as u64),
        ("owner", 264, layout.frame_entry as u64),
        ("filename", 280, code.co_filename),
        ("firstlineno", 312, code.co_firstlineno),
        ("co_code_adaptive", 344, code.co_code_adaptive.unwrap_or(0)),
    ];
    for (what, at, want) in checks {
        if word(at) != want {
            return Err(what);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_from_names() {
        assert_eq!(version_in_name("libpython3.10.so.1.0"), Some((3, 10)));
        assert_eq!(version_in_name("python3.8"), Some((3, 8)));
        assert_eq!(version_in_name("python"), None);
    }

    /// pyenv's 3.13 says its own offsets: the table's.
    #[test]
    fn debug_offsets_of_3_13_agree_with_the_table() {
        let path = "/root/.pyenv/versions/3.13.0/lib/libpython3.13.so.1.0";
        let Ok(data) = std::fs::read(path) else {
            assert!(std::env::var_os("CI").is_none(), "{path} missing");
            return;
        };
        let file = object::File::parse(&*data).unwrap();
        let runtime = file
            .dynamic_symbols()
            .find(|s| s.name() == Ok("_PyRuntime"))
            .unwrap();
        let d = read_bytes_at(&file, &data, runtime.address(), DEBUG_OFFSETS_LEN).unwrap();
        assert_eq!(debug_offsets_agree(d, &layout_of(13).unwrap()), Ok(()));
        let mut other = layout_of(13).unwrap();
        other.tstate_tid += 8;
        assert_eq!(debug_offsets_agree(d, &other), Err("native_thread_id"));
    }

    #[test]
    fn every_known_layout_reads_within_a_frame_read() {
        for minor in 8..=13 {
            let l = layout_of(minor).unwrap();
            assert!(l.frame_read as usize <= PY_FRAME_READ && l.frame_read >= 16);
            // The probe reads co_filename and co_name as one.
            let code = super::super::code::CodeLayout::for_minor(minor as u32).unwrap();
            assert_eq!(code.co_name, code.co_filename + 8, "3.{minor}");
        }
        assert!(layout_of(7).is_none() && layout_of(14).is_none());
    }
}
