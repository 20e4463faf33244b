//! Whether a process's interpreter state can be read where the layout
//! says it is: a program that defines `_PyRuntime` but holds something
//! else there (or an interpreter built another way) is said to be
//! unreadable, once, instead of every stack being "not a Python thread".

use std::time::Duration;

use tracer_common::PythonLayout;

use super::code::Memory;

/// What a process's `_PyRuntime` holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// No interpreter with a thread yet (or any more), or the process
    /// could not be read at all (gone): nothing to judge by.
    NotYet,
    /// The newest interpreter and its newest thread state read as the
    /// layout says.
    Readable,
    /// What the layout leads to is not an interpreter's state: why, in a
    /// few words.
    Unreadable(String),
}

/// The line that says so: `who` (`CPython 3.X in PATH`) and why.
pub fn unreadable_line(who: &str, why: &str) -> String {
    format!(
        "{who}: its interpreter state (_PyRuntime) could not be read ({why}): native frames only"
    )
}

/// One look at the state: `_PyRuntime`'s newest interpreter must be
/// readable, and so must its newest thread state, which must name that
/// interpreter as its own and have no state before it in the list (each
/// new state is put first, with none before it).
pub fn check(mem: &impl Memory, l: &PythonLayout) -> State {
    let word = |addr: u64| {
        let mut b = [0u8; 8];
        mem.read(addr, &mut b).ok().map(|()| u64::from_le_bytes(b))
    };
    let Some(interp) = word(l.runtime + l.interp_head as u64) else {
        return State::NotYet;
    };
    if interp == 0 {
        return State::NotYet;
    }
    let Some(head) = word(interp + l.threads_head as u64) else {
        return State::Unreadable(format!(
            "its interpreter list points to {interp:#x}, which is not mapped"
        ));
    };
    if head == 0 {
        return State::NotYet;
    }
    let (Some(prev), Some(owner)) = (word(head), word(head + l.tstate_interp as u64)) else {
        return State::Unreadable(format!(
            "its interpreter's thread list points to {head:#x}, which is not mapped"
        ));
    };
    if owner != interp {
        return State::Unreadable(format!(
            "its interpreter's first thread state names another interpreter ({owner:#x}, not {interp:#x})"
        ));
    }
    if prev != 0 {
        return State::Unreadable(format!(
            "its interpreter's first thread state has one before it ({prev:#x})"
        ));
    }
    State::Readable
}

/// [`check`], looked at again while it says unreadable, up to three times
/// 20 ms apart: a thread state being added or removed as it is read can
/// look wrong for an instant, never for that long.
pub fn settled(mem: &impl Memory, l: &PythonLayout) -> State {
    let mut state = check(mem, l);
    for _ in 0..2 {
        if !matches!(state, State::Unreadable(_)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        state = check(mem, l);
    }
    state
}

/// [`settled`] in process `pid`'s memory (not judged when it cannot be
/// opened).
pub fn settled_in(pid: u32, l: &PythonLayout) -> State {
    match super::code::ProcessMemory::open(pid) {
        Ok(mem) => settled(&mem, l),
        Err(_) => State::NotYet,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    /// Words at addresses; anything else is unmapped.
    struct Words(Vec<(u64, u64)>);

    impl Memory for Words {
        fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
            let w = self.0.iter().find(|(a, _)| *a == addr).map(|(_, w)| *w);
            let w = w.ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
            buf.copy_from_slice(&w.to_le_bytes()[..buf.len()]);
            Ok(())
        }
    }

    fn layout() -> PythonLayout {
        PythonLayout {
            runtime: 0x1000,
            interp_head: 0x28,
            threads_head: 0x10,
            tstate_interp: 0x10,
            ..Default::default()
        }
    }

    #[test]
    fn a_runtime_is_judged_by_its_interpreter_and_first_thread_state() {
        let l = layout();
        let (interp, ts) = (0x5000, 0x9000);
        let real = |prev: u64, owner: u64| {
            Words(vec![
                (0x1028, interp),
                (interp + 0x10, ts),
                (ts, prev),
                (ts + 0x10, owner),
            ])
        };
        assert_eq!(check(&real(0, interp), &l), State::Readable);
        assert!(
            matches!(check(&real(0, 0x7777), &l), State::Unreadable(w) if w.contains("another interpreter"))
        );
        assert!(
            matches!(check(&real(0x9100, interp), &l), State::Unreadable(w) if w.contains("one before it"))
        );
        // Not started, or gone.
        assert_eq!(check(&Words(vec![(0x1028, 0)]), &l), State::NotYet);
        assert_eq!(check(&Words(vec![]), &l), State::NotYet);
        assert_eq!(
            check(&Words(vec![(0x1028, interp), (interp + 0x10, 0)]), &l),
            State::NotYet
        );
        // Garbage: a pointer to nothing.
        let junk = 0x4141_4141_4141_4141;
        assert_eq!(
            check(&Words(vec![(0x1028, junk)]), &l),
            State::Unreadable(format!(
                "its interpreter list points to {junk:#x}, which is not mapped"
            ))
        );
    }
}
