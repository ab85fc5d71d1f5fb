//! Exact walks through the store (issue 2), step by step with the slots, victims, order and
//! events each step must produce.

use kvoffload_core::{
    Error, Event, EventKind, KeyBuf, KeyStatus, PolicyKind, Positions, RankedBatch, Store,
    StorePlan,
};

fn k(id: u8) -> Vec<u8> {
    // 36-byte keys like vLLM's: a 32-byte hash and a 4-byte group index.
    let mut key = vec![id; 32];
    key.extend_from_slice(&[0, 0, 0, 0]);
    key
}

fn ks(ids: &[u8]) -> Vec<Vec<u8>> {
    ids.iter().map(|&i| k(i)).collect()
}

fn ids<K: AsRef<[u8]>>(keys: impl IntoIterator<Item = K>) -> Vec<u8> {
    keys.into_iter().map(|key| key.as_ref()[0]).collect()
}

fn store(s: &mut Store, keys: &[u8]) -> StorePlan {
    store_in(s, keys, None)
}

fn store_ranked(s: &mut Store, keys: &[u8], rank: u64, first_position: i64) -> StorePlan {
    let batch = RankedBatch {
        rank,
        positions: Positions::From(first_position),
    };
    store_in(s, keys, Some(batch))
}

fn store_in(s: &mut Store, keys: &[u8], batch: Option<RankedBatch>) -> StorePlan {
    let plan = s
        .prepare_store_ranked(&ks(keys), batch, false)
        .unwrap()
        .expect("room for the keys");
    let written: Vec<Vec<u8>> = plan.indices.iter().map(|&i| k(keys[i as usize])).collect();
    s.complete_store(&written, true).unwrap();
    s.check_invariants().unwrap();
    plan
}

fn order(s: &Store) -> Vec<Vec<u8>> {
    s.recency_order().iter().map(ids).collect()
}

fn stored(keys: &[u8]) -> Event {
    Event {
        kind: EventKind::Stored,
        keys: KeyBuf::from_keys(&ks(keys)).unwrap(),
    }
}

fn removed(keys: &[u8]) -> Event {
    Event {
        kind: EventKind::Removed,
        keys: KeyBuf::from_keys(&ks(keys)).unwrap(),
    }
}

#[test]
fn lru_walk_from_the_issue() {
    let mut s = Store::new(4, PolicyKind::Lru, true).unwrap();
    for id in 1..=4 {
        assert_eq!(store(&mut s, &[id]).slots, vec![u32::from(id) - 1]);
    }
    assert_eq!(order(&s), vec![vec![1, 2, 3, 4]]);

    s.touch(&ks(&[1]), true).unwrap();
    assert_eq!(order(&s), vec![vec![2, 3, 4, 1]]);
    let plan = store(&mut s, &[5]);
    assert_eq!((ids(plan.evicted.iter()), plan.slots), (vec![2], vec![1]));
    assert_eq!(order(&s), vec![vec![3, 4, 1, 5]]);

    // A load pins 3: the next eviction passes over it.
    assert_eq!(s.prepare_load(&ks(&[3])).unwrap(), vec![2]);
    let plan = store(&mut s, &[6, 7]);
    assert_eq!(ids(plan.evicted.iter()), vec![4, 1]);
    // 4 left slot 3, then 1 left slot 0: the last freed slot is handed out first.
    assert_eq!(plan.slots, vec![0, 3]);
    assert_eq!(order(&s), vec![vec![3, 5, 6, 7]]);
    assert_eq!(
        s.take_events(),
        vec![
            stored(&[1]),
            stored(&[2]),
            stored(&[3]),
            stored(&[4]),
            removed(&[2]),
            stored(&[5]),
            removed(&[4, 1]),
            stored(&[6, 7]),
        ]
    );

    // Pin 5 and 6 too: only 7 is evictable, so two new keys cannot be stored now.
    assert_eq!(s.prepare_load(&ks(&[5, 6])).unwrap(), vec![1, 0]);
    let before = (s.stats(), s.recency_order());
    assert_eq!(s.prepare_store(&ks(&[8, 9])).unwrap(), None);
    let mut expected = before.0.clone();
    expected.store_refusals += 1;
    assert_eq!((s.stats(), s.recency_order()), (expected, before.1));
    assert_eq!(s.take_events(), vec![]);
    assert_eq!(
        s.prepare_load(&ks(&[3, 5, 6, 7])).unwrap(),
        vec![2, 1, 0, 3]
    );
    s.complete_load(&ks(&[3, 5, 6, 7, 3, 5, 6])).unwrap();
    s.check_invariants().unwrap();

    // Nothing pinned now, but five new keys never fit in four slots.
    assert_eq!(s.prepare_store(&ks(&[8, 9, 10, 11, 12])).unwrap(), None);
    assert_eq!(s.stats().store_refusals, 2);
    assert_eq!(order(&s), vec![vec![3, 5, 6, 7]]);

    // A failed store frees its slots; the next store reuses the last freed slot first.
    let plan = s.prepare_store(&ks(&[8, 9])).unwrap().unwrap();
    assert_eq!(
        (ids(plan.evicted.iter()), plan.slots),
        (vec![3, 5], vec![1, 2])
    );
    s.complete_store(&ks(&[8, 9]), false).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(
        s.lookup(&ks(&[8, 9])).unwrap(),
        vec![KeyStatus::Absent, KeyStatus::Absent]
    );
    assert_eq!(store(&mut s, &[10]).slots, vec![2]);
    assert_eq!(store(&mut s, &[11]).slots, vec![1]);
    assert_eq!(
        s.take_events(),
        vec![removed(&[3, 5]), stored(&[10]), stored(&[11])]
    );
    let st = s.stats();
    assert_eq!(
        (st.used_slots, st.ready, st.pending, st.pinned),
        (4, 4, 0, 0)
    );
    assert_eq!(
        (
            st.evictions,
            st.stores_completed,
            st.stores_failed,
            st.store_refusals
        ),
        (5, 9, 2, 2)
    );
}

#[test]
fn fresh_slots_come_before_freed_ones() {
    let mut s = Store::new(4, PolicyKind::Lru, false).unwrap();
    let plan = s.prepare_store(&ks(&[1, 2])).unwrap().unwrap();
    assert_eq!(plan.slots, vec![0, 1]);
    s.complete_store(&ks(&[1, 2]), false).unwrap();
    // Slots 0 and 1 are free again, but 2 and 3 were never handed out.
    assert_eq!(store(&mut s, &[3, 4, 5, 6]).slots, vec![2, 3, 1, 0]);
}

#[test]
fn arc_frequent_key_survives_a_scan_that_lru_does_not() {
    for (policy, survives) in [(PolicyKind::Arc, true), (PolicyKind::Lru, false)] {
        let mut s = Store::new(4, policy, false).unwrap();
        store(&mut s, &[1]);
        // The second use of 1: a lookup hit the caller touches.
        assert_eq!(s.lookup_prefix(&ks(&[1])).unwrap(), (1, false));
        s.touch(&ks(&[1]), true).unwrap();
        // A scan of once-used keys, one store at a time.
        for id in 10..30 {
            store(&mut s, &[id]);
        }
        let status = s.lookup(&ks(&[1])).unwrap()[0];
        assert_eq!(status == KeyStatus::Ready, survives, "{policy:?}");
    }
    let mut s = Store::new(4, PolicyKind::Arc, false).unwrap();
    store(&mut s, &[1]);
    s.touch(&ks(&[1]), true).unwrap();
    for id in 10..30 {
        store(&mut s, &[id]);
    }
    assert_eq!(order(&s), vec![vec![27, 28, 29], vec![1]]);
}

#[test]
fn arc_touch_during_the_store_is_not_a_second_use() {
    let mut s = Store::new(4, PolicyKind::Arc, false).unwrap();
    s.prepare_store(&ks(&[1])).unwrap().unwrap();
    s.touch(&ks(&[1]), true).unwrap();
    s.complete_store(&ks(&[1]), true).unwrap();
    assert_eq!(order(&s), vec![vec![1], vec![]]);
    for id in 10..14 {
        store(&mut s, &[id]);
    }
    assert_eq!(s.lookup(&ks(&[1])).unwrap(), vec![KeyStatus::Absent]);
}

#[test]
fn touch_makes_the_head_of_a_prefix_the_most_recent() {
    let mut s = Store::new(4, PolicyKind::Lru, false).unwrap();
    store(&mut s, &[1, 2, 3, 4]);
    assert_eq!(order(&s), vec![vec![1, 2, 3, 4]]);
    s.touch(&ks(&[1, 2, 9]), true).unwrap();
    assert_eq!(order(&s), vec![vec![3, 4, 2, 1]]);
    assert_eq!(ids(store(&mut s, &[5, 6]).evicted.iter()), vec![3, 4]);
}

#[test]
fn completing_a_store_twice_in_one_call_changes_nothing() {
    let mut s = Store::new(4, PolicyKind::Lru, true).unwrap();
    s.prepare_store(&ks(&[1, 2])).unwrap().unwrap();
    let before = (s.stats(), s.recency_order());
    let err = s.complete_store(&ks(&[1, 2, 1]), true).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidState {
                op: "complete_store",
                index: 2,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("keys[2]"), "{err}");
    assert_eq!((s.stats(), s.recency_order()), before);
    assert_eq!(s.take_events(), vec![]);
    s.check_invariants().unwrap();
    s.complete_store(&ks(&[2, 1]), true).unwrap();
    assert_eq!(s.take_events(), vec![stored(&[2, 1])]);
}

#[test]
fn reset_drops_ready_keys_now_and_busy_keys_when_released() {
    let mut s = Store::new(4, PolicyKind::Lru, true).unwrap();
    store(&mut s, &[1, 2, 3]);
    s.prepare_load(&ks(&[2])).unwrap();
    s.prepare_store(&ks(&[4])).unwrap().unwrap();
    s.take_events();

    s.reset();
    s.check_invariants().unwrap();
    // 1 and 3 are gone, 2 (pinned, announced stored) is announced removed now; 4 was never
    // announced, so it is not announced removed.
    assert_eq!(s.take_events(), vec![removed(&[1, 2, 3])]);
    assert_eq!(
        s.lookup(&ks(&[1, 2, 3, 4])).unwrap(),
        vec![KeyStatus::Absent; 4]
    );
    // Their slots stay in use until released, but they count as nothing else: they answer
    // absent.
    let st = s.stats();
    assert_eq!(
        (st.used_slots, st.ready, st.pending, st.pinned),
        (2, 0, 0, 0)
    );
    // A reset key cannot be loaded, but its load in flight still completes.
    assert!(s.prepare_load(&ks(&[2])).is_err());
    s.complete_load(&ks(&[2])).unwrap();
    s.complete_store(&ks(&[4]), true).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.take_events(), vec![]);
    let st = s.stats();
    assert_eq!(
        (st.used_slots, st.ready, st.pending, st.pinned),
        (0, 0, 0, 0)
    );
    assert_eq!(order(&s), vec![Vec::<u8>::new()]);
}

/// vLLM 0.33's LRU order: a request's keys sort by the rank it drew when it first used the
/// store, tails before heads, across all of its batches; uses without a rank (and `touch`, as
/// at a request's end) take fresh ranks.
#[test]
fn lru_ranked_walk() {
    let mut s = Store::new(8, PolicyKind::Lru, false).unwrap();
    let a = s.new_rank();
    store_ranked(&mut s, &[10, 11, 12], a, 0);
    let b = s.new_rank();
    store_ranked(&mut s, &[20, 21], b, 0);
    // a's later chunks still sort with a, older than all of b, and before a's head.
    store_ranked(&mut s, &[13, 14], a, 3);
    assert_eq!(order(&s), vec![vec![14, 13, 12, 11, 10, 21, 20]]);
    // A plain store is the newest use.
    store(&mut s, &[30]);
    assert_eq!(order(&s), vec![vec![14, 13, 12, 11, 10, 21, 20, 30]]);
    // a finishes: its prefix is refreshed, head most recent.
    s.touch(&ks(&[10, 11, 12, 13, 14]), false).unwrap();
    assert_eq!(order(&s), vec![vec![21, 20, 30, 14, 13, 12, 11, 10]]);
    // c loads b's head (position 0) and re-offers b's second chunk: both move up to c's rank,
    // newer than a's refresh; the full store evicts the oldest key for c's new chunk.
    let c = s.new_rank();
    let batch = RankedBatch {
        rank: c,
        positions: Positions::From(0),
    };
    s.prepare_load_ranked(&ks(&[20]), Some(batch)).unwrap();
    s.complete_load(&ks(&[20])).unwrap();
    let plan = store_ranked(&mut s, &[20, 21, 22], c, 0);
    assert_eq!(plan.indices, vec![2]);
    assert_eq!(ids(plan.evicted.iter()), vec![30]);
    assert_eq!(order(&s), vec![vec![14, 13, 12, 11, 10, 22, 21, 20]]);
    // A key already above a rank stays where it is (a is older than c).
    let old = RankedBatch {
        rank: a,
        positions: Positions::From(0),
    };
    s.prepare_load_ranked(&ks(&[20]), Some(old)).unwrap();
    s.complete_load(&ks(&[20])).unwrap();
    assert_eq!(order(&s), vec![vec![14, 13, 12, 11, 10, 22, 21, 20]]);
    // A refused offer still raises its ready keys: 40 cannot fit while everything is pinned.
    s.prepare_load(&ks(&[14, 13, 12, 11, 10, 22, 21, 20]))
        .unwrap();
    let e = s.new_rank();
    let refused = s
        .prepare_store_ranked(
            &ks(&[11, 40]),
            Some(RankedBatch {
                rank: e,
                positions: Positions::From(0),
            }),
            false,
        )
        .unwrap();
    assert!(refused.is_none());
    s.complete_load(&ks(&[14, 13, 12, 11, 10, 22, 21, 20]))
        .unwrap();
    assert_eq!(order(&s), vec![vec![14, 13, 12, 10, 22, 21, 20, 11]]);
    s.check_invariants().unwrap();
}

#[test]
fn lru_positions_per_key() {
    let mut s = Store::new(8, PolicyKind::Lru, false).unwrap();
    let a = s.new_rank();
    // Positions out of offer order (a backfill), and 12 without one: it takes a plain use,
    // newer than a's whole group.
    let each = [48, 16, -1, 32];
    let batch = RankedBatch {
        rank: a,
        positions: Positions::Each(&each),
    };
    store_in(&mut s, &[10, 11, 12, 13], Some(batch));
    assert_eq!(order(&s), vec![vec![10, 13, 11, 12]]);
    // A later request re-offers 11 with a position (raised) and 13 without one (left alone).
    let b = s.new_rank();
    let each = [16, -1, 64];
    let batch = RankedBatch {
        rank: b,
        positions: Positions::Each(&each),
    };
    store_in(&mut s, &[11, 13, 14], Some(batch));
    assert_eq!(order(&s), vec![vec![10, 13, 12, 14, 11]]);
    // One position per key, or the call is refused and changes nothing.
    let short = [1, 2];
    let bad = RankedBatch {
        rank: b,
        positions: Positions::Each(&short),
    };
    let err = s
        .prepare_store_ranked(&ks(&[15, 16, 17]), Some(bad), false)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "positions=<2 values for 3 keys> is invalid; allowed: one position per key"
    );
    assert!(s.prepare_load_ranked(&ks(&[10]), Some(bad)).is_err());
    assert_eq!(s.stats().pinned, 0);
    assert_eq!(order(&s), vec![vec![10, 13, 12, 14, 11]]);
    s.check_invariants().unwrap();
}

#[test]
fn lru_order_stays_small_when_a_key_keeps_failing_at_one_rank() {
    // A failed store frees the slot; the retry takes it back at the same rank: the order must
    // not keep the equal entries that leaves behind.
    let mut s = Store::new(4, PolicyKind::Lru, false).unwrap();
    let r = s.new_rank();
    let each = [16];
    let batch = RankedBatch {
        rank: r,
        positions: Positions::Each(&each),
    };
    let before = s.stats().metadata_bytes_per_slot;
    for _ in 0..10_000 {
        s.prepare_store_ranked(&ks(&[1]), Some(batch), false)
            .unwrap()
            .unwrap();
        s.complete_store(&ks(&[1]), false).unwrap();
    }
    s.check_invariants().unwrap();
    assert!(s.stats().metadata_bytes_per_slot < before + 1024.0);
}

/// An offer bigger than the whole tier stores the longest run of its new keys that fits now,
/// in offer order; without `partial` it is refused every time.
#[test]
fn partial_stores_keep_the_head_of_an_offer_that_can_never_fit() {
    let mut s = Store::new(4, PolicyKind::Lru, false).unwrap();
    store(&mut s, &[1]);
    s.prepare_load(&ks(&[1])).unwrap(); // 1 is pinned: 3 slots can be had now
    let offer = ks(&[10, 11, 12, 13, 14, 15]);
    assert!(s
        .prepare_store_ranked(&offer, None, false)
        .unwrap()
        .is_none());
    let plan = s.prepare_store_ranked(&offer, None, true).unwrap().unwrap();
    assert_eq!(plan.indices, vec![0, 1, 2]);
    assert_eq!(plan.slots, vec![1, 2, 3]);
    s.complete_store(&ks(&[10, 11, 12]), true).unwrap();
    s.check_invariants().unwrap();
    // Resident keys of the offer count against it: [11, 12] are there, so [11..15] never fits
    // whole in 4 slots; 1 is still pinned and 11, 12 are protected, so only 10 can go: one more.
    let plan = s
        .prepare_store_ranked(&ks(&[11, 12, 13, 14, 15]), None, true)
        .unwrap()
        .unwrap();
    assert_eq!(plan.indices, vec![2]);
    assert_eq!(plan.evicted.to_vecs(), ks(&[10]));
    // An offer that fits whole is all-or-nothing as before.
    s.complete_store(&ks(&[13]), true).unwrap();
    s.complete_load(&ks(&[1])).unwrap();
    let plan = s
        .prepare_store_ranked(&ks(&[20, 21]), None, true)
        .unwrap()
        .unwrap();
    assert_eq!(plan.indices, vec![0, 1]);
}

#[test]
fn a_partial_store_that_fits_nothing_now_is_refused() {
    let mut s = Store::new(2, PolicyKind::Arc, false).unwrap();
    store(&mut s, &[1, 2]);
    s.prepare_load(&ks(&[1, 2])).unwrap();
    let before = s.stats().store_refusals;
    assert!(s
        .prepare_store_ranked(&ks(&[5, 6, 7]), None, true)
        .unwrap()
        .is_none());
    assert_eq!(s.stats().store_refusals, before + 1);
    s.check_invariants().unwrap();
}

#[test]
fn a_write_hold_keeps_a_key_from_eviction_but_is_not_a_load() {
    let mut s = Store::new(2, PolicyKind::Lru, false).unwrap();
    store(&mut s, &[1, 2]);
    assert_eq!(s.hold_for_write(&ks(&[1])).unwrap(), vec![0]);
    assert_eq!(s.stats().pinned, 1);
    assert_eq!(s.first_pinned(&ks(&[1, 2])).unwrap(), 2); // no load in flight
                                                          // Only 2 can make room; 1 is held even though it is the oldest.
    let plan = store(&mut s, &[3]);
    assert_eq!(ids(plan.evicted.iter()), vec![2]);
    assert_eq!(
        s.prepare_store(&ks(&[4])).unwrap().map(|p| p.slots.len()),
        Some(1)
    );
    s.complete_store(&ks(&[4]), false).unwrap();

    // A load on top of the hold: now it is a load in flight; each ends on its own.
    s.prepare_load(&ks(&[1])).unwrap();
    assert_eq!(s.first_pinned(&ks(&[1])).unwrap(), 0);
    assert_eq!(s.stats().pinned, 1);
    s.complete_load(&ks(&[1])).unwrap();
    assert_eq!(s.first_pinned(&ks(&[1])).unwrap(), 1);
    assert!(matches!(
        s.complete_load(&ks(&[1])),
        Err(Error::InvalidState {
            op: "complete_load",
            ..
        })
    ));
    assert_eq!(s.stats().pinned, 1);
    s.release_write(&ks(&[1])).unwrap();
    assert_eq!(s.stats().pinned, 0);
    s.check_invariants().unwrap();
}

#[test]
fn write_holds_refuse_what_they_cannot_take_and_change_nothing() {
    let mut s = Store::new(4, PolicyKind::Lru, false).unwrap();
    store(&mut s, &[1, 2]);
    s.prepare_store(&ks(&[3])).unwrap().unwrap(); // 3 pending
    for (keys, state) in [
        (ks(&[1, 3]), "pending"),
        (ks(&[1, 9]), "absent"),
        (ks(&[1, 2, 1]), "listed twice"),
    ] {
        match s.hold_for_write(&keys) {
            Err(Error::InvalidState { state: got, .. }) => assert_eq!(got, state),
            other => panic!("{keys:?}: {other:?}"),
        }
        assert_eq!(s.stats().pinned, 0);
    }
    // One hold per tier of a chain, at most 15 at a time; each release ends one.
    for _ in 0..15 {
        s.hold_for_write(&ks(&[1])).unwrap();
    }
    assert!(s.hold_for_write(&ks(&[1])).is_err()); // a 16th
    assert!(s.release_write(&ks(&[2])).is_err()); // never held
    assert!(s.release_write(&ks(&[1, 1])).is_err());
    assert_eq!(s.stats().pinned, 1);
    s.prepare_load(&ks(&[1])).unwrap(); // a load pin beside 15 holds: neither spills over
    assert_eq!(s.first_pinned(&ks(&[1])).unwrap(), 0);
    s.complete_load(&ks(&[1])).unwrap();
    for left in (0..15).rev() {
        s.release_write(&ks(&[1])).unwrap();
        assert_eq!(s.stats().pinned, u64::from(left > 0));
        assert_eq!(s.first_pinned(&ks(&[1])).unwrap(), 1);
    }
    assert!(s.release_write(&ks(&[1])).is_err()); // none left
    let plan = store(&mut s, &[3, 4, 5]); // 1 and 2 evictable again
    assert_eq!(plan.evicted.len(), 1);
    s.check_invariants().unwrap();
}

#[test]
fn a_key_reset_while_held_leaves_at_its_release() {
    let mut s = Store::new(2, PolicyKind::Lru, false).unwrap();
    store(&mut s, &[1, 2]);
    s.hold_for_write(&ks(&[1])).unwrap();
    s.reset();
    assert_eq!(s.lookup(&ks(&[1, 2])).unwrap(), vec![KeyStatus::Absent; 2]);
    assert_eq!(s.stats().used_slots, 1); // 1's slot is still read by its write
    s.release_write(&ks(&[1])).unwrap();
    assert_eq!((s.stats().used_slots, s.stats().pinned), (0, 0));
    s.check_invariants().unwrap();
}

#[test]
fn slots_at_or_above_the_usable_count_are_never_handed_out() {
    let mut s = Store::new(6, PolicyKind::Lru, false)
        .unwrap()
        .with_usable_slots(0)
        .unwrap();
    // Nothing usable yet: every store is "cannot store now", nothing changes.
    assert_eq!(s.prepare_store(&ks(&[1])).unwrap(), None);
    assert_eq!(s.stats().store_refusals, 1);
    s.set_usable_slots(2).unwrap();
    assert_eq!(store(&mut s, &[1, 2]).slots, vec![0, 1]);
    // Full at 2: a third key evicts (the oldest), it does not take slot 2.
    let plan = store(&mut s, &[3]);
    assert_eq!((ids(plan.evicted.iter()), plan.slots), (vec![1], vec![0]));
    s.set_usable_slots(4).unwrap();
    assert_eq!(store(&mut s, &[4, 5]).slots, vec![2, 3]);
    assert_eq!(s.stats().usable_slots, 4);
    // A batch longer than the usable part stores what fits when partial, in order.
    let plan = s
        .prepare_store_ranked(&ks(&[6, 7, 8, 9, 10]), None, true)
        .unwrap()
        .unwrap();
    assert!(plan.slots.iter().all(|&slot| slot < 4), "{:?}", plan.slots);
    s.check_invariants().unwrap();
}

#[test]
fn the_usable_count_only_grows_up_to_the_slots() {
    let mut s = Store::new(4, PolicyKind::Arc, false)
        .unwrap()
        .with_usable_slots(1)
        .unwrap();
    for bad in [0, 5, -1] {
        assert!(matches!(
            s.set_usable_slots(bad),
            Err(Error::InvalidArgument {
                name: "usable_slots",
                ..
            })
        ));
    }
    s.set_usable_slots(4).unwrap();
    assert!(Store::new(4, PolicyKind::Lru, false)
        .unwrap()
        .with_usable_slots(5)
        .is_err());
    store(&mut s, &[1]);
    assert!(s.check_invariants().is_ok());
}

#[test]
fn lookup_and_store_in_one_pass_answers_as_the_two_calls_do() {
    // Two stores in the same state: 1 and 2 ready, 3 pending; the offer 1..5 then evicts 1 or 2.
    let mut one = Store::new(4, PolicyKind::Lru, false).unwrap();
    let mut two = Store::new(4, PolicyKind::Lru, false).unwrap();
    for s in [&mut one, &mut two] {
        store(s, &[1, 2]);
        s.prepare_store(&ks(&[3])).unwrap().unwrap();
    }
    let offer = ks(&[1, 3, 4, 5]);
    let batch = Some(RankedBatch {
        rank: 7,
        positions: Positions::From(0),
    });
    let statuses = one.lookup(&offer).unwrap();
    let plan = one.prepare_store_ranked(&offer, batch, false).unwrap();
    let (both_statuses, both_plan) = two
        .lookup_and_prepare_store_ranked(&offer, batch, false)
        .unwrap();
    assert_eq!(
        statuses,
        [
            KeyStatus::Ready,
            KeyStatus::Pending,
            KeyStatus::Absent,
            KeyStatus::Absent
        ]
    );
    assert_eq!(both_statuses, statuses);
    let (plan, both_plan) = (plan.unwrap(), both_plan.unwrap());
    assert_eq!(ids(both_plan.evicted.iter()), [2]);
    assert_eq!(
        (
            both_plan.indices,
            both_plan.slots,
            ids(both_plan.evicted.iter())
        ),
        (plan.indices, plan.slots, ids(plan.evicted.iter()))
    );
    let (a, b) = (one.stats(), two.stats());
    assert_eq!(
        (b.hits, b.misses, b.evictions),
        (a.hits, a.misses, a.evictions)
    );
    assert_eq!((b.hits, b.misses), (1, 2));
    assert_eq!(order(&one), order(&two));
    two.check_invariants().unwrap();
}
