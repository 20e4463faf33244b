//! Programs loaded for uprobe-multi links, and the links: one attach and
//! one detach for all of a program's probe sites in a process. aya 0.14
//! can neither load a uprobe program for such a link (the kernel wants
//! the expected attach type at load) nor create one, so both are made
//! here with `bpf()`: the programs' instructions come from aya-obj,
//! relocated against the maps aya created, the way aya itself does it.
//!
//! A perf-event uprobe costs a grace period of the kernel's to take out,
//! under a lock every new probe waits for; a multi link costs one for
//! all of its sites, and no lock that attaching waits for.

use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::Path,
    sync::OnceLock,
};

use anyhow::{anyhow, Context, Result};
use aya::{maps::Map, Ebpf};
use aya_obj::generated::{
    bpf_attach_type::BPF_TRACE_UPROBE_MULTI, bpf_attr, bpf_cmd, bpf_insn, bpf_prog_info,
    bpf_prog_type::BPF_PROG_TYPE_KPROBE, BPF_F_UPROBE_MULTI_RETURN,
};

/// A loaded program.
#[derive(Debug)]
pub struct Program {
    pub name: &'static str,
    fd: OwnedFd,
}

/// `--bpf-stats`: the kernel times every BPF program run while the
/// returned descriptor is open (None when `on` is false).
pub fn run_times(on: bool) -> anyhow::Result<Option<OwnedFd>> {
    use anyhow::Context;
    on.then(|| {
        aya::sys::enable_stats(aya::sys::Stats::RunTime).context("enabling BPF run-time stats")
    })
    .transpose()
}

/// An attached uprobe-multi link; dropping it takes every one of its
/// probes out.
#[derive(Debug)]
pub struct Link(#[allow(dead_code)] OwnedFd);

/// Loads of a program tried at most, each interrupted by a signal.
pub(crate) const LOAD_TRIES: u32 = 8;

/// Whether a load failed only because a signal came meanwhile.
pub(crate) fn interrupted(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EAGAIN)
}

pub(super) fn sys_bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> std::io::Result<i64> {
    // SAFETY: `attr` is a valid bpf_attr for `cmd`, and every pointer in
    // it points at memory that outlives the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr as *mut bpf_attr,
            std::mem::size_of::<bpf_attr>(),
        )
    };
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// The BPF object, parsed once, and its BTF in the kernel (the
/// verifier needs the programs' function info, which refers to it).
struct Parsed {
    obj: aya_obj::Object,
    btf: Option<OwnedFd>,
}

fn parsed(object: &[u8]) -> Result<&'static Parsed> {
    static PARSED: OnceLock<Parsed> = OnceLock::new();
    if let Some(p) = PARSED.get() {
        return Ok(p);
    }
    let mut obj = aya_obj::Object::parse(object).context("parsing the BPF object")?;
    let btf = match aya::features().btf() {
        Some(features) => match obj
            .fixup_and_sanitize_btf(features)
            .context("preparing the BPF object's BTF")?
        {
            Some(btf) => Some(load_btf(&btf.to_bytes()).context("loading the BPF object's BTF")?),
            None => None,
        },
        None => None,
    };
    Ok(PARSED.get_or_init(|| Parsed { obj, btf }))
}

fn load_btf(bytes: &[u8]) -> std::io::Result<OwnedFd> {
    // SAFETY: all-zero is a valid bpf_attr.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the union's BTF-load member.
    let b = unsafe { &mut attr.__bindgen_anon_7 };
    b.btf = bytes.as_ptr() as u64;
    b.btf_size = bytes.len() as u32;
    let fd = sys_bpf(bpf_cmd::BPF_BTF_LOAD, &mut attr)?;
    // SAFETY: the kernel returned a new descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// The descriptor of one of aya's maps.
pub(super) fn map_fd(map: &Map) -> Result<RawFd> {
    let data = match map {
        Map::Array(d)
        | Map::HashMap(d)
        | Map::LruHashMap(d)
        | Map::PerCpuArray(d)
        | Map::PerCpuHashMap(d)
        | Map::RingBuf(d)
        | Map::Queue(d)
        | Map::ProgramArray(d)
        | Map::Unsupported(d) => d,
        _ => return Err(anyhow!("a map of a type mtrace does not use")),
    };
    Ok(data.fd().as_fd().as_raw_fd())
}

/// Loads programs `names` of `object` for uprobe-multi links, against
/// the maps aya created for it in `ebpf` (which must all still be there).
pub fn load(object: &[u8], ebpf: &Ebpf, names: &[&'static str]) -> Result<Vec<Program>> {
    let parsed = parsed(object)?;
    let mut obj = parsed.obj.clone();
    let mut fds = Vec::new();
    for (name, map) in &obj.maps {
        let fd = map_fd(
            ebpf.map(name)
                .with_context(|| format!("BPF map {name} missing"))?,
        )?;
        fds.push((name.clone(), fd, map.clone()));
    }
    let text: HashSet<usize> = obj.functions.keys().map(|(section, _)| *section).collect();
    obj.relocate_maps(
        fds.iter().map(|(name, fd, map)| (name.as_str(), *fd, map)),
        &text,
    )
    .context("relocating the BPF programs' maps")?;
    obj.relocate_calls(&text)
        .context("relocating the BPF programs' calls")?;
    obj.sanitize_functions(aya::features());
    let mut loaded = Vec::new();
    for &name in names {
        let program = obj
            .programs
            .get(name)
            .with_context(|| format!("BPF program {name} missing"))?;
        let function = &obj.functions[&program.function_key()];
        let fd = load_one(name, &program.license, function, parsed.btf.as_ref())
            .with_context(|| format!("loading the {name} probe"))?;
        loaded.push(Program { name, fd });
    }
    Ok(loaded)
}

fn load_one(
    name: &str,
    license: &CString,
    function: &aya_obj::Function,
    btf: Option<&OwnedFd>,
) -> Result<OwnedFd> {
    let insns: &[bpf_insn] = &function.instructions;
    let func_info = function.func_info.func_info_bytes();
    let line_info = function.line_info.line_info_bytes();
    let attempt = |log: &mut Vec<u8>| {
        // SAFETY: all-zero is a valid bpf_attr.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the union's program-load member.
        let u = unsafe { &mut attr.__bindgen_anon_3 };
        u.prog_type = BPF_PROG_TYPE_KPROBE as u32;
        u.expected_attach_type = BPF_TRACE_UPROBE_MULTI as u32;
        u.insns = insns.as_ptr() as u64;
        u.insn_cnt = insns.len() as u32;
        u.license = license.as_ptr() as u64;
        if let Some(btf) = btf {
            u.prog_btf_fd = btf.as_raw_fd() as u32;
            if function.func_info_rec_size > 0 {
                u.func_info = func_info.as_ptr() as u64;
                u.func_info_cnt = function.func_info.len() as u32;
                u.func_info_rec_size = function.func_info_rec_size as u32;
            }
            if function.line_info_rec_size > 0 {
                u.line_info = line_info.as_ptr() as u64;
                u.line_info_cnt = function.line_info.len() as u32;
                u.line_info_rec_size = function.line_info_rec_size as u32;
            }
        }
        for (dst, src) in u.prog_name.iter_mut().zip(name.bytes().take(15)) {
            *dst = src as libc::c_char;
        }
        if !log.is_empty() {
            u.log_level = 1;
            u.log_buf = log.as_mut_ptr() as u64;
            u.log_size = log.len() as u32;
        }
        sys_bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr)
    };
    // The verifier gives up with EAGAIN when a signal comes for the
    // loading thread (a child's SIGCHLD, a resized terminal's SIGWINCH,
    // mtrace stopped and continued): the same load again, as libbpf does.
    let attempt = |log: &mut Vec<u8>| {
        let mut tries = 1;
        loop {
            match attempt(log) {
                Err(e) if interrupted(&e) && tries < LOAD_TRIES => tries += 1,
                done => return done,
            }
        }
    };
    let fd = match attempt(&mut Vec::new()) {
        Ok(fd) => fd,
        Err(e) => {
            // Again with the verifier's log, for the error.
            let mut log = vec![0u8; 1 << 24];
            let _ = attempt(&mut log);
            let text = String::from_utf8_lossy(&log);
            let text = text.trim_end_matches('\0').trim_end();
            let tail: Vec<&str> = text.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            return Err(anyhow!("{e}; the verifier said:\n{}", tail.join("\n")));
        }
    };
    // SAFETY: the kernel returned a new descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

impl Program {
    /// Attaches the program at `offsets` (file offsets) in `path` with
    /// `cookies`, at returns when `ret`, for `pid` only or, when `None`,
    /// in every process that maps the file.
    pub fn attach(
        &self,
        path: &Path,
        offsets: &[u64],
        cookies: &[u64],
        ret: bool,
        pid: Option<u32>,
    ) -> std::io::Result<Link> {
        use std::os::unix::ffi::OsStrExt;
        let path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: all-zero is a valid bpf_attr.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the union's link-create member.
        let l = unsafe { &mut attr.link_create };
        l.__bindgen_anon_1.prog_fd = self.fd.as_raw_fd() as u32;
        l.attach_type = BPF_TRACE_UPROBE_MULTI as u32;
        // SAFETY: the uprobe-multi member of the link's union.
        let m = unsafe { &mut l.__bindgen_anon_3.uprobe_multi };
        m.path = path.as_ptr() as u64;
        m.offsets = offsets.as_ptr() as u64;
        m.cookies = cookies.as_ptr() as u64;
        m.cnt = offsets.len().min(cookies.len()) as u32;
        m.flags = if ret { BPF_F_UPROBE_MULTI_RETURN } else { 0 };
        m.pid = pid.unwrap_or(0);
        let fd = sys_bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr)?;
        // SAFETY: the kernel returned a new descriptor.
        Ok(Link(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }))
    }

    /// `-v` with `--bpf-stats`: its runs and the mean time of one, as the
    /// kernel timed them (nothing when it never ran).
    pub fn log_times(&self) {
        if let Ok(info) = self.info() {
            if info.runs > 0 {
                log::debug!(
                    "bpf program {}: {} runs, {:.1} ns per run",
                    self.name,
                    info.runs,
                    info.run_time_ns as f64 / info.runs as f64
                );
            }
        }
    }

    /// What the kernel says of the program (`-v`, `--bpf-stats`).
    pub fn info(&self) -> Result<ProgramStats> {
        // SAFETY: all-zero is a valid bpf_prog_info and bpf_attr.
        let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the union's object-info member.
        let i = unsafe { &mut attr.info };
        i.bpf_fd = self.fd.as_raw_fd() as u32;
        i.info_len = std::mem::size_of::<bpf_prog_info>() as u32;
        i.info = &mut info as *mut bpf_prog_info as u64;
        sys_bpf(bpf_cmd::BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
        Ok(ProgramStats {
            verified_instructions: info.verified_insns,
            runs: info.run_cnt,
            run_time_ns: info.run_time_ns,
        })
    }
}

/// Closes `links` side by side: each waits for a grace period of the
/// kernel's once its probes are out, and the waits overlap (the first on
/// the calling thread). Returns when every one is closed.
pub fn close_all(links: Vec<Link>) {
    let mut links = links.into_iter();
    let first = links.next();
    std::thread::scope(|s| {
        for link in links {
            s.spawn(move || drop(link));
        }
        drop(first);
    });
}

/// A program's figures from the kernel.
#[derive(Clone, Copy, Debug)]
pub struct ProgramStats {
    pub verified_instructions: u32,
    pub runs: u64,
    pub run_time_ns: u64,
}

/// What one link attaches: a program, in a file, at entries or returns.
type LinkKey = (&'static str, std::path::PathBuf, bool);

/// Sites grouped by what attaches them: one link per program, file and
/// kind of probe; file offsets and cookies, in step.
#[derive(Debug, Default)]
pub struct LinkPlan {
    groups: HashMap<LinkKey, (Vec<u64>, Vec<u64>)>,
}

impl LinkPlan {
    pub fn add(&mut self, program: &'static str, path: &Path, ret: bool, offset: u64, cookie: u64) {
        let (offsets, cookies) = self
            .groups
            .entry((program, path.to_path_buf(), ret))
            .or_default();
        offsets.push(offset);
        cookies.push(cookie);
    }

    /// The programs the plan needs, each once.
    pub fn programs(&self) -> Vec<&'static str> {
        let mut names: Vec<&'static str> = self.groups.keys().map(|(p, _, _)| *p).collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// Attaches every group with `programs`, for `pid` (every process
    /// mapping the file when `None`).
    pub fn attach(&self, programs: &[Program], pid: Option<u32>) -> Result<Vec<Link>> {
        let mut links = Vec::new();
        for ((name, path, ret), (offsets, cookies)) in &self.groups {
            let program = programs
                .iter()
                .find(|p| p.name == *name)
                .with_context(|| format!("BPF program {name} not loaded"))?;
            let link = program
                .attach(path, offsets, cookies, *ret, pid)
                .with_context(|| {
                    format!(
                        "attaching {} {} to {}",
                        offsets.len(),
                        if *ret { "uretprobes" } else { "uprobes" },
                        path.display()
                    )
                })?;
            links.push(link);
        }
        Ok(links)
    }
}
