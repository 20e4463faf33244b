//! The frame walk over a copied stack: the user-space twin of the BPF walk
//! (`unwind_frame` in `tracer-ebpf`), rule for rule, so that a walk the
//! tracer finishes gives the same frames and the same stop as the kernel's
//! once the rules are in. Signal frames stop both (the BPF walk does not
//! follow them yet).

use super::Rule;

/// Upper bound on the number of return addresses [`unwind`] produces: the
/// direct caller and [`tracer_common::MAX_FRAMES`] above it, as the BPF
/// walk keeps.
pub const MAX_FRAMES: usize = tracer_common::MAX_FRAMES + 1;

/// Why [`unwind`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stop {
    /// Reached a frame whose return address is undefined (`_start`, thread
    /// entry) or a null return address: the stack is complete.
    End,
    /// The rule of the last return address is [`Rule::UNSUPPORTED`], or it
    /// needs an rbp that an earlier frame could not recover.
    Unsupported,
    /// A slot to read lies above the end of the copied bytes: the copy was
    /// too short (the stack itself may well continue).
    OutOfCopy,
    /// A slot to read lies below the copy start, is misaligned, the CFA
    /// did not move up the stack, or a return address lies in no code:
    /// corrupt stack or wrong rule.
    BadRead,
    /// [`MAX_FRAMES`] return addresses were produced.
    MaxFrames,
}

/// A copy of the target's stack: its bytes, and the pages of them that
/// could not be read (a page never touched, under a large local buffer).
/// A stack deeper than the copy comes as its first bytes and its last
/// (`tail`, copied from `tail_at`); what lies between is out of the copy.
#[derive(Clone, Copy, Debug)]
pub struct StackCopy<'a> {
    pub bytes: &'a [u8],
    /// Bit `i`: the copy's page `i` is a hole (zeroes in `bytes` or
    /// `tail`); the copy begins at `page_base`, and its tail follows
    /// `bytes` in it.
    pub holes: u64,
    pub page_base: u64,
    pub tail: &'a [u8],
    pub tail_at: u64,
}

impl<'a> From<&'a [u8]> for StackCopy<'a> {
    fn from(bytes: &'a [u8]) -> Self {
        StackCopy {
            bytes,
            holes: 0,
            page_base: 0,
            tail: &[],
            tail_at: 0,
        }
    }
}

impl StackCopy<'_> {
    /// Whether the copy's byte at `at` (counted from `page_base`) lies in
    /// a hole.
    fn in_hole(&self, at: u64) -> bool {
        let page = at >> 12;
        page < 64 && self.holes >> page & 1 != 0
    }
}

/// Read the 8-byte word at `addr` from `stack`, whose `bytes` were copied
/// from address `base`. A word in a hole of the copy, or in neither of its
/// parts, is out of it.
fn read(stack: StackCopy, base: u64, addr: u64) -> Result<u64, Stop> {
    if addr < base || !addr.is_multiple_of(8) {
        return Err(Stop::BadRead);
    }
    let head = base.wrapping_sub(stack.page_base);
    let off = addr - base;
    let (word, at) = if off < stack.bytes.len() as u64 {
        (stack.bytes.get(off as usize..off as usize + 8), head + off)
    } else {
        match addr.checked_sub(stack.tail_at) {
            Some(d) if !stack.tail.is_empty() && d < stack.tail.len() as u64 => (
                stack.tail.get(d as usize..d as usize + 8),
                head + stack.bytes.len() as u64 + d,
            ),
            _ => (None, 0),
        }
    };
    match word {
        Some(_) if stack.in_hole(at) => Err(Stop::OutOfCopy),
        Some(b) => Ok(u64::from_le_bytes(b.try_into().expect("8 bytes"))),
        None => Err(Stop::OutOfCopy),
    }
}

/// Walk a stack captured at function entry (e.g. a uprobe on `malloc`).
///
/// `rsp` and `rbp` are the register values at the probe, where rsp points at
/// the return address `start_ra` (so the caller's rsp, the first CFA, is
/// `rsp + 8`, and rbp still is the caller's). `stack` holds the bytes copied
/// from address `rsp` upwards. `rule_for` gives the rule for a runtime return
/// address (typically a cache in front of [`super::ObjectCfi::rule_for_ra`]).
///
/// Returns the return addresses, innermost first (`start_ra` first; the
/// address of the probed function itself is not included), and why the walk
/// stopped. The last address is included even when its rule stops the walk,
/// because it is a genuine frame (the caller cannot be found, not the frame).
#[cfg(test)]
pub fn unwind(
    start_ra: u64,
    rsp: u64,
    rbp: Option<u64>,
    stack: &[u8],
    rule_for: impl FnMut(u64) -> Rule,
) -> (Vec<u64>, Stop) {
    let (frames, stop, _) = unwind_with_fp(start_ra, rsp, rbp, stack.into(), rule_for, |_| false);
    (frames, stop)
}

/// The rule of a frame that keeps its caller's rbp at `[rbp]` and its
/// return address at `[rbp + 8]`.
pub const FRAME_POINTER: Rule = Rule {
    kind: Rule::CFA_RBP,
    rbp: Rule::RBP_AT,
    rbp_off: -16,
    cfa_off: 16,
};

/// As [`unwind`]; where no call-frame information covers a frame's code
/// (JIT code, assembly or code built without unwind tables, such as
/// Chromium's), the frame pointer is followed if it checks out: rbp lies
/// above the frame's stack pointer, and the return address it leads to is
/// one `is_call_site` accepts (code right after a call instruction). Also
/// returns the return addresses where the frame pointer was followed.
pub fn unwind_with_fp(
    start_ra: u64,
    rsp: u64,
    rbp: Option<u64>,
    stack: StackCopy,
    mut rule_for: impl FnMut(u64) -> Rule,
    mut is_call_site: impl FnMut(u64) -> bool,
) -> (Vec<u64>, Stop, Vec<u64>) {
    let mut frames = Vec::new();
    let mut by_fp = Vec::new();
    let mut walk_rule = |ra: u64, cfa: u64, rbp: Option<u64>| -> Rule {
        let rule = rule_for(ra);
        if rule.kind != Rule::UNSUPPORTED {
            return rule;
        }
        let Some(bp) = rbp else {
            return rule;
        };
        let new_cfa = bp.wrapping_add(16);
        if new_cfa <= cfa || !bp.is_multiple_of(8) {
            return rule;
        }
        match read(stack, rsp, bp.wrapping_add(8)) {
            Ok(next) if is_call_site(next) => {
                by_fp.push(ra);
                FRAME_POINTER
            }
            _ => rule,
        }
    };
    let stop = walk(start_ra, rsp, rbp, stack, &mut frames, &mut walk_rule);
    (frames, stop, by_fp)
}

fn walk(
    start_ra: u64,
    rsp: u64,
    rbp: Option<u64>,
    stack: StackCopy,
    frames: &mut Vec<u64>,
    rule_for: &mut impl FnMut(u64, u64, Option<u64>) -> Rule,
) -> Stop {
    let mut ra = start_ra;
    // CFA of the frame below = rsp of the frame owning `ra`, at `ra`.
    let Some(mut cfa) = rsp.checked_add(8) else {
        return Stop::BadRead;
    };
    let mut rbp = rbp;
    loop {
        if ra == 0 {
            return Stop::End;
        }
        if frames.len() == MAX_FRAMES {
            return Stop::MaxFrames;
        }
        frames.push(ra);
        let rule = rule_for(ra, cfa, rbp);
        let base = match rule.kind {
            Rule::CFA_RSP => cfa,
            Rule::CFA_RBP => match rbp {
                Some(rbp) => rbp,
                None => return Stop::Unsupported,
            },
            Rule::END => return Stop::End,
            Rule::NOT_CODE => return Stop::BadRead,
            // Signal frames too: the BPF walk does not follow them.
            _ => return Stop::Unsupported,
        };
        let new_cfa = base.wrapping_add_signed(i64::from(rule.cfa_off));
        // Each caller's frame lies strictly above its callee's: this is what
        // guarantees termination on garbage.
        if new_cfa <= cfa || !new_cfa.is_multiple_of(8) {
            return Stop::BadRead;
        }
        let next_ra = match read(stack, rsp, new_cfa.wrapping_sub(8)) {
            Ok(v) => v,
            Err(stop) => return stop,
        };
        rbp = match rule.rbp {
            Rule::RBP_SAME => rbp,
            Rule::RBP_AT => {
                match read(
                    stack,
                    rsp,
                    new_cfa.wrapping_add_signed(i64::from(rule.rbp_off)),
                ) {
                    Ok(v) => Some(v),
                    Err(stop) => return stop,
                }
            }
            _ => None,
        };
        cfa = new_cfa;
        ra = next_ra;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rsp_rule(cfa_off: i32) -> Rule {
        Rule {
            kind: Rule::CFA_RSP,
            rbp: Rule::RBP_SAME,
            rbp_off: 0,
            cfa_off,
        }
    }

    /// Synthetic stack: f1 (frame of 32 bytes incl. ra) saved rbp, f2 uses rbp.
    #[test]
    fn synthetic_walk() {
        let rsp = 0x7000_0000u64;
        let mut words = [0u64; 16];
        words[0] = 0x1000; // ra into f1 at [rsp]
                           // f1: CFA1 = CFA0 + 32 = rsp + 40 ; ra2 at CFA1 - 8 = rsp + 32 (word 4)
                           // f1 saved rbp at CFA1 - 16 (word 3)
        words[3] = rsp + 64; // caller's rbp (f2 uses it)
        words[4] = 0x2000;
        // f2: CFA = rbp + 16 = rsp + 80; ra3 at rsp + 72 (word 9)
        words[9] = 0x3000;
        let stack: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let (frames, stop) = unwind(0x1000, rsp, Some(0xdead), &stack, |ra| match ra {
            0x1000 => Rule {
                kind: Rule::CFA_RSP,
                rbp: Rule::RBP_AT,
                rbp_off: -16,
                cfa_off: 32,
            },
            0x2000 => Rule {
                kind: Rule::CFA_RBP,
                rbp: Rule::RBP_AT,
                rbp_off: -16,
                cfa_off: 16,
            },
            0x3000 => Rule::end(),
            _ => Rule::unsupported(),
        });
        assert_eq!(frames, vec![0x1000, 0x2000, 0x3000]);
        assert_eq!(stop, Stop::End);
    }

    #[test]
    fn stops() {
        let rsp = 0x1000u64;
        let stack = [0u8; 16];
        assert_eq!(
            unwind(5, rsp, Some(0), &stack, |_| Rule::unsupported()),
            (vec![5], Stop::Unsupported)
        );
        assert_eq!(
            unwind(5, rsp, Some(0), &stack, |_| rsp_rule(64)),
            (vec![5], Stop::OutOfCopy)
        );
        assert_eq!(
            unwind(5, rsp, Some(0), &stack, |_| rsp_rule(-8)),
            (vec![5], Stop::BadRead)
        );
        assert_eq!(
            unwind(5, rsp, Some(0), &stack, |_| rsp_rule(4)),
            (vec![5], Stop::BadRead)
        );
        // ra 0 read from the stack ends the walk.
        assert_eq!(
            unwind(5, rsp, Some(0), &stack, |_| rsp_rule(8)),
            (vec![5], Stop::End)
        );
        let rbp_undef = Rule {
            kind: Rule::CFA_RSP,
            rbp: Rule::RBP_UNDEF,
            rbp_off: 0,
            cfa_off: 8,
        };
        let mut n = 0;
        let stack = [7u8; 64];
        let r = unwind(5, rsp, Some(0), &stack, |_| {
            n += 1;
            if n == 1 {
                rbp_undef
            } else {
                Rule {
                    kind: Rule::CFA_RBP,
                    ..rbp_undef
                }
            }
        });
        assert_eq!(r.1, Stop::Unsupported);
        assert_eq!(r.0.len(), 2);
    }

    /// A JVM's JIT frames are followed by frame pointer whatever the
    /// return address they lead to follows; a wrong frame pointer ends the
    /// walk as a bad frame (counted), never as a frame made up: one that
    /// points below the frame, and one that leads to a return address in
    /// no code.
    #[test]
    fn wrong_frame_pointers_stop_the_walk() {
        let rsp = 0x7000_0000u64;
        let jit = |ra: u64| {
            if (0x1000..0x2000).contains(&ra) {
                Rule::unsupported()
            } else {
                Rule::not_code()
            }
        };
        let stack =
            |words: &[u64]| -> Vec<u8> { words.iter().flat_map(|w| w.to_le_bytes()).collect() };
        // rbp below the stack pointer: not followed.
        let below = stack(&[0x1000, 0, 0, 0]);
        let (frames, stop, by_fp) = unwind_with_fp(
            0x1000,
            rsp,
            Some(rsp - 64),
            below.as_slice().into(),
            jit,
            |_| true,
        );
        assert_eq!(
            (frames, stop, by_fp),
            (vec![0x1000], Stop::Unsupported, vec![])
        );
        // rbp leads to a return address in no code: the frame is kept out.
        let nowhere = stack(&[0x1000, rsp + 32, 0xdead_0000, 0, 0]);
        let (frames, stop, by_fp) = unwind_with_fp(
            0x1000,
            rsp,
            Some(rsp + 8),
            nowhere.as_slice().into(),
            jit,
            |_| true,
        );
        assert_eq!(stop, Stop::BadRead);
        assert_eq!(frames, vec![0x1000, 0xdead_0000]);
        assert_eq!(by_fp, vec![0x1000]);
        // A chain of frame pointers that loops: ended (here, or by the
        // kernel once the rule is in, as a bad frame), not followed round.
        let looped = stack(&[0x1000, rsp + 8, 0x1800, 0, 0]);
        let (frames, stop, _) = unwind_with_fp(
            0x1000,
            rsp,
            Some(rsp + 8),
            looped.as_slice().into(),
            jit,
            |_| true,
        );
        assert_eq!(frames, vec![0x1000, 0x1800]);
        assert_eq!(stop, Stop::Unsupported);
        let (_, stop) = unwind(0x1800, rsp + 16, Some(rsp + 8), &looped[16..], |_| {
            FRAME_POINTER
        });
        assert_eq!(stop, Stop::BadRead);
    }

    /// A copy in two parts (a stack deeper than the copy): a frame whose
    /// return address lies in the tail is walked through; one whose slot
    /// lies between the parts, or in a hole of the tail, is out of the
    /// copy.
    #[test]
    fn a_copy_in_two_parts_is_read_at_both() {
        let rsp = 0x7000_0000u64;
        let word = |v: u64| v.to_le_bytes();
        // Head: 0x1000 at rsp; its frame is 1 MiB, so its caller 0x2000
        // is at rsp + 1 MiB, in a tail of one page from there.
        let mut head = vec![0u8; 4096];
        head[..8].copy_from_slice(&word(0x1000));
        let tail_at = rsp + (1 << 20);
        let mut tail = vec![0u8; 4096];
        tail[..8].copy_from_slice(&word(0x2000));
        let rules = |cfa_off: i32| {
            move |ra: u64| match ra {
                0x1000 => rsp_rule(cfa_off),
                _ => Rule::end(),
            }
        };
        let copy = |holes: u64| StackCopy {
            bytes: &head,
            holes,
            page_base: rsp,
            tail: &tail,
            tail_at,
        };
        let walk = |cfa_off: i32, holes: u64| {
            let (frames, stop, _) =
                unwind_with_fp(0x1000, rsp, None, copy(holes), rules(cfa_off), |_| false);
            (frames, stop)
        };
        assert_eq!(walk(1 << 20, 0), (vec![0x1000, 0x2000], Stop::End));
        // Between the parts.
        assert_eq!(walk(1 << 19, 0), (vec![0x1000], Stop::OutOfCopy));
        // The tail's page (the copy's second) a hole.
        assert_eq!(walk(1 << 20, 0b10), (vec![0x1000], Stop::OutOfCopy));
    }
}
