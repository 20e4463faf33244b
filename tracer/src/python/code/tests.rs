//! Real interpreters: a script defines a variety of functions and prints,
//! for every code object, its address and what Python says of it (name,
//! file, first line, the line of every bytecode byte offset); the test
//! reads each one out of the live process and compares. Plus garbage
//! addresses, and made-up objects with absurd fields.

use super::*;
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
};

/// The functions whose code objects are checked. `#GAP n` lines become
/// n empty lines and `WIDE` a 200-term sum (many bytes of bytecode on one
/// line), so that the tables need their multi-entry and long forms.
const PAYLOAD: &str = include_str!("fixtures/payload.py");

/// A module in a file with a non-ASCII path (directory and name).
const MODULE_DIR: &str = "dïr_文件";
const MODULE_FILE: &str = "módulo_ñ.py";
const MODULE: &str = include_str!("fixtures/module.py");

/// Loads both, runs them, prints one line of JSON and waits until its
/// parent (the test) goes.
const RUNNER: &str = include_str!("fixtures/runner.py");

#[derive(serde::Deserialize)]
struct Report {
    version: Vec<u32>,
    code_basicsize: u64,
    str_basicsize: u64,
    ascii_sizeof_empty: u64,
    codes: Vec<Expected>,
    marks: Vec<Mark>,
    not_code: Vec<u64>,
}

#[derive(serde::Deserialize)]
struct Expected {
    addr: u64,
    name: String,
    file: String,
    first_line: u32,
    code_len: u32,
    /// The line of every bytecode byte offset.
    lines: Vec<Option<u32>>,
    /// The offsets where instructions start (caches are not instructions).
    instrs: Vec<u32>,
}

/// A frame in the middle of a call, as Python reports it.
#[derive(serde::Deserialize)]
struct Mark {
    code: u64,
    /// `frame.f_lasti`: a byte offset in every version.
    lasti: i64,
    line: u32,
}

/// The interpreter under test; killed when the test ends.
struct Target(Child);

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The value the BPF probe records for a frame at bytecode byte offset
/// `off` (negative: not started), by version: the inverse of
/// [`Code::byte_offset`].
fn raw_for(layout: &CodeLayout, off: i64) -> u32 {
    match layout.instr {
        InstrForm::LastiBytes => off as i32 as u32,
        InstrForm::LastiUnits => (off.div_euclid(2)) as i32 as u32,
        InstrForm::FromCodeObject => (layout.co_code_adaptive.unwrap() as i64 + off) as u32,
    }
}

/// What a run covered.
#[derive(Default)]
struct Seen {
    codes: usize,
    offsets: usize,
    no_line: usize,
    /// Line table features: location codes (3.11+), or the kinds of
    /// pairs (3.8-3.10).
    features: BTreeSet<String>,
}

fn interpreter(path: &str) -> Option<&Path> {
    let p = Path::new(path);
    if p.exists() {
        return Some(p);
    }
    if std::env::var_os("CI").is_some() {
        panic!("{path} is missing (CI is set: every interpreter must be tested)");
    }
    eprintln!("skipping: no {path}");
    None
}

fn table_features(layout: &CodeLayout, table: &[u8], seen: &mut BTreeSet<String>) {
    match layout.line_format {
        Format::Locations => {
            for &b in table.iter().filter(|&&b| b & 0x80 != 0) {
                seen.insert(format!("code {}", linetable::location_code(b)));
            }
        }
        Format::Linetable310 | Format::Lnotab => {
            for pair in table.chunks_exact(2) {
                let (bytes, line) = (pair[0], pair[1] as i8);
                if bytes == 0 {
                    seen.insert("zero bytes".into());
                }
                if bytes >= 254 {
                    seen.insert("split bytes".into());
                }
                if line == 127 {
                    seen.insert("split line forward".into());
                }
                if line == -128 {
                    seen.insert("-128".into());
                }
                if line < 0 {
                    seen.insert("line backwards".into());
                }
            }
        }
    }
}

/// Runs `python` (3.`minor`) with `args` on the script and checks every
/// code object it reports.
fn check(python: &Path, minor: u32, args: &[&str], seen: &mut Seen) {
    let layout = CodeLayout::for_minor(minor).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("payload.py"), PAYLOAD).unwrap();
    std::fs::write(dir.path().join("runner.py"), RUNNER).unwrap();
    std::fs::create_dir(dir.path().join(MODULE_DIR)).unwrap();
    std::fs::write(dir.path().join(MODULE_DIR).join(MODULE_FILE), MODULE).unwrap();
    let child = Command::new(python)
        .args(args)
        .arg(dir.path().join("runner.py"))
        .args([MODULE_DIR, MODULE_FILE])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut target = Target(child);
    let mut line = String::new();
    BufReader::new(target.0.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(!line.is_empty(), "{} printed nothing", python.display());
    let report: Report = serde_json::from_str(&line).unwrap();
    assert_eq!(report.version[..2], [3, minor], "{}", python.display());

    // What the interpreter itself says of the layout.
    if let Some(adaptive) = layout.co_code_adaptive {
        assert_eq!(report.code_basicsize, adaptive, "co_code_adaptive");
    }
    assert_eq!(report.str_basicsize, layout.unicode.compact_data + 8);
    assert_eq!(report.ascii_sizeof_empty, layout.unicode.ascii_data + 1);

    let mem = ProcessMemory::open(target.0.id()).unwrap();
    let mut by_addr = HashMap::new();
    let mut names = BTreeSet::new();
    for e in &report.codes {
        let code = read_code(&mem, layout, e.addr)
            .unwrap_or_else(|err| panic!("{} at {:#x}: {err}", e.name, e.addr));
        assert_eq!(code.name, e.name);
        assert_eq!(code.file, e.file);
        assert_eq!(code.first_line, e.first_line, "{}", e.name);
        assert_eq!(code.code_len, e.code_len, "{}", e.name);
        assert_eq!(e.lines.len(), e.code_len as usize);
        for (off, &want) in e.lines.iter().enumerate() {
            assert_eq!(code.line_at_offset(off as u32), want, "{} +{off}", e.name);
            // 3.10's f_lasti counts code units: only even offsets.
            if layout.instr != InstrForm::LastiUnits || off % 2 == 0 {
                let raw = raw_for(layout, off as i64);
                assert_eq!(code.line(raw), want, "{} +{off} raw {raw}", e.name);
            }
            seen.no_line += usize::from(want.is_none());
        }
        // Every code unit of an instruction, its caches included, has the
        // instruction's line (what a frame in the middle of a call needs).
        let ends = e.instrs.iter().skip(1).copied().chain([e.code_len]);
        for (start, end) in e.instrs.iter().copied().zip(ends) {
            let want = e.lines[start as usize];
            for off in (start..end).step_by(2) {
                assert_eq!(code.line(raw_for(layout, off.into())), want, "{}", e.name);
            }
        }
        // Not started: the first line. Past the end: none.
        assert_eq!(code.line(raw_for(layout, -2)), Some(e.first_line));
        assert_eq!(code.line(raw_for(layout, e.code_len.into())), None);
        table_features(layout, code.line_table(), &mut seen.features);
        seen.codes += 1;
        seen.offsets += e.lines.len();
        names.insert(code.name.clone());
        by_addr.insert(e.addr, (code, e));
    }
    // The variety the script is meant to have.
    for name in ["café_crème", "функция", "𠀀𠀁", "<lambda>", "gaps"] {
        assert!(names.contains(name), "{name} in {names:?}");
    }
    let file = dir.path().join(MODULE_DIR).join(MODULE_FILE);
    assert!(by_addr.values().any(|(c, _)| Path::new(&c.file) == file));
    if minor >= 11 {
        assert!(names.contains("Outer.Inner.deep.<locals>.closure"));
        assert!(names.contains("Ünïcode.方法"));
    }

    // Frames in the middle of a call, with the line Python gives them.
    assert!(report.marks.len() >= 5);
    let mut positions = BTreeMap::new();
    for m in &report.marks {
        let (code, e) = &by_addr[&m.code];
        let raw = match layout.instr {
            // Python's f_lasti is in bytes; 3.10 stores code units.
            InstrForm::LastiUnits => (m.lasti / 2) as u32,
            _ => raw_for(layout, m.lasti),
        };
        assert_eq!(
            code.line(raw),
            Some(m.line),
            "{} f_lasti {}",
            e.name,
            m.lasti
        );
        // Which code unit of its instruction the frame points at.
        let start = e.instrs.iter().rev().find(|&&s| i64::from(s) <= m.lasti);
        let unit = (m.lasti - i64::from(*start.unwrap())) / 2;
        *positions.entry(unit).or_insert(0) += 1;
    }
    eprintln!(
        "{} {args:?}: mid-call frames at code unit (0 = opcode) -> count: {positions:?}",
        python.display()
    );

    // Not code objects: errors, not panics.
    for &addr in &report.not_code {
        assert!(matches!(
            read_code(&mem, layout, addr),
            Err(CodeError::NotCode { .. })
        ));
    }
    // Inside a code object, not at its start, too.
    let inside = report.codes[0].addr + 8;
    for addr in [0, 0x10, u64::MAX - 4, inside] {
        assert!(read_code(&mem, layout, addr).is_err(), "{addr:#x}");
    }
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", target.0.id())).unwrap();
    let stack = maps.lines().find(|l| l.ends_with("[stack]")).unwrap();
    let (lo, hi) = stack
        .split_whitespace()
        .next()
        .unwrap()
        .split_once('-')
        .unwrap();
    let (lo, hi) = (
        u64::from_str_radix(lo, 16).unwrap(),
        u64::from_str_radix(hi, 16).unwrap(),
    );
    for addr in [hi - 64, hi - 4096, hi - 4096 + 8, lo, ((lo + hi) / 2) & !7] {
        assert!(read_code(&mem, layout, addr).is_err(), "stack {addr:#x}");
    }
}

fn check_interpreter(path: &str, minor: u32) {
    let Some(python) = interpreter(path) else {
        return;
    };
    let mut seen = Seen::default();
    check(python, minor, &[], &mut seen);
    if minor >= 11 {
        // Without column information, entries take the "no columns" form.
        check(python, minor, &["-X", "no_debug_ranges"], &mut seen);
    }
    eprintln!(
        "{path}: {} code objects, {} offsets ({} without a line), table features {:?}",
        seen.codes, seen.offsets, seen.no_line, seen.features
    );
    let want: &[&str] = match CodeLayout::for_minor(minor).unwrap().line_format {
        Format::Lnotab => &["split bytes", "split line forward", "line backwards"],
        Format::Linetable310 => &[
            "zero bytes",
            "split bytes",
            "split line forward",
            "line backwards",
            "-128",
        ],
        Format::Locations => &[
            "code 0", "code 10", "code 11", "code 12", "code 13", "code 14", "code 15",
        ],
    };
    for f in want {
        assert!(seen.features.contains(*f), "{path}: no {f}");
    }
}

#[test]
fn python_3_8_pyenv() {
    check_interpreter("/root/.pyenv/versions/3.8.18/bin/python3.8", 8);
}

#[test]
fn python_3_9_pyenv() {
    check_interpreter("/root/.pyenv/versions/3.9.18/bin/python3.9", 9);
}

#[test]
fn python_3_10_pyenv() {
    check_interpreter("/root/.pyenv/versions/3.10.13/bin/python3.10", 10);
}

#[test]
fn python_3_11_pyenv() {
    check_interpreter("/root/.pyenv/versions/3.11.7/bin/python3.11", 11);
}

#[test]
fn python_3_11_debian() {
    check_interpreter("/usr/bin/python3.11", 11);
}

#[test]
fn python_3_12_pyenv() {
    check_interpreter("/root/.pyenv/versions/3.12.1/bin/python3.12", 12);
}

#[test]
fn python_3_13_pyenv() {
    check_interpreter("/root/.pyenv/versions/3.13.0/bin/python3.13", 13);
}

#[test]
fn python_layouts_cover_3_8_to_3_13() {
    for minor in 8..=13 {
        let l = CodeLayout::for_minor(minor).unwrap();
        assert_eq!(l.minor, minor);
        assert_eq!(l.co_qualname.is_some(), minor >= 11);
        assert_eq!(l.co_code_adaptive.is_some(), minor >= 11);
        assert_eq!(l.co_code.is_some(), minor < 11);
    }
    assert!(CodeLayout::for_minor(7).is_none());
    assert!(CodeLayout::for_minor(14).is_none());
}

/// Memory made up of a few regions, for objects with chosen fields.
#[derive(Default)]
struct FakeMemory(Vec<(u64, Vec<u8>)>);

impl FakeMemory {
    fn put(&mut self, addr: u64, bytes: &[u8]) {
        self.0.push((addr, bytes.to_vec()));
    }
    fn put_u32(&mut self, addr: u64, v: u32) {
        self.put(addr, &v.to_le_bytes());
    }
    fn put_u64(&mut self, addr: u64, v: u64) {
        self.put(addr, &v.to_le_bytes());
    }
}

impl Memory for FakeMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        // The last region written that holds the whole range wins.
        for (start, bytes) in self.0.iter().rev() {
            let Some(from) = addr.checked_sub(*start) else {
                continue;
            };
            let end = from.checked_add(buf.len() as u64);
            if end.is_some_and(|end| end <= bytes.len() as u64) {
                buf.copy_from_slice(&bytes[from as usize..from as usize + buf.len()]);
                return Ok(());
            }
        }
        Err(io::Error::from_raw_os_error(libc::EIO))
    }
}

const CODE: u64 = 0x1000;
const TYPE: u64 = 0x2000;
const TYPE_NAME: u64 = 0x3000;
const NAME: u64 = 0x4000;
const FILE: u64 = 0x5000;
const TABLE: u64 = 0x6000;

/// A 3.12 code object named by a UCS2 string, in a compact ASCII file,
/// with a one-entry location table.
fn fake_code() -> FakeMemory {
    let l = CodeLayout::for_minor(12).unwrap();
    let mut m = FakeMemory::default();
    m.put(CODE, &[0; 256]);
    m.put_u64(CODE + OB_TYPE, TYPE);
    m.put_u64(CODE + OB_SIZE, 1);
    m.put(CODE + l.co_firstlineno, &7i32.to_le_bytes());
    m.put_u64(CODE + l.co_qualname.unwrap(), NAME);
    m.put_u64(CODE + l.co_filename, FILE);
    m.put_u64(CODE + l.co_linetable, TABLE);
    m.put(TYPE, &[0; 64]);
    m.put_u64(TYPE + TP_NAME, TYPE_NAME);
    m.put(TYPE_NAME, b"code\0");
    // "f\u{e9}\u{d800}": compact, not ASCII, kind 2, with a lone surrogate.
    m.put(NAME, &[0; 64]);
    m.put_u64(NAME + 16, 3);
    m.put_u32(NAME + 32, (2 << 2) | (1 << 5));
    m.put(NAME + 56, &[b'f', 0, 0xe9, 0, 0x00, 0xd8]);
    m.put(FILE, &[0; 64]);
    m.put_u64(FILE + 16, 4);
    m.put_u32(FILE + 32, (1 << 2) | (1 << 5) | (1 << 6));
    m.put(FILE + 40, b"a.py");
    m.put(TABLE, &[0; 40]);
    m.put_u64(TABLE + OB_SIZE, 2);
    // One entry, one code unit, one-line form +1, columns 0 and 1.
    m.put(TABLE + OB_SVAL, &[0x80 | (11 << 3), 0, 1]);
    m
}

#[test]
fn python_fake_code_object() {
    let l = CodeLayout::for_minor(12).unwrap();
    let code = read_code(&fake_code(), l, CODE).unwrap();
    assert_eq!(code.name, "f\u{e9}\u{fffd}");
    assert_eq!(code.file, "a.py");
    assert_eq!(code.first_line, 7);
    assert_eq!(code.code_len, 2);
    // The table has 2 bytes of ob_size: the third byte is not read, and
    // the entry is cut short; the line delta is in the first byte.
    assert_eq!(code.line(192), Some(8));
    assert_eq!(code.line(193), Some(8));
    assert_eq!(code.line(190), Some(7));
    assert_eq!(code.line(194), None);
    assert_eq!(code.line(u32::MAX), None);
}

#[test]
fn python_absurd_fields_are_errors() {
    let l = CodeLayout::for_minor(12).unwrap();
    let with = |f: &dyn Fn(&mut FakeMemory)| {
        let mut m = fake_code();
        f(&mut m);
        read_code(&m, l, CODE)
    };
    let too_long = |r: Result<Code, CodeError>| matches!(r, Err(CodeError::TooLong { .. }));
    let invalid = |r: Result<Code, CodeError>| matches!(r, Err(CodeError::Invalid { .. }));
    assert!(too_long(with(&|m| m.put_u64(NAME + 16, 1 << 40))));
    assert!(too_long(with(&|m| m.put_u64(NAME + 16, i64::MAX as u64))));
    assert!(too_long(with(&|m| m.put_u64(NAME + 16, 513))));
    assert!(invalid(with(&|m| m.put_u64(NAME + 16, u64::MAX))));
    assert!(too_long(with(&|m| m.put_u64(FILE + 16, 4097))));
    assert!(too_long(with(
        &|m| m.put_u64(TABLE + OB_SIZE, (1 << 20) + 1)
    )));
    assert!(invalid(with(&|m| m.put_u64(TABLE + OB_SIZE, u64::MAX))));
    assert!(too_long(with(&|m| m.put_u64(CODE + OB_SIZE, 1 << 62))));
    assert!(invalid(with(&|m| m.put_u64(CODE + OB_SIZE, u64::MAX))));
    assert!(invalid(with(&|m| m.put(CODE + 68, &(-1i32).to_le_bytes()))));
    // Kind 3, and "ASCII" of kind 4.
    assert!(invalid(
        with(&|m| m.put_u32(NAME + 32, (3 << 2) | (1 << 5)))
    ));
    assert!(invalid(
        with(&|m| m.put_u32(FILE + 32, (4 << 2) | (3 << 5)))
    ));
    // Not a code object; pointers to nowhere.
    assert!(matches!(
        with(&|m| m.put(TYPE_NAME, b"cod\0\0")),
        Err(CodeError::NotCode { .. })
    ));
    let unreadable = |r: Result<Code, CodeError>| matches!(r, Err(CodeError::Read { .. }));
    assert!(unreadable(with(&|m| m.put_u64(CODE + OB_TYPE, 0x10))));
    // A pointer whose fields' addresses wrap around.
    let qualname = CODE + l.co_qualname.unwrap();
    assert!(invalid(with(&|m| m.put_u64(qualname, u64::MAX - 8))));
    assert!(unreadable(with(
        &|m| m.put_u64(CODE + l.co_filename, 0x9999)
    )));
    assert!(unreadable(with(&|m| m.put_u64(CODE + l.co_linetable, 0))));
    // A non-compact string whose data pointer goes nowhere.
    assert!(unreadable(with(
        &|m| m.put_u32(FILE + 32, (1 << 2) | (1 << 6))
    )));
    // 3.11: a string that is not ready.
    let l11 = CodeLayout::for_minor(11).unwrap();
    let mut m = FakeMemory::default();
    m.put(CODE, &[0; 256]);
    m.put_u64(CODE + OB_TYPE, TYPE);
    m.put_u64(CODE + l11.co_qualname.unwrap(), NAME);
    m.put(TYPE, &[0; 64]);
    m.put_u64(TYPE + TP_NAME, TYPE_NAME);
    m.put(TYPE_NAME, b"code\0");
    m.put(NAME, &[0; 80]);
    m.put_u32(NAME + 32, (1 << 2) | (1 << 5) | (1 << 6));
    assert!(invalid(read_code(&m, l11, CODE)));
}
