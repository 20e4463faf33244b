//! gdb as the oracle for stacks: the program run under gdb with a
//! breakpoint on every allocating function (support/stacks.py), its
//! backtrace at each call, in the form mtrace's profile is compared in.

use std::{
    collections::BTreeMap,
    io::Write,
    path::Path,
    process::{Command, Stdio},
};

use super::Profile;

/// (allocating function as mtrace names it, the caller's stack) -> calls.
/// A frame of the test's own objects (the fixture and its libraries) is
/// its function's name; a frame of another library is `[library file
/// name]` (gdb and mtrace may pick different aliases for libc's
/// functions). Inlined frames are left out on both sides.
pub type Stacks = BTreeMap<(String, Vec<String>), u64>;

/// gdb's breakpoint names -> mtrace's function names.
const NAMES: [(&str, &str); 4] = [
    ("_Znwm", "operator new"),
    ("_Znam", "operator new[]"),
    ("_ZnwmRKSt9nothrow_t", "operator new(nothrow)"),
    ("_ZnamRKSt9nothrow_t", "operator new[](nothrow)"),
];

/// Frames whose name says the allocator called itself (operator new ->
/// malloc, Rust's __rust_alloc -> __rdl_alloc -> malloc): mtrace counts
/// such a call once, under the outer function.
fn is_allocator(name: &str) -> bool {
    [
        "operator new",
        "malloc",
        "__libc_malloc",
        "__GI___libc_malloc",
        "calloc",
        "realloc",
    ]
    .iter()
    .any(|a| name.starts_with(a))
        || ["__rust_alloc", "__rust_realloc", "__rdl_", "__rg_"]
            .iter()
            .any(|a| name.contains(a))
}

/// Rust's allocator shims `__rust_alloc`, `__rust_alloc_zeroed` and
/// `__rust_realloc` in `program`, by their (v0-mangled) symbol names.
fn rust_shims(program: &Path) -> Vec<String> {
    use object::{Object, ObjectSymbol};
    let data = std::fs::read(program).unwrap();
    let Ok(file) = object::File::parse(&*data) else {
        return Vec::new();
    };
    file.symbols()
        .filter_map(|s| s.name().ok())
        .filter(|n| {
            ["___rust_alloc", "___rust_alloc_zeroed", "___rust_realloc"]
                .iter()
                .any(|shim| n.ends_with(shim))
        })
        .map(str::to_string)
        .collect()
}

/// mtrace's name of the function gdb stopped in.
fn mtrace_name(location: &str) -> String {
    if let Some((_, m)) = NAMES.iter().find(|(g, _)| *g == location) {
        return m.to_string();
    }
    // `_RNv..._7___rustc12___rust_alloc`: `__rust_alloc`.
    match location.split_once("___rustc") {
        Some((_, rest)) => {
            let ident = rest.trim_start_matches(|c: char| c.is_ascii_digit());
            ident.strip_prefix('_').unwrap_or(ident).to_string()
        }
        None => location.to_string(),
    }
}

/// A function's name as both sides can agree on it: no return type, no
/// parameter list, no generic arguments, no spaces (gdb writes `> >`,
/// mtrace `>>`), closures as `{{closure}}` (gdb's Rust names say
/// `{closure#0}`), no hash of a Rust legacy symbol.
pub fn normalize(name: &str) -> String {
    let mut name = name.trim().trim_end_matches(" const").to_string();
    // The parameter list: the parenthesis that closes the name.
    if name.ends_with(')') {
        let mut depth = 0;
        for (i, c) in name.char_indices().rev() {
            match c {
                ')' => depth += 1,
                '(' => {
                    depth -= 1;
                    if depth == 0 {
                        name.truncate(i);
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    // Generic arguments, and a return type (what precedes the last space
    // outside them).
    let mut out = String::new();
    let mut depth = 0;
    for c in name.chars() {
        match c {
            '<' => depth += 1,
            '>' if depth > 0 => depth -= 1,
            ' ' if depth == 0 && !out.ends_with("operator") => out.clear(),
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    let mut out: String = out.chars().filter(|c| !c.is_whitespace()).collect();
    while let Some(start) = out.find("{closure#") {
        let Some(len) = out[start..].find('}') else {
            break;
        };
        out.replace_range(start..start + len + 1, "{{closure}}");
    }
    match out.rsplit_once("::h") {
        Some((base, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            base.to_string()
        }
        _ => out,
    }
}

fn frame_key(name: &str, object: Option<&str>, own: &[&Path]) -> String {
    match object {
        Some(o) if !o.is_empty() && !own.iter().any(|p| p.as_os_str() == o) => {
            // libstdc++.so.6 (gdb) and libstdc++.so.6.0.30 (the file).
            let base = o.rsplit('/').next().unwrap_or(o);
            let base = base.find(".so").map_or(base, |i| &base[..i + 3]);
            format!("[{base}]")
        }
        _ => normalize(name),
    }
}

/// Runs `program args` under gdb (with `stdin` written to it) and returns
/// the stacks of every allocating call it made. `own` are the objects
/// (the program first) whose frames are compared by name.
pub fn stacks_under_gdb(own: &[&Path], args: &[&str], stdin: &str) -> Stacks {
    let program = own[0];
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/e2e/support/stacks.py");
    let mut child = Command::new("gdb")
        .args(["-batch", "-nx", "-x"])
        .arg(&script)
        .env("MTRACE_GDB_FUNCTIONS", rust_shims(program).join(","))
        .arg("--args")
        .arg(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running gdb (installed by cargo xtask setup)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let mut stacks = Stacks::new();
    let mut previous: Option<(String, String)> = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("STACK ") else {
            continue;
        };
        let mut fields = rest.splitn(3, ' ');
        let (Some(function), Some(place), Some(frames)) =
            (fields.next(), fields.next(), fields.next())
        else {
            panic!("bad STACK line {line:?}");
        };
        // A tail call from one allocating function to another (libstdc++'s
        // operator new[] jumps to operator new) reaches the second with
        // the stack pointer and return address of the call counted last:
        // one call.
        let here = (function.to_string(), place.to_string());
        if previous
            .as_ref()
            .is_some_and(|(f, p)| *p == here.1 && *f != here.0)
        {
            continue;
        }
        previous = Some(here);
        let real: Vec<(&str, &str)> = frames
            .split(';')
            .filter_map(|f| {
                let mut parts = f.splitn(3, '|');
                let (kind, object, name) = (parts.next()?, parts.next()?, parts.next()?);
                (kind == "R").then_some((object, name))
            })
            .collect();
        // The first real frame is the allocator's own; the dynamic
        // linker's private malloc (before libc is set up) is not probed.
        let Some(((own_object, _), callers)) = real.split_first() else {
            continue;
        };
        if own_object.contains("ld-linux") {
            continue;
        }
        if callers.iter().any(|(_, n)| is_allocator(n)) {
            continue;
        }
        let function = mtrace_name(function);
        let mut key: Vec<String> = callers
            .iter()
            .map(|(o, n)| frame_key(n, Some(o), own))
            .collect();
        // gdb goes on past the dynamic linker's entry code, which has no
        // call-frame information, with frames it cannot name.
        while key.last().is_some_and(|f| f == "??") {
            key.pop();
        }
        *stacks.entry((function, key)).or_default() += 1;
    }
    assert!(
        !stacks.is_empty(),
        "gdb saw no allocating call of {}\n--- stdout ---\n{text}\n--- stderr ---\n{}",
        program.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    stacks
}

/// The same form, from mtrace's profile.
pub fn stacks_in_profile(p: &Profile, own: &[&Path]) -> Stacks {
    let mut stacks = Stacks::new();
    for s in p.allocs() {
        let key = s
            .frames
            .iter()
            .filter(|f| !f.inlined)
            .map(|f| frame_key(&f.function, f.module.as_deref(), own))
            .collect();
        *stacks.entry((s.function.clone(), key)).or_default() += s.calls;
    }
    stacks
}
