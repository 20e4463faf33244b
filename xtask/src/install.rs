//! `cargo xtask install`: the release binary, stripped of its debug
//! information, under PREFIX (default /usr/local), with its man pages and
//! shell completions.
//!
//! The pages and completions are made by the binary being installed
//! (`mtrace generate`, hidden), from its own clap definition, so they
//! describe exactly that binary. Each file is copied to a temporary beside
//! its destination and renamed into place: a running mtrace is not
//! overwritten under its feet (`Text file busy`), and no reader sees half
//! a file.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use crate::{require_root, status};

pub const DEFAULT_PREFIX: &str = "/usr/local";

/// Each shell, the file name `mtrace generate completions` gives its
/// script, and where under PREFIX the shell looks for it (bash-completion,
/// zsh and fish all search PREFIX=/usr/local/share by default).
const COMPLETIONS: [(&str, &str, &str); 3] = [
    (
        "bash",
        "mtrace.bash",
        "share/bash-completion/completions/mtrace",
    ),
    ("zsh", "_mtrace", "share/zsh/site-functions/_mtrace"),
    (
        "fish",
        "mtrace.fish",
        "share/fish/vendor_completions.d/mtrace.fish",
    ),
];

pub fn run(root: &Path, prefix: &Path) -> Result<()> {
    // Another prefix (a staging directory, a home) may need no root.
    if prefix == Path::new(DEFAULT_PREFIX) {
        require_root(&format!("installing to {DEFAULT_PREFIX}"))?;
    }
    let stage = root.join("target/install");
    if stage.exists() {
        fs::remove_dir_all(&stage).with_context(|| format!("removing {}", stage.display()))?;
    }
    let (man_stage, completion_stage) = (stage.join("man1"), stage.join("completions"));
    fs::create_dir_all(&man_stage)?;
    fs::create_dir_all(&completion_stage)?;

    // target/release/mtrace keeps its debug information (line tables, for
    // a backtrace or perf during development); the installed one does
    // not, but keeps its symbol table, so a panic's backtrace still names
    // functions.
    let built = root.join("target/release/mtrace");
    let stripped = stage.join("mtrace");
    status(
        Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(&stripped)
            .arg(&built),
    )?;
    eprintln!(
        "xtask: stripped of debug information: {} -> {}",
        size(&built)?,
        size(&stripped)?
    );

    status(
        Command::new(&stripped)
            .args(["generate", "man"])
            .arg(&man_stage),
    )?;
    for (shell, _, _) in COMPLETIONS {
        status(
            Command::new(&stripped)
                .args(["generate", "completions", shell])
                .arg(&completion_stage),
        )?;
    }

    let bin = prefix.join("bin");
    place(&stripped, &bin.join("mtrace"), 0o755)?;
    let man1 = prefix.join("share/man/man1");
    let mut pages: Vec<PathBuf> = fs::read_dir(&man_stage)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    pages.sort();
    for page in pages {
        place(&page, &man1.join(page.file_name().unwrap()), 0o644)?;
    }
    for (_, generated, dest) in COMPLETIONS {
        place(&completion_stage.join(generated), &prefix.join(dest), 0o644)?;
    }
    check_path(&bin);
    // whatis and apropos read man-db's index, not the pages (`man` finds
    // the page without it); an incremental update takes about 1.5 s.
    if let Err(e) = status(Command::new("mandb").arg("--quiet")) {
        eprintln!("xtask: note: the man page index is not updated: {e:#}");
    }
    check_man(&man1.join("mtrace.1"));
    Ok(())
}

fn size(path: &Path) -> Result<String> {
    let bytes = fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    Ok(format!("{:.1} MB", bytes as f64 / 1e6))
}

/// Copies `src` to `dest` with `mode`: through a temporary beside `dest`,
/// renamed over it.
fn place(src: &Path, dest: &Path, mode: u32) -> Result<()> {
    let dir = dest.parent().expect("an absolute destination");
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let name = dest.file_name().unwrap().to_string_lossy();
    let tmp = dir.join(format!(".{name}.xtask-{}", std::process::id()));
    let copied = fs::copy(src, &tmp)
        .and_then(|_| fs::set_permissions(&tmp, fs::Permissions::from_mode(mode)))
        .and_then(|()| fs::rename(&tmp, dest));
    if let Err(e) = copied {
        let _ = fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("installing {}", dest.display()));
    }
    eprintln!("xtask: installed {}", dest.display());
    Ok(())
}

/// glibc ships a perl script /usr/bin/mtrace: says so when `bin` is not
/// ahead of /usr/bin on this PATH.
fn check_path(bin: &Path) {
    let path = std::env::var("PATH").unwrap_or_default();
    let ours = path.split(':').position(|d| Path::new(d) == bin);
    let theirs = path.split(':').position(|d| d == "/usr/bin");
    match (ours, theirs) {
        (Some(o), Some(t)) if o < t => {}
        _ => eprintln!(
            "xtask: note: {} is not ahead of /usr/bin on this PATH; `mtrace` may run glibc's /usr/bin/mtrace. Use {} or put {} first.",
            bin.display(),
            bin.join("mtrace").display(),
            bin.display()
        ),
    }
}

/// glibc's mtrace(1) is in /usr/share/man: says which page `man mtrace`
/// opens when it is not ours. (man-db orders its search path as PATH
/// orders the bin directories: PREFIX/bin ahead of /usr/bin puts
/// PREFIX/share/man ahead of /usr/share/man.)
fn check_man(page: &Path) {
    let Ok(out) = Command::new("man").args(["-w", "mtrace"]).output() else {
        eprintln!("xtask: note: no `man` here to check which page `man mtrace` opens");
        return;
    };
    let found = String::from_utf8_lossy(&out.stdout).trim().to_string();
    // /usr/local/man is a link to /usr/local/share/man on Debian.
    let same = |a: &Path, b: &Path| a.canonicalize().ok() == b.canonicalize().ok();
    if !same(Path::new(&found), page) {
        eprintln!(
            "xtask: note: `man mtrace` opens {found:?}, not {}: put {} ahead in MANPATH, or use `man {}`",
            page.display(),
            page.parent().and_then(Path::parent).unwrap().display(),
            page.display()
        );
    }
}
