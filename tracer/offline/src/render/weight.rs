//! What sizes a stack in folded stacks, flame graphs, speedscope, the call
//! tree and the graph: calls or requested bytes of any profile, and in a
//! live profile the bytes still in use at the end or the leak suspects'.

use crate::profile::{StackEntry, Weight};

/// The weight of a stack in the stack renderers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StackWeight {
    /// Allocating calls.
    Calls,
    /// Requested bytes.
    Bytes,
    /// Live mode: bytes still allocated when tracing ended
    /// ([`crate::profile::LiveStats::outstanding_bytes`]).
    InUse,
    /// Live mode: bytes of the leak suspects, the blocks still allocated
    /// and at least `--min-age` old
    /// ([`crate::profile::LiveStats::old_outstanding_bytes`]).
    Leaked,
}

impl StackWeight {
    /// What a count of this weight counts (inferno's count name).
    pub fn unit(self) -> &'static str {
        match self {
            StackWeight::Calls => "calls",
            StackWeight::Bytes => "bytes",
            StackWeight::InUse => "in-use bytes",
            StackWeight::Leaked => "leaked bytes",
        }
    }

    /// The value of `--weight` that selects it.
    pub fn name(self) -> &'static str {
        match self {
            StackWeight::Calls => "calls",
            StackWeight::Bytes => "bytes",
            StackWeight::InUse => "inuse",
            StackWeight::Leaked => "leaked",
        }
    }

    /// Whether it exists only in a live profile.
    pub fn needs_live(self) -> bool {
        matches!(self, StackWeight::InUse | StackWeight::Leaked)
    }

    /// Whether it counts bytes (rather than calls).
    pub fn is_bytes(self) -> bool {
        self != StackWeight::Calls
    }

    /// `entry`'s count of this weight (0 for a live weight of an entry
    /// without live statistics).
    pub fn of(self, entry: &StackEntry) -> u64 {
        let live = entry.live.as_ref();
        match self {
            StackWeight::Calls => entry.counts.calls,
            StackWeight::Bytes => entry.counts.bytes,
            StackWeight::InUse => live.map_or(0, |l| l.outstanding_bytes),
            StackWeight::Leaked => live.map_or(0, |l| l.old_outstanding_bytes),
        }
    }
}

impl From<Weight> for StackWeight {
    fn from(w: Weight) -> Self {
        match w {
            Weight::Calls => StackWeight::Calls,
            Weight::Bytes => StackWeight::Bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::LiveStats;
    use crate::render::test_util::entry;

    #[test]
    fn each_weight_reads_its_count() {
        let mut e = entry("malloc", &["a"], 3, 96);
        assert_eq!(StackWeight::InUse.of(&e), 0);
        e.live = Some(LiveStats {
            outstanding_bytes: 64,
            old_outstanding_bytes: 32,
            ..LiveStats::default()
        });
        let got = [
            StackWeight::Calls,
            StackWeight::Bytes,
            StackWeight::InUse,
            StackWeight::Leaked,
        ]
        .map(|w| w.of(&e));
        assert_eq!(got, [3, 96, 64, 32]);
        assert!(StackWeight::Leaked.needs_live() && !StackWeight::Bytes.needs_live());
    }
}
