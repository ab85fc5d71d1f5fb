//! A hybrid model's one-call store and load of a request (`Store::offer_group_store`,
//! `group_load` with `Store::pin_group_load`), step by step with the keys, slots, blocks and
//! counters each step must produce, the undo paths included.

use kvoffload_core::{
    group_load, offer_batch, Error, GroupBatch, GroupLoadAsk, GroupOffer, GroupStoreOffer, KeyBuf,
    KeyStatus, LoadedGroup, PolicyKind, Store,
};

/// Chunk `c` of group `g` has the key `[g, c]`.
fn keys(group: u8, n: u8) -> KeyBuf {
    let keys: Vec<Vec<u8>> = (0..n).map(|c| vec![group, c]).collect();
    KeyBuf::from_keys(&keys).unwrap()
}

fn key_list(pairs: &[(u8, u8)]) -> Vec<Vec<u8>> {
    pairs.iter().map(|&(g, c)| vec![g, c]).collect()
}

const FULL_TABLE: [u64; 4] = [10, 11, 12, 13];
/// A window group's table: the engine freed its blocks of chunks 0 and 1.
const WINDOW_TABLE: [u64; 4] = [0, 0, 22, 23];

/// The offer of a full group (0) and a window group (1), four chunks each, one block a chunk.
fn two_group_batch(full: &KeyBuf, window: &KeyBuf) -> GroupBatch {
    let offers = [
        GroupOffer {
            group: 0,
            keys: full,
            table: &FULL_TABLE,
            first_chunk: 0,
            reach: None,
        },
        GroupOffer {
            group: 1,
            keys: window,
            table: &WINDOW_TABLE,
            first_chunk: 0,
            reach: None,
        },
    ];
    offer_batch(&offers, 1, 2).unwrap()
}

fn offer<'a>(
    batch: &'a GroupBatch,
    tables: &'a [(u64, &'a [u64])],
    windowed: &'a [bool],
    rank: u64,
) -> GroupStoreOffer<'a> {
    GroupStoreOffer {
        batch,
        tables,
        windowed,
        blocks_per_chunk: 1,
        rank,
    }
}

#[test]
fn a_group_store_plans_each_key_with_its_blocks() {
    let mut s = Store::new(8, PolicyKind::Lru, false).unwrap();
    let (full, window) = (keys(0, 4), keys(1, 4));
    let batch = two_group_batch(&full, &window);
    assert_eq!(batch.chunks, [0, 1, 2, 3, 2, 3]);
    let tables: [(u64, &[u64]); 2] = [(0, &FULL_TABLE), (0, &WINDOW_TABLE)];
    let rank = s.new_rank();
    let got = s
        .offer_group_store(&offer(&batch, &tables, &[false, true], rank))
        .unwrap();
    assert_eq!(got.used, [vec![0, 1, 2, 3], vec![2, 3]]);
    let plan = got.plan.expect("room for every key");
    let want = key_list(&[(0, 0), (0, 1), (0, 2), (0, 3), (1, 2), (1, 3)]);
    assert_eq!(plan.keys.to_vecs(), want);
    assert_eq!(plan.slots, [0, 1, 2, 3, 4, 5]);
    assert_eq!(plan.chunks, [0, 1, 2, 3, 2, 3]);
    assert_eq!(plan.blocks.blocks, [10, 11, 12, 13, 22, 23]);
    assert_eq!(plan.blocks.counts, [4, 2]);
    assert_eq!(plan.blocks.window_blocks, [22, 23]);
    assert_eq!((s.stats().misses, s.stats().pending), (6, 6));

    // Offered again while another job writes them: no use of them, nothing new to write.
    let again = s
        .offer_group_store(&offer(&batch, &tables, &[false, true], rank))
        .unwrap();
    assert_eq!(again.used, [Vec::<u64>::new(), vec![]]);
    assert!(again.plan.expect("nothing to refuse").keys.is_empty());

    s.complete_store(&plan.keys.to_vecs(), true).unwrap();
    let stored = s
        .offer_group_store(&offer(&batch, &tables, &[false, true], rank))
        .unwrap();
    assert_eq!(stored.used, got.used);
    assert!(stored.plan.unwrap().slots.is_empty());
    assert_eq!((s.stats().hits, s.stats().ready), (6, 6));
    s.check_invariants().unwrap();
}

#[test]
fn a_refused_group_store_is_still_a_use_of_its_ready_chunks() {
    let mut s = Store::new(2, PolicyKind::Lru, false).unwrap();
    let full = keys(0, 3);
    let head = key_list(&[(0, 0), (0, 1)]);
    s.prepare_store(&head).unwrap().unwrap();
    s.complete_store(&head, true).unwrap();
    let table = [10, 11, 12];
    let batch = offer_batch(
        &[GroupOffer {
            group: 0,
            keys: &full,
            table: &table,
            first_chunk: 0,
            reach: None,
        }],
        1,
        1,
    )
    .unwrap();
    let tables: [(u64, &[u64]); 1] = [(0, &table)];
    let rank = s.new_rank();
    // Chunk 2 needs a slot, and the only ready keys are the offer's own: refused.
    let got = s
        .offer_group_store(&offer(&batch, &tables, &[false], rank))
        .unwrap();
    assert_eq!(got.used, [vec![0, 1, 2]]);
    assert_eq!(got.plan, None);
    assert_eq!((s.stats().store_refusals, s.stats().ready), (1, 2));
    s.check_invariants().unwrap();
}

#[test]
fn a_group_store_whose_blocks_cannot_be_named_is_undone() {
    let mut s = Store::new(8, PolicyKind::Lru, false).unwrap();
    let (full, window) = (keys(0, 4), keys(1, 4));
    let batch = two_group_batch(&full, &window);
    // The full group's table stops after chunk 1: chunks 2 and 3 have no blocks to read.
    let short: [(u64, &[u64]); 2] = [(0, &FULL_TABLE[..2]), (0, &WINDOW_TABLE)];
    let rank = s.new_rank();
    let err = s
        .offer_group_store(&offer(&batch, &short, &[false, true], rank))
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { name: "tables", .. }),
        "{err}"
    );
    let st = s.stats();
    assert_eq!((st.pending, st.used_slots, st.stores_failed), (0, 0, 6));
    assert_eq!(st.misses, 6, "the lookup before the plan still counts");
    s.check_invariants().unwrap();
    let statuses = s.lookup(&batch.keys.to_vecs()).unwrap();
    assert!(statuses.iter().all(|&k| k == KeyStatus::Absent));

    // With whole tables the offer goes through; fresh slots come before the freed ones.
    let tables: [(u64, &[u64]); 2] = [(0, &FULL_TABLE), (0, &WINDOW_TABLE)];
    let plan = s
        .offer_group_store(&offer(&batch, &tables, &[false, true], rank))
        .unwrap()
        .plan
        .unwrap();
    assert_eq!(plan.slots, [6, 7, 5, 4, 3, 2]);
}

#[test]
fn a_withdrawn_group_store_frees_its_slots() {
    let mut s = Store::new(8, PolicyKind::Lru, false).unwrap();
    let (full, window) = (keys(0, 4), keys(1, 4));
    let batch = two_group_batch(&full, &window);
    let tables: [(u64, &[u64]); 2] = [(0, &FULL_TABLE), (0, &WINDOW_TABLE)];
    let rank = s.new_rank();
    let plan = s
        .offer_group_store(&offer(&batch, &tables, &[false, true], rank))
        .unwrap()
        .plan
        .unwrap();
    s.withdraw_group_store(&plan).unwrap();
    let st = s.stats();
    assert_eq!((st.pending, st.used_slots, st.stores_failed), (0, 0, 6));
    s.check_invariants().unwrap();
    // Withdrawn twice: the keys are no longer pending, so nothing changes.
    let err = s.withdraw_group_store(&plan).unwrap_err();
    assert!(matches!(err, Error::InvalidState { index: 0, .. }), "{err}");
}

#[test]
fn a_batch_with_a_group_past_the_tables_changes_nothing() {
    let mut s = Store::new(8, PolicyKind::Lru, false).unwrap();
    let (full, window) = (keys(0, 4), keys(1, 4));
    let batch = two_group_batch(&full, &window);
    let tables: [(u64, &[u64]); 1] = [(0, &FULL_TABLE)];
    let rank = s.new_rank();
    let err = s
        .offer_group_store(&offer(&batch, &tables, &[false], rank))
        .unwrap_err();
    assert!(err.to_string().contains("group 1 for 1 tables"), "{err}");
    assert_eq!((s.stats().misses, s.stats().used_slots), (0, 0));
}

/// A store with group 0's (sliding) chunks 2 and 3 and group 1's (full) chunks 0..4 ready, in
/// slots 0, 1 and 2..6.
fn loadable(policy: PolicyKind) -> (Store, KeyBuf, KeyBuf) {
    let mut s = Store::new(16, policy, false).unwrap();
    let (sliding, full) = (keys(0, 4), keys(1, 4));
    let ready = key_list(&[(0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]);
    s.prepare_store(&ready).unwrap().unwrap();
    s.complete_store(&ready, true).unwrap();
    (s, sliding, full)
}

/// Blocks 2..8 of the two groups' tables, two blocks a chunk: the sliding group holds only its
/// window, from block 5; the full group loads past a 2-block local prefix.
const SLIDING_BLOCKS: [u64; 6] = [0, 0, 0, 15, 16, 17];
const FULL_BLOCKS: [u64; 6] = [3, 4, 5, 6, 7, 8];

fn ask<'a>(keys: &'a [&'a KeyBuf], blocks: &'a [&'a [u64]]) -> GroupLoadAsk<'a> {
    GroupLoadAsk {
        keys,
        blocks,
        first_block: 2,
        num_blocks: 8,
        end_chunk: 4,
        blocks_per_chunk: 2,
    }
}

#[test]
fn a_group_load_starts_each_group_at_its_first_live_block() {
    let (mut s, sliding, full) = loadable(PolicyKind::Lru);
    let load = group_load(&ask(&[&sliding, &full], &[&SLIDING_BLOCKS, &FULL_BLOCKS])).unwrap();
    assert_eq!(
        load.parts,
        [
            LoadedGroup {
                group: 0,
                chunks: 2..4,
                num_blocks: 3,
                skip_leading_blocks: 1
            },
            LoadedGroup {
                group: 1,
                chunks: 1..4,
                num_blocks: 6,
                skip_leading_blocks: 0
            },
        ]
    );
    let slots: Vec<u64> = load.parts.iter().map(LoadedGroup::num_slots).collect();
    assert_eq!(slots, [2, 3]);
    assert_eq!(load.gpu_blocks, [15, 16, 17, 3, 4, 5, 6, 7, 8]);
    let want = key_list(&[(0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]);
    assert_eq!(load.batch.keys.to_vecs(), want);
    assert_eq!(load.batch.positions, [5, 7, 2, 4, 6]);

    let rank = s.new_rank();
    assert_eq!(
        s.pin_group_load(&load, rank, false).unwrap(),
        [0, 1, 3, 4, 5]
    );
    assert_eq!(s.stats().pinned, 5);
    assert_eq!(s.first_pinned(&key_list(&[(1, 0), (1, 1)])).unwrap(), 1);
    s.unpin_group_load(&load).unwrap();
    assert_eq!(s.stats().pinned, 0);
    s.check_invariants().unwrap();
}

#[test]
fn a_touched_group_load_is_used_again() {
    let (mut s, sliding, full) = loadable(PolicyKind::Arc);
    let load = group_load(&ask(&[&sliding, &full], &[&SLIDING_BLOCKS, &FULL_BLOCKS])).unwrap();
    let rank = s.new_rank();
    s.pin_group_load(&load, rank, true).unwrap();
    // ARC's frequent list, least recent first: the head of the batch is the most recent.
    let frequent = key_list(&[(1, 3), (1, 2), (1, 1), (0, 3), (0, 2)]);
    assert_eq!(s.recency_order()[1], frequent);
    assert_eq!(s.recency_order()[0], key_list(&[(1, 0)]));
    s.unpin_group_load(&load).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn a_group_load_that_cannot_run_pins_nothing() {
    let (mut s, sliding, full) = loadable(PolicyKind::Lru);
    // Group 0's chunk 1 is not stored: a window from block 3 needs it.
    let early: [u64; 6] = [0, 14, 15, 16, 17, 18];
    let load = group_load(&ask(&[&sliding, &full], &[&early, &FULL_BLOCKS])).unwrap();
    assert_eq!(load.parts[0].chunks, 1..4);
    let rank = s.new_rank();
    let err = s.pin_group_load(&load, rank, false).unwrap_err();
    assert!(matches!(err, Error::InvalidState { index: 0, .. }), "{err}");
    assert_eq!(s.stats().pinned, 0);

    let hole: [u64; 6] = [0, 0, 0, 15, 0, 17];
    let err = group_load(&ask(&[&sliding, &full], &[&hole, &FULL_BLOCKS])).unwrap_err();
    assert!(
        err.to_string().contains("null block (0) at block 6"),
        "{err}"
    );
    let short: [u64; 5] = [3, 4, 5, 6, 7];
    let err = group_load(&ask(&[&sliding, &full], &[&SLIDING_BLOCKS, &short])).unwrap_err();
    assert!(err.to_string().contains("<5 for group 1>"), "{err}");
    let err = group_load(&ask(&[&sliding], &[&SLIDING_BLOCKS, &FULL_BLOCKS])).unwrap_err();
    assert!(err.to_string().contains("1 key lists, 2 tables"), "{err}");
    let lists: [&KeyBuf; 2] = [&sliding, &full];
    let blocks: [&[u64]; 2] = [&SLIDING_BLOCKS, &FULL_BLOCKS];
    for (end_chunk, blocks_per_chunk) in [(3, 2), (0, 0)] {
        let bad = GroupLoadAsk {
            end_chunk,
            blocks_per_chunk,
            ..ask(&lists, &blocks)
        };
        let err = group_load(&bad).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { name: "load", .. }),
            "{err}"
        );
    }
}
