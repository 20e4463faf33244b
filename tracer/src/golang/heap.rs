//! The Go runtime's heap profile, read from the running program's memory
//! (`/proc/PID/mem`: no stop, no write, nothing the program notices).
//!
//! `runtime.mbuckets` heads a list of every memory-profile bucket, newest
//! first, linked by `allnext`. A bucket is a header of six words (`next`,
//! `allnext`, `typ`, `hash`, `size`, `nstk`), `nstk` return addresses,
//! then a `memRecord` whose first four words (`active`: allocations,
//! frees, their bytes) are the profile as of the last completed garbage
//! collection. Buckets are never freed and their headers never change
//! once linked, so a walk from the head read at one moment sees a
//! consistent list however the program runs on; the counts may be caught
//! mid-update, and are read again until they agree with the bucket's
//! size (every allocation of a bucket adds its `size` to its bytes).

use std::collections::HashSet;

use crate::tracee::Mem;

/// `bucketType` of a memory-profile bucket.
const MEM_PROFILE: u64 = 1;

/// Most buckets read at one reading; the rest are counted as cut.
pub const MAX_BUCKETS: usize = 1 << 20;

/// Times a bucket's counts are read again when caught mid-update.
const RETRIES: usize = 3;

/// One bucket: its size class, stack and published counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub addr: u64,
    /// Bytes of each object (every allocation counted here is this size).
    pub size: u64,
    /// Return addresses, innermost first.
    pub stack: Vec<u64>,
    pub allocs: u64,
    pub frees: u64,
    pub alloc_bytes: u64,
    pub free_bytes: u64,
}

/// What one walk read, and what it could not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Walk {
    pub buckets: Vec<Bucket>,
    /// Buckets whose memory could not be read, or whose header is not a
    /// memory-profile bucket's: the walk stopped there.
    pub unreadable: u64,
    /// Buckets whose counts never agreed with their size: left out.
    pub inconsistent: u64,
    /// The walk reached [`MAX_BUCKETS`] (or met a bucket twice) and
    /// stopped.
    pub cut: bool,
}

/// Walks the list whose head is at `head_addr` in `mem`. `max_stack`
/// bounds a bucket's stack (a larger count is not a bucket).
pub fn walk(mem: &Mem, head_addr: u64, max_stack: u64) -> Option<Walk> {
    let mut out = Walk::default();
    let mut addr = mem.u64(head_addr)?;
    let mut seen = HashSet::new();
    let mut buf = vec![0u8; 48 + 8 * max_stack as usize + 32];
    while addr != 0 {
        if out.buckets.len() >= MAX_BUCKETS || !seen.insert(addr) {
            out.cut = true;
            break;
        }
        if addr % 8 != 0 || mem.read(addr, &mut buf[..48]).is_none() {
            out.unreadable += 1;
            break;
        }
        let word = |b: &[u8], i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap());
        let (allnext, typ, size, nstk) =
            (word(&buf, 1), word(&buf, 2), word(&buf, 4), word(&buf, 5));
        if typ != MEM_PROFILE || nstk > max_stack {
            out.unreadable += 1;
            break;
        }
        let rest = 8 * nstk as usize + 32;
        let mut agreed = None;
        for _ in 0..RETRIES {
            if mem.read(addr + 48, &mut buf[48..48 + rest]).is_none() {
                break;
            }
            let rec = &buf[48 + 8 * nstk as usize..48 + rest];
            let (allocs, frees, alloc_bytes, free_bytes) =
                (word(rec, 0), word(rec, 1), word(rec, 2), word(rec, 3));
            if allocs.checked_mul(size) == Some(alloc_bytes)
                && frees.checked_mul(size) == Some(free_bytes)
                && frees <= allocs
            {
                agreed = Some((allocs, frees, alloc_bytes, free_bytes));
                break;
            }
        }
        match agreed {
            Some((allocs, frees, alloc_bytes, free_bytes)) => {
                let stack = (0..nstk as usize).map(|i| word(&buf[48..], i)).collect();
                out.buckets.push(Bucket {
                    addr,
                    size,
                    stack,
                    allocs,
                    frees,
                    alloc_bytes,
                    free_bytes,
                });
            }
            None => out.inconsistent += 1,
        }
        addr = allnext;
    }
    Some(out)
}

/// Go's own scaling of a sampled count (`runtime/pprof`'s
/// `scaleHeapSample`): with one sample per `rate` bytes on average, an
/// object of `size` bytes is sampled with probability
/// `1 - exp(-size/rate)`; counts and bytes are divided by it (and cut to
/// whole numbers, as Go does).
pub fn scale(count: u64, bytes: u64, rate: u64) -> (u64, u64) {
    if count == 0 || bytes == 0 {
        return (0, 0);
    }
    if rate <= 1 {
        return (count, bytes);
    }
    let avg = bytes as f64 / count as f64;
    let s = 1.0 / (1.0 - (-avg / rate as f64).exp());
    ((count as f64 * s) as u64, (bytes as f64 * s) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_as_go_does() {
        // 10 samples of 1 KiB at 512 KiB: each stands for 512.50016
        // objects (cut to whole numbers after the product, as Go does).
        let (c, b) = scale(10, 10 * 1024, 512 * 1024);
        assert_eq!(c, 5125);
        assert_eq!(b, 5248001);
        // Objects far larger than the rate are all sampled.
        assert_eq!(scale(3, 3 << 30, 512 * 1024), (3, 3 << 30));
        assert_eq!(scale(5, 500, 1), (5, 500));
        assert_eq!(scale(0, 0, 512 * 1024), (0, 0));
    }
}
