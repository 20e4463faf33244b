//! mtrace beside other tracers: another tool's return probes (bcc's
//! memleak, a bpftrace `uretprobe`, a second mtrace in live mode) on
//! functions the target runs replace their return addresses on the stack
//! with the kernel's trampoline for as long as they run. The kernel runs
//! every consumer of a probed address, so a return probe that another
//! trace put on libc's `realloc` for another process hides it in ours
//! too. Counts and stacks stay what they are without the other tool
//! (tests/fixtures/hidden.c).

use std::{ffi::CString, os::fd::FromRawFd, path::Path};

use crate::support::{fixtures::compile_c, trace_by_pid, FixtureProc, Mtrace};

/// hidden.c, built without frame pointers (once).
fn hidden() -> std::path::PathBuf {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            compile_c(
                "hidden",
                "hidden",
                &["-O2", "-fomit-frame-pointer", "-g"],
                &[],
            )
        })
        .clone()
}

/// Where `symbol`'s code is in the file at `path` (what a uprobe takes).
fn file_offset(path: &Path, symbol: &str) -> u64 {
    use object::{Object, ObjectSegment, ObjectSymbol};
    let data = std::fs::read(path).unwrap();
    let file = object::File::parse(&*data).unwrap();
    let addr = file
        .symbols()
        .chain(file.dynamic_symbols())
        .find(|s| s.name() == Ok(symbol) && s.size() > 0)
        .unwrap_or_else(|| panic!("{symbol} in {}", path.display()))
        .address();
    file.segments()
        .find_map(|seg| {
            let (off, size) = seg.file_range();
            (addr >= seg.address() && addr < seg.address() + size)
                .then(|| off + addr - seg.address())
        })
        .unwrap_or_else(|| panic!("{symbol}'s segment in {}", path.display()))
}

/// A return probe of another tool: a perf event of the kernel's uprobe
/// PMU at `symbol` of `path`, in process `pid` (closed on drop, which
/// takes it out). Its count is how many times it fired.
struct ReturnProbe {
    fd: std::fs::File,
    what: String,
}

impl ReturnProbe {
    fn open(path: &Path, symbol: &str, pid: u32) -> ReturnProbe {
        let pmu = "/sys/bus/event_source/devices/uprobe";
        let ty: u32 = std::fs::read_to_string(format!("{pmu}/type"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // "config:N": the bit of `config` that makes it a return probe.
        let bit: u32 = std::fs::read_to_string(format!("{pmu}/format/retprobe"))
            .unwrap()
            .trim()
            .trim_start_matches("config:")
            .parse()
            .unwrap();
        let c_path = CString::new(path.to_str().unwrap()).unwrap();
        // struct perf_event_attr, PERF_ATTR_SIZE_VER5 (112 bytes): type,
        // size, config, ..., config1 (the path) at 56, config2 (the file
        // offset) at 64; enabled, counting.
        let mut attr = [0u64; 14];
        attr[0] = ty as u64 | (112u64 << 32);
        attr[1] = 1 << bit;
        attr[7] = c_path.as_ptr() as u64;
        attr[8] = file_offset(path, symbol);
        let fd = unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                attr.as_ptr(),
                pid as libc::pid_t,
                -1,
                -1,
                // PERF_FLAG_FD_CLOEXEC
                8,
            )
        };
        assert!(
            fd >= 0,
            "perf_event_open of a uretprobe at {symbol}: {}",
            std::io::Error::last_os_error()
        );
        ReturnProbe {
            fd: unsafe { std::fs::File::from_raw_fd(fd as i32) },
            what: symbol.to_string(),
        }
    }

    /// How many returns it saw.
    fn fired(&self) -> u64 {
        use std::io::Read;
        let mut buf = [0u8; 8];
        (&self.fd).read_exact(&mut buf).unwrap();
        u64::from_ne_bytes(buf)
    }
}

/// The libc the process `pid` runs.
fn libc_of(pid: u32) -> std::path::PathBuf {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("/libc.so"))
        .map(std::path::PathBuf::from)
        .expect("a libc mapped")
}

/// With return probes of another tool on through_probed, wrapper and
/// libc's realloc, every call is counted once under its own stack, whole
/// to main, in count and live mode: the walk takes the real return
/// address the kernel keeps (without it, through_probed's stacks ended at
/// `[uprobes]`, wrapper's calls had `[uprobes]` as their caller, and each
/// realloc(NULL) was counted again as a malloc).
#[test]
fn another_tools_return_probes_hide_no_frame_and_add_no_call() {
    need_bpf!();
    let program = hidden();
    for mode in ["--count-frees", "--live"] {
        let mut fx = FixtureProc::start(&program, &[]);
        // The fixture's libc is this test's.
        let libc = libc_of(std::process::id());
        let probes = [
            ReturnProbe::open(&program, "through_probed", fx.pid()),
            ReturnProbe::open(&program, "wrapper", fx.pid()),
            ReturnProbe::open(&libc, "realloc", fx.pid()),
        ];
        let (out, p) = trace_by_pid(&mut fx, &[mode]);
        let d = format!("{mode}\n{}\n{}", out.describe(), p.dump());
        let fired: Vec<(String, u64)> =
            probes.iter().map(|r| (r.what.clone(), r.fired())).collect();
        assert_eq!(
            fired,
            [
                ("through_probed".to_string(), 1),
                ("wrapper".to_string(), 200),
                ("realloc".to_string(), 300)
            ],
            "the other tool's probes fired\n{d}"
        );
        assert_eq!(p.site("malloc", "through_probed"), (100, 4000), "{d}");
        assert_eq!(p.site("malloc", "wrapper_site"), (200, 200 * 72), "{d}");
        assert_eq!(p.site("realloc", "realloc_site"), (300, 300 * 56), "{d}");
        assert_eq!(p.calls_of("malloc"), Some(300), "{d}");
        assert_eq!(p.calls_of("realloc"), Some(300), "{d}");
        assert_eq!(p.total(), (600, 4000 + 200 * 72 + 300 * 56), "{d}");
        for s in p.allocs() {
            let names = s.names();
            let main = names.iter().position(|n| *n == "main");
            assert!(
                main == Some(1) && !s.truncated,
                "{} stack whole to main through the hidden return: {names:?}\n{d}",
                s.function
            );
        }
        p.assert_no_losses();
    }
}

/// A second mtrace, in live mode, on another process of the same libc
/// (its return probes on realloc fire in this trace's target too: what
/// once made a test beside it count glibc's realloc(NULL) -> malloc tail
/// call twice) leaves this trace exact and whole.
#[test]
fn a_live_trace_of_another_process_leaves_this_one_exact() {
    need_bpf!();
    let program = hidden();
    let mut other = FixtureProc::start(&program, &["--loop"]);
    other.wait_ready();
    let other_pid = other.pid().to_string();
    let mut live = Mtrace::start(&["--live", "-o", "/dev/null", "--pid", &other_pid]);
    live.wait_tracing();
    let mut fx = FixtureProc::start(&program, &[]);
    let (out, p) = trace_by_pid(&mut fx, &[]);
    let d = format!("{}\n{}", out.describe(), p.dump());
    assert_eq!(p.calls_of("malloc"), Some(300), "{d}");
    assert_eq!(p.calls_of("realloc"), Some(300), "{d}");
    assert_eq!(p.site("realloc", "realloc_site"), (300, 300 * 56), "{d}");
    assert!(p.allocs().all(|s| !s.truncated), "stacks whole\n{d}");
    live.proc.signal(libc::SIGINT);
    live.finish().assert_exit(0);
}
