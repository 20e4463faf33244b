//! The names a perf map gave, kept compact and within a ceiling: one
//! vector of (start, size, name offset) sorted by start, and one arena
//! of names in the order their lines were read.

/// Most pieces of code named at once, per process (16 bytes each).
pub const MAX_ENTRIES: usize = 1 << 20;

/// Most bytes of names held at once, per process (each name with its
/// 2-byte length; names replaced by a later line count until evicted).
pub const MAX_NAME_BYTES: usize = 64 << 20;

/// Longest name kept, in bytes; a longer one is cut at a character's
/// boundary (and counted).
pub const MAX_NAME_LEN: usize = 1024;

/// One piece of code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    start: u64,
    size: u32,
    /// Where its name's record (length, then the bytes) begins in the
    /// arena. Records are appended in the order lines are read, so a
    /// smaller offset is an older line.
    name: u32,
}

/// Lines parsed and not yet in the table, in the order read.
#[derive(Default)]
pub struct Batch {
    entries: Vec<Entry>,
    names: Vec<u8>,
}

impl Batch {
    /// Adds the line `start size name`; returns whether its name was cut.
    /// `name` is the line's bytes (not UTF-8 on the target's word): what
    /// is not UTF-8 becomes U+FFFD.
    pub fn push(&mut self, start: u64, size: u32, name: &[u8]) -> bool {
        // (UTF-8 checked first: lossy decoding is slower, and names are
        // nearly always UTF-8.)
        let name = match std::str::from_utf8(name) {
            Ok(name) => std::borrow::Cow::Borrowed(name),
            Err(_) => String::from_utf8_lossy(name),
        };
        let mut len = name.len().min(MAX_NAME_LEN);
        while !name.is_char_boundary(len) {
            len -= 1;
        }
        self.entries.push(Entry {
            start,
            size,
            name: self.names.len() as u32,
        });
        self.names.extend_from_slice(&(len as u16).to_le_bytes());
        self.names.extend_from_slice(&name.as_bytes()[..len]);
        len < name.len()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn name_bytes(&self) -> usize {
        self.names.len()
    }
}

/// JIT code by start address: at most one entry per start (a later line
/// for the same start, code recompiled in place, replaces the earlier).
#[derive(Default)]
pub struct Table {
    entries: Vec<Entry>,
    names: Vec<u8>,
}

impl Table {
    /// The name of the code at `addr`: that of the entry starting nearest
    /// at or below it, when `addr` lies within its size.
    pub fn name(&self, addr: u64) -> Option<&str> {
        let i = self.entries.partition_point(|e| e.start <= addr);
        let e = self.entries.get(i.checked_sub(1)?)?;
        (addr - e.start < u64::from(e.size)).then(|| self.name_at(e.name))
    }

    /// Pieces of code named.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    fn record_len(&self, at: usize) -> usize {
        usize::from(u16::from_le_bytes([self.names[at], self.names[at + 1]]))
    }

    fn name_at(&self, at: u32) -> &str {
        let at = at as usize;
        let len = self.record_len(at);
        // Every record was written from a `str`, cut at a boundary.
        std::str::from_utf8(&self.names[at + 2..at + 2 + len]).unwrap_or_default()
    }

    /// Adds `batch`, read after every line already in; returns how many
    /// entries were evicted to stay within the ceiling, the oldest first.
    pub fn add(&mut self, batch: Batch) -> u64 {
        if batch.entries.is_empty() {
            return 0;
        }
        let base = self.names.len() as u32;
        grow(&mut self.names, batch.names.len(), MAX_NAME_BYTES);
        self.names.extend_from_slice(&batch.names);
        grow(&mut self.entries, batch.entries.len(), MAX_ENTRIES);
        self.entries.extend(batch.entries.iter().map(|e| Entry {
            name: e.name + base,
            ..*e
        }));
        // Two sorted runs merged, or one run and a short batch: a stable
        // sort leaves the later of two lines with the same start last.
        self.entries.sort_by_key(|e| e.start);
        self.entries.dedup_by(|later, kept| {
            let same = later.start == kept.start;
            if same {
                *kept = *later;
            }
            same
        });
        self.evict()
    }

    /// Over the ceiling: evicts the oldest entries and names (replaced
    /// names first, as they are older than what replaced them) down to
    /// three quarters of each limit, so that evicting runs once per
    /// quarter of the ceiling read, not once per batch. Returns how many
    /// entries went.
    fn evict(&mut self) -> u64 {
        if self.entries.len() <= MAX_ENTRIES && self.names.len() <= MAX_NAME_BYTES {
            return 0;
        }
        let (keep_entries, keep_names) = (MAX_ENTRIES / 4 * 3, MAX_NAME_BYTES / 4 * 3);
        // The arena is cut before the first record at or past `cut`.
        let mut cut = 0;
        if self.names.len() > keep_names {
            let want = self.names.len() - keep_names;
            while cut < want {
                cut += 2 + self.record_len(cut);
            }
        }
        if self.entries.len() > keep_entries {
            let mut ages: Vec<u32> = self.entries.iter().map(|e| e.name).collect();
            let older = self.entries.len() - keep_entries;
            // Offsets are distinct: the `older` smallest go.
            let (_, nth, _) = ages.select_nth_unstable(older);
            cut = cut.max(*nth as usize);
        }
        let before = self.entries.len();
        self.entries.retain(|e| e.name as usize >= cut);
        for e in &mut self.entries {
            e.name -= cut as u32;
        }
        self.names.drain(..cut);
        (before - self.entries.len()) as u64
    }
}

/// Makes room for `more` in `v`, doubling its capacity as `Vec` does
/// while it is small, but never past what the ceiling (`most`) and
/// `more` need. Past an eighth of the ceiling it takes the ceiling and
/// an eighth more at once (room for any batch after), so that a large
/// table is copied once, not at every doubling, and leaves no trail of
/// larger and larger buffers freed but still resident in the allocator.
/// What the table has not filled yet is reserved, not resident.
fn grow<T>(v: &mut Vec<T>, more: usize, most: usize) {
    let need = v.len() + more;
    if need > v.capacity() {
        let cap = if need > most / 8 {
            most + more.max(most / 8)
        } else {
            (v.capacity() * 2).min(most + more)
        };
        v.reserve_exact(cap.max(need) - v.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(lines: &[(u64, u32, &str)]) -> Batch {
        let mut b = Batch::default();
        for &(start, size, name) in lines {
            b.push(start, size, name.as_bytes());
        }
        b
    }

    #[test]
    fn a_table_past_an_eighth_of_its_ceiling_takes_it_at_once() {
        let mut v: Vec<u8> = Vec::new();
        grow(&mut v, 10, 800);
        assert!(v.capacity() < 100, "{}", v.capacity());
        v.extend([0; 10]);
        // Past 100: the ceiling and an eighth, once; no batch after moves it.
        grow(&mut v, 91, 800);
        assert!(v.capacity() >= 900, "{}", v.capacity());
        let at = v.as_ptr();
        v.extend([0; 790]);
        grow(&mut v, 100, 800);
        assert_eq!(v.as_ptr(), at);
    }

    #[test]
    fn finds_the_code_at_an_address_and_a_later_line_replaces_an_earlier() {
        let mut t = Table::default();
        t.add(batch(&[(0x7f00, 0x10, "leaf"), (0x7f40, 8, "stub")]));
        t.add(batch(&[
            (0x7f00, 0x20, "leaf recompiled"),
            (0x7e00, 4, "first"),
        ]));
        assert_eq!(t.len(), 3);
        assert_eq!(t.name(0x7f00), Some("leaf recompiled"));
        assert_eq!(t.name(0x7f1f), Some("leaf recompiled"));
        assert_eq!(t.name(0x7f20), None);
        assert_eq!(t.name(0x7f47), Some("stub"));
        assert_eq!(t.name(0x7f48), None);
        assert_eq!(t.name(0x7e03), Some("first"));
        assert_eq!(t.name(0x10), None);
        assert_eq!(t.name(u64::MAX), None);
        // The same start twice in one batch: the later line stays.
        t.add(batch(&[(0x9000, 4, "a"), (0x9000, 4, "b")]));
        assert_eq!(t.name(0x9000), Some("b"));
    }

    #[test]
    fn long_names_are_cut_at_a_character_boundary() {
        let mut b = Batch::default();
        let long = "é".repeat(MAX_NAME_LEN);
        assert!(b.push(0x1000, 4, long.as_bytes()));
        assert!(!b.push(0x2000, 4, b"short \xff"));
        let mut t = Table::default();
        t.add(b);
        assert_eq!(t.name(0x1000).unwrap().len(), MAX_NAME_LEN);
        assert_eq!(t.name(0x2000), Some("short \u{fffd}"));
    }

    #[test]
    fn the_oldest_are_evicted_over_the_ceiling_of_entries() {
        let mut t = Table::default();
        let mut evicted = 0;
        let total = MAX_ENTRIES as u64 + 1000;
        for chunk in (0..total).collect::<Vec<_>>().chunks(1 << 16) {
            let mut b = Batch::default();
            // Descending addresses: the oldest are not the lowest.
            for &i in chunk {
                b.push((total - i) * 0x10, 0x10, b"f");
            }
            evicted += t.add(b);
        }
        assert!(t.len() <= MAX_ENTRIES);
        assert_eq!(t.len() as u64 + evicted, total);
        // The newest stay, the oldest went.
        assert_eq!(t.name(0x10), Some("f"));
        assert_eq!(t.name(total * 0x10), None);
    }

    #[test]
    fn names_replaced_in_place_do_not_grow_it_past_the_ceiling() {
        let mut t = Table::default();
        let name = "x".repeat(MAX_NAME_LEN);
        let mut evicted = 0;
        for round in 0..(2 * MAX_NAME_BYTES / MAX_NAME_LEN / 1000) {
            let mut b = Batch::default();
            for k in 0..1000u64 {
                b.push(
                    0x1000 + k * 0x10,
                    0x10,
                    format!("{round} {name}").as_bytes(),
                );
            }
            evicted += t.add(b);
            assert!(t.names.len() <= MAX_NAME_BYTES + 1000 * (MAX_NAME_LEN + 2));
        }
        // Only replaced names were evicted: every entry is there, newest.
        assert_eq!(evicted, 0);
        assert_eq!(t.len(), 1000);
        let last = 2 * MAX_NAME_BYTES / MAX_NAME_LEN / 1000 - 1;
        assert!(t.name(0x1000).unwrap().starts_with(&format!("{last} ")));
    }
}
