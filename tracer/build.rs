//! Builds the BPF programs in `../tracer-ebpf` for `bpfel-unknown-none` and
//! hands the object to the tracer (`include_bytes!` of `$OUT_DIR/mtrace.bpf.o`).
//!
//! The host toolchain (rustup stable) cannot build BPF code. Debian's rustc
//! (`/usr/bin/rustc`, package rustc-web) with its library source
//! (rust-web-src) and `bpf-linker` can; `cargo xtask setup` installs them.
//! Override the tools with `MTRACE_BPF_CARGO` / `MTRACE_BPF_RUSTC`.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir.parent().unwrap().to_path_buf();
    let ebpf_dir = root.join("tracer-ebpf");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());

    for dir in ["tracer-ebpf/src", "tracer-common/src"] {
        watch(&root.join(dir));
    }
    for file in [
        "tracer-ebpf/.cargo/config.toml",
        "tracer-ebpf/Cargo.toml",
        "tracer-ebpf/Cargo.lock",
        "tracer-common/Cargo.toml",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(file).display());
    }
    println!("cargo:rerun-if-env-changed=MTRACE_BPF_CARGO");
    println!("cargo:rerun-if-env-changed=MTRACE_BPF_RUSTC");

    let cargo = env::var("MTRACE_BPF_CARGO").unwrap_or_else(|_| "/usr/bin/cargo".into());
    let rustc = env::var("MTRACE_BPF_RUSTC").unwrap_or_else(|_| "/usr/bin/rustc".into());
    for tool in [&cargo, &rustc] {
        if !Path::new(tool).exists() {
            panic!(
                "{tool} not found: the BPF programs need Debian's Rust toolchain and bpf-linker. \
                 Run `cargo xtask setup` (as root) first."
            );
        }
    }

    let target_dir = out_dir.join("ebpf-target");
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(&ebpf_dir)
        .args([
            "build",
            "--release",
            "--locked",
            "--target",
            "bpfel-unknown-none",
        ])
        .args(["-Z", "build-std=core"])
        .arg("--target-dir")
        .arg(&target_dir);
    // Start from a clean slate: the outer cargo (and clippy) set variables
    // that must not leak into the inner, differently-targeted build.
    for (key, _) in env::vars() {
        if key.starts_with("CARGO_") || key.starts_with("RUSTC") || key == "RUSTFLAGS" {
            cmd.env_remove(&key);
        }
    }
    cmd.env("RUSTC", &rustc).env("RUSTC_BOOTSTRAP", "1");
    // bpf-linker lives in ~/.cargo/bin (cargo install).
    let mut path = env::var("PATH").unwrap_or_default();
    if let Ok(home) = env::var("HOME") {
        path = format!("{home}/.cargo/bin:{path}");
    }
    cmd.env("PATH", path);

    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running {cargo}: {e}"));
    if !status.success() {
        panic!("building the BPF programs failed ({status}); run `cargo xtask setup` if bpf-linker or Debian's rustc is missing");
    }
    let obj = target_dir.join("bpfel-unknown-none/release/mtrace");
    std::fs::copy(&obj, out_dir.join("mtrace.bpf.o"))
        .unwrap_or_else(|e| panic!("copying {}: {e}", obj.display()));
}

fn watch(dir: &Path) {
    println!("cargo:rerun-if-changed={}", dir.display());
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                watch(&p);
            } else {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
    }
}
