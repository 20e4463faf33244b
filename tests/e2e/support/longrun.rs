//! The longrun fixture as the lifecycle, hostile, scope and agent tests
//! use it: the first bytes of its allocator functions read before,
//! during and after a trace, to see probes come and go.

use std::{
    fs,
    os::unix::process::ExitStatusExt,
    time::{Duration, Instant},
};

use super::{read_mem, Fixture, FixtureProc, Mtrace, EXIT_TIMEOUT, LINE_TIMEOUT};

fn longrun_sum(n: u64) -> u64 {
    (0..n).fold(0u64, |sum, i| {
        sum + (i & 0xff) + ((i >> 8) & 0xff) + (i.wrapping_mul(31) & 0xff)
    })
}

pub(crate) const WINDOW: usize = 16;

/// The longrun fixture traced with the arguments `scope` gives for its
/// pid; mtrace killed with SIGKILL mid-trace leaves none of its code
/// changed, and the fixture runs to its end, correctly.
pub(crate) fn sigkilled_mtrace_leaves_no_breakpoints_in(scope: &dyn Fn(u32) -> Vec<String>) {
    let mut target = Longrun::start();
    let pid = target.fx.pid();
    // The addresses are libc's code, as the process maps it.
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    for (name, addr) in &target.funcs {
        let in_libc = maps.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (s, e) = f[0].split_once('-').unwrap();
            let (s, e) = (
                u64::from_str_radix(s, 16).unwrap(),
                u64::from_str_radix(e, 16).unwrap(),
            );
            (s..e).contains(addr)
                && f[1].contains('x')
                && f.get(5).is_some_and(|p| p.contains("libc"))
        });
        assert!(
            in_libc,
            "{name} at {addr:#x} is not in libc's code:\n{maps}"
        );
    }

    let mut m = Mtrace::start(&scope(pid));
    m.wait_tracing();
    // The probes are in place: some byte became int3. (This is what shows
    // the check after the kill could fail.)
    let during = target.windows();
    let int3s: Vec<(&str, usize)> = target
        .funcs
        .iter()
        .zip(target.before.iter().zip(&during))
        .flat_map(|((name, _), (b, d))| {
            (0..WINDOW)
                .filter(|&i| d[i] == 0xcc && b[i] != 0xcc)
                .map(move |i| (name.as_str(), i))
        })
        .collect();
    assert!(
        !int3s.is_empty(),
        "no int3 in the probed functions while traced:\nbefore {:02x?}\nduring {during:02x?}",
        target.before
    );

    target.fx.release();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        target.fx.proc.running(),
        "the fixture ended before mtrace was killed"
    );
    assert!(m.proc.running(), "mtrace ended by itself");
    m.proc.signal(libc::SIGKILL);
    let status = m.proc.wait_timeout(EXIT_TIMEOUT);
    let killed = Instant::now();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "mtrace status");

    // The kernel removes the breakpoints when the last reference to the
    // probes goes, which may be a moment after mtrace is reaped.
    target.assert_restored();
    eprintln!(
        "int3 while traced at {int3s:?}; code restored {:?} after mtrace's death",
        killed.elapsed()
    );

    // The fixture runs to its end, correctly.
    target.finish();
}

/// The longrun fixture with the first bytes of its allocator functions, to
/// see probes come and go.
pub(crate) struct Longrun {
    pub(crate) fx: FixtureProc,
    funcs: Vec<(String, u64)>,
    before: Vec<Vec<u8>>,
}

impl Longrun {
    pub(crate) fn start() -> Longrun {
        Longrun::start_for("2")
    }

    /// Looping for `seconds` once released.
    pub(crate) fn start_for(seconds: &str) -> Longrun {
        let mut fx = FixtureProc::start(Fixture::Longrun.path(), &[seconds]);
        let mut funcs = Vec::new();
        for name in ["malloc", "free", "calloc", "realloc"] {
            let line = fx.stdout.next_line(LINE_TIMEOUT);
            let addr = line
                .strip_prefix(name)
                .and_then(|a| a.strip_prefix(" 0x"))
                .and_then(|a| u64::from_str_radix(a, 16).ok())
                .unwrap_or_else(|| panic!("expected `{name} 0x...`, got {line:?}"));
            funcs.push((name.to_string(), addr));
        }
        fx.wait_ready();
        let mut l = Longrun {
            fx,
            funcs,
            before: Vec::new(),
        };
        l.before = l.windows();
        l
    }

    fn windows(&self) -> Vec<Vec<u8>> {
        let pid = self.fx.pid();
        self.funcs
            .iter()
            .map(|(name, addr)| {
                read_mem(pid, *addr, WINDOW)
                    .unwrap_or_else(|e| panic!("reading {name} in pid {pid}: {e}"))
            })
            .collect()
    }

    pub(crate) fn probed(&self) -> bool {
        self.windows() != self.before
    }

    /// Waits (up to 10 s) for the original code to be back.
    pub(crate) fn assert_restored(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.probed() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!self.probed(), "probes left in {:x?}", self.funcs);
    }

    /// Lets the fixture end (end of file on its stdin also ends a loop
    /// started with "stdin") and checks its own output; returns the
    /// iterations it made.
    pub(crate) fn finish(mut self) -> u64 {
        drop(self.fx.stdin.take());
        let line = self.fx.stdout.next_line(EXIT_TIMEOUT);
        let status = self.fx.proc.wait_timeout(EXIT_TIMEOUT);
        assert_eq!(
            status.code(),
            Some(0),
            "fixture status (last line {line:?})"
        );
        let (n, sum) = line
            .strip_prefix("iterations=")
            .and_then(|l| l.split_once(" sum="))
            .unwrap_or_else(|| panic!("expected `iterations=N sum=S`, got {line:?}"));
        let n: u64 = n.parse().unwrap();
        assert_eq!(sum.parse::<u64>().unwrap(), longrun_sum(n));
        n
    }
}
