//! The live tracker on hand-made event sequences.

use super::*;

fn key(stack: u64) -> CountKey {
    CountKey {
        stack,
        ..CountKey::default()
    }
}

fn alloc(k: u64, ptr: u64, size: u64, ts: u64) -> AllocEvent {
    AllocEvent {
        kind: EVENT_ALLOC,
        ptr,
        size,
        ts,
        key: key(k),
        ..AllocEvent::default()
    }
}

fn free(ptr: u64, ts: u64) -> FreeEvent {
    FreeEvent {
        kind: EVENT_FREE,
        ptr,
        ts,
        ..FreeEvent::default()
    }
}

fn resize(k: u64, old_ptr: u64, ptr: u64, size: u64, entry_ts: u64, ts: u64) -> AllocEvent {
    AllocEvent {
        old_ptr,
        entry_ts,
        ..alloc(k, ptr, size, ts)
    }
}

/// Stacks 1 and 2's live bytes at the peak.
fn shares(t: &LiveTracker) -> [u64; 2] {
    [1, 2].map(|k| t.key_stats(&key(k)).unwrap().live_bytes_at_peak)
}

#[test]
fn peak_shares_are_taken_when_the_heap_shrinks() {
    let mut t = LiveTracker::new(1_000_000, 100);
    t.on_alloc(&alloc(1, 0x10, 100, 1));
    t.on_alloc(&alloc(2, 0x20, 50, 2));
    // Peak 150: stack 1 has 100 of it, stack 2 has 50.
    t.on_free(&free(0x10, 3));
    t.on_alloc(&alloc(2, 0x30, 60, 4)); // live 110, below the peak
    t.finish();
    assert_eq!((t.peak_bytes, shares(&t)), (150, [100, 50]));
    assert_eq!(t.key_stats(&key(2)).unwrap().max_live_bytes, 110);
}

#[test]
fn a_later_higher_peak_replaces_the_shares() {
    let mut t = LiveTracker::new(1_000_000, 100);
    t.on_alloc(&alloc(1, 0x10, 100, 1));
    t.on_free(&free(0x10, 2));
    t.on_alloc(&alloc(2, 0x10, 300, 3));
    t.finish();
    assert_eq!((t.peak_bytes, shares(&t)), (300, [0, 300]));
}

#[test]
fn temporaries_and_lifetimes() {
    let mut t = LiveTracker::new(1000, 100);
    t.on_alloc(&alloc(1, 0x10, 8, 10));
    t.on_free(&free(0x10, 500)); // 490 ns: temporary
    t.on_alloc(&alloc(1, 0x10, 8, 600));
    t.on_free(&free(0x10, 10_600)); // 10 us: not
    t.finish();
    let s = t.stats(&key(1), None, 20_000).unwrap();
    assert_eq!(s.temporaries, 1);
    assert_eq!(s.allocations, 2);
    assert_eq!(s.frees, 2);
    let life = s.lifetime_ns.unwrap();
    assert_eq!(life.max, 10_000, "{life:?}");
    assert_eq!(s.size.unwrap().p50, 8);
}

#[test]
fn size_maxima_are_exact() {
    let mut t = LiveTracker::new(1000, 100);
    // 16384 is 16511 in a two-digit histogram.
    t.on_alloc(&alloc(1, 0x10, 16384, 10));
    t.on_alloc(&alloc(1, 0x20, 16384, 20));
    t.on_alloc(&alloc(2, 0x30, 100, 30));
    t.on_alloc(&alloc(2, 0x40, 16385, 40));
    t.finish();
    let size = |k| t.stats(&key(k), None, 50).unwrap().size.unwrap();
    let one = size(1);
    assert_eq!([one.p50, one.p90, one.p99, one.max], [16384; 4]);
    let two = size(2);
    assert_eq!((two.p50, two.max), (100, 16385));
}

#[test]
fn outstanding_blocks_and_their_age() {
    let mut t = LiveTracker::new(1000, 100);
    t.on_alloc(&alloc(1, 0x10, 64, 1_000_000_000));
    t.on_alloc(&alloc(1, 0x20, 32, 2_900_000_000));
    t.finish();
    let now = 3_000_000_000;
    let out = t.outstanding(now, 1_000_000_000);
    let o = out[&key(1)];
    assert_eq!(
        (o.blocks, o.bytes, o.old_blocks, o.old_bytes),
        (2, 96, 1, 64)
    );
    let s = t.stats(&key(1), Some(&o), now).unwrap();
    assert_eq!(s.outstanding, 2);
    assert!((s.oldest_age_secs - 2.0).abs() < 1e-9);
}

#[test]
fn unknown_frees_stale_blocks_and_a_full_table_are_counted() {
    let mut t = LiveTracker::new(1000, 2);
    t.on_free(&free(0x99, 1));
    t.on_alloc(&alloc(1, 0x10, 8, 2));
    t.on_alloc(&alloc(1, 0x10, 8, 3)); // its free was never seen
    t.on_alloc(&alloc(1, 0x20, 8, 4));
    t.on_alloc(&alloc(1, 0x30, 8, 5)); // no room
    assert_eq!((t.frees_unknown, t.stale, t.untracked), (1, 1, 1));
    assert_eq!(t.key_stats(&key(1)).unwrap().live_blocks, 2);
    t.on_free(&free(0x30, 6)); // the untracked block
    assert_eq!(t.frees_unknown, 2);
}

#[test]
fn frees_kept_aside_apply_in_their_order() {
    let mut t = LiveTracker::new(1000, 100);
    let kept = |ptr, ts, born_by| LostFree { ptr, ts, born_by };
    // Drained out of order: the block's next allocation comes from a
    // ring, its free from the queue of lost frees.
    t.on_bytes(&bytes(&alloc(1, 0x10, 8, 30)));
    t.on_bytes(&bytes(&alloc(1, 0x10, 8, 10)));
    t.on_lost_free(kept(0x10, 20, 20));
    // A resize's release kept aside: the block at 0x20 was born after
    // the call began (another thread's), so it stays.
    t.on_bytes(&bytes(&alloc(1, 0x20, 8, 50)));
    t.on_lost_free(kept(0x20, 60, 40));
    // A kept free of a block never seen is unknown, as a free is.
    t.on_lost_free(kept(0x99, 70, 70));
    t.flush(None);
    assert_eq!((t.stale, t.frees_unknown), (0, 1));
    let st = t.key_stats(&key(1)).unwrap();
    assert_eq!((st.allocations, st.frees, st.live_blocks), (3, 1, 2));
}

#[test]
fn allocations_kept_aside_apply_in_their_order() {
    let mut t = LiveTracker::new(1000, 100);
    let kept = |k, ptr, size, ts| LostAlloc {
        ptr,
        ts,
        size,
        key: key(k),
    };
    // Drained out of order: the block's free and its next allocation
    // come from the rings, its first allocation from the queue of lost
    // allocations.
    t.on_bytes(&bytes(&free(0x10, 20)));
    t.on_bytes(&bytes(&alloc(2, 0x10, 16, 30)));
    t.on_lost_alloc(kept(1, 0x10, 8, 10));
    // A resize in place whose event found the ring full: its released
    // block and its new one, the same address, kept at once.
    t.on_bytes(&bytes(&alloc(1, 0x20, 8, 40)));
    t.on_lost_free(LostFree {
        ptr: 0x20,
        ts: 51,
        born_by: 45,
    });
    t.on_lost_alloc(kept(2, 0x20, 64, 51));
    t.flush(None);
    assert_eq!((t.stale, t.frees_unknown, t.untracked), (0, 0, 0));
    let one = t.key_stats(&key(1)).unwrap();
    assert_eq!((one.allocations, one.frees, one.live_blocks), (2, 2, 0));
    let two = t.key_stats(&key(2)).unwrap();
    assert_eq!(
        (two.allocations, two.live_blocks, two.live_bytes),
        (2, 2, 80)
    );
}

#[test]
fn a_resize_releases_its_old_block_only_if_it_predates_the_call() {
    let mut t = LiveTracker::new(1000, 100);
    t.on_alloc(&alloc(1, 0x10, 8, 10));
    // Moved: 0x10 released, 0x20 tracked.
    t.on_alloc(&resize(2, 0x10, 0x20, 16, 20, 30));
    assert!(!t.outstanding(40, 0).contains_key(&key(1)));
    // A resize that began at 55 moved 0x20; another thread was handed
    // 0x20 before that resize returned (its event comes first, and
    // finds the old block still there). The new block stays.
    t.on_alloc(&alloc(3, 0x20, 4, 60));
    t.on_alloc(&resize(2, 0x20, 0x40, 32, 55, 70));
    assert_eq!(t.stale, 1);
    assert_eq!(t.outstanding(80, 0)[&key(3)].blocks, 1);
    // A resize of a block never seen is not an unknown free.
    t.on_alloc(&resize(2, 0x77, 0x30, 8, 90, 91));
    assert_eq!(t.frees_unknown, 0);
}

fn bytes<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: plain old data.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

#[test]
fn rings_are_merged_by_time_and_later_events_wait() {
    let mut t = LiveTracker::new(1000, 100);
    // Ring of CPU 1 drained first: the free of 0x10 and its next
    // allocation; ring of CPU 0: the first allocation of 0x10.
    t.on_bytes(&bytes(&free(0x10, 20)));
    t.on_bytes(&bytes(&alloc(2, 0x10, 16, 30)));
    t.on_bytes(&bytes(&alloc(1, 0x10, 8, 10)));
    // A free stamped after the drain began waits.
    t.on_bytes(&bytes(&free(0x10, 50)));
    t.flush(Some(40));
    assert_eq!((t.frees_unknown, t.stale), (0, 0));
    assert_eq!(t.key_stats(&key(1)).unwrap().frees, 1);
    assert_eq!(t.outstanding(45, 0)[&key(2)].blocks, 1);
    t.flush(None);
    assert!(t.outstanding(60, 0).is_empty());
    assert_eq!(t.bad_events, 0);
    t.on_bytes(&[9, 0, 0, 0]);
    assert_eq!(t.bad_events, 1);
}

#[test]
fn a_block_applied_before_its_walk_finished_joins_its_stack_later() {
    use tracer_common::miss_stack_id;
    let mut t = LiveTracker::new(1000, 100);
    let (early, late, freed) = (miss_stack_id(1), miss_stack_id(2), miss_stack_id(3));
    // Walk 1 finished first: its call goes straight to stack 8.
    t.remap_stack(early, 8);
    t.on_alloc(&alloc(early, 0x10, 100, 1));
    // Walks 2 and 3 finish after their calls were applied; 3's block is
    // freed meanwhile.
    t.on_alloc(&alloc(late, 0x20, 50, 2));
    t.on_alloc(&alloc(freed, 0x30, 10, 3));
    t.on_free(&free(0x30, 5));
    t.remap_stack(late, 8);
    t.remap_stack(freed, 9);
    let out = t.outstanding(10, 0);
    assert_eq!(out[&key(8)].blocks, 2);
    assert_eq!(out[&key(8)].bytes, 150);
    assert_eq!(out.len(), 1, "no block left under a walk's id");
    let eight = t.key_stats(&key(8)).unwrap();
    assert_eq!((eight.allocations, eight.live_bytes), (2, 150));
    assert_eq!(eight.max_size, 100);
    let nine = t.key_stats(&key(9)).unwrap();
    assert_eq!((nine.allocations, nine.frees, nine.live_blocks), (1, 1, 0));
    assert!(t.key_stats(&key(late)).is_none());
    // The entry emptied by the move is taken by the next new stack, and
    // a later free finds the moved block under its stack.
    let entries = t.stacks().count();
    t.on_alloc(&alloc(4, 0x40, 1, 6));
    assert_eq!(t.stacks().count(), entries);
    t.on_free(&free(0x20, 7));
    assert_eq!(t.key_stats(&key(8)).unwrap().live_bytes, 100);
    assert_eq!(t.frees_unknown, 0);
}
