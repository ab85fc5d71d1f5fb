//! Model-based test of the store: random operation sequences run against `Store` and against a
//! plain reference model side by side; after every step the two must agree and every invariant
//! of SPEC.md section 3 must hold.
//!
//! Under LRU the model predicts everything exactly (victims, slots, recency order, events,
//! counters). Under ARC it predicts everything but the choice of victims, which it checks for
//! validity instead (right number, each one ready, unpinned and not offered in the same call).

use kvoffload_core::{
    Error, Event, EventKind, KeyBuf, KeyStatus, PolicyKind, Stats, Store, StorePlan, MAX_KEY_LEN,
};
use proptest::prelude::*;
use proptest::sample::Index;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Keys are ids `0..UNIVERSE`; key `id` is `id` repeated, with lengths spread over 1..=64.
const UNIVERSE: u8 = 12;

fn key(id: u8) -> Vec<u8> {
    vec![id; 1 + (usize::from(id) * 29) % 64]
}

fn keys(ids: &[u8]) -> Vec<Vec<u8>> {
    ids.iter().map(|&id| key(id)).collect()
}

fn id_of(key: &[u8]) -> u8 {
    let id = key[0];
    assert_eq!(
        key,
        &self::key(id)[..],
        "store returned a key it was never given"
    );
    id
}

fn ids_of<K: AsRef<[u8]>>(keys: impl IntoIterator<Item = K>) -> Vec<u8> {
    keys.into_iter().map(|k| id_of(k.as_ref())).collect()
}

#[derive(Debug, Clone)]
enum Op {
    /// Offer these keys (may repeat, may already be present).
    Prepare(Vec<u8>),
    /// Complete the stores of the pending keys picked by `mask`/`rot`, plus maybe one `extra`
    /// key at some position (a repeat or a key that is not pending: an error).
    Complete {
        mask: u16,
        rot: Index,
        extra: Option<(Index, u8)>,
        success: bool,
    },
    LookupPrefix(Vec<u8>),
    Lookup(Vec<u8>),
    /// Load ready keys picked as above (an `extra` repeat pins twice; a non-ready one errors).
    Load {
        mask: u16,
        rot: Index,
        extra: Option<(Index, u8)>,
    },
    /// Unpin pinned keys picked as above.
    Unload {
        mask: u16,
        rot: Index,
        extra: Option<(Index, u8)>,
    },
    Touch(Vec<u8>, bool),
    Reset,
    /// Call operation `op` with an empty or over-long key at `at`: must fail, change nothing.
    BadKey {
        op: u8,
        ids: Vec<u8>,
        at: Index,
        long: bool,
    },
}

fn some_ids(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0..UNIVERSE, 0..=max)
}

fn extra() -> impl Strategy<Value = Option<(Index, u8)>> {
    prop::option::weighted(0.25, (any::<Index>(), 0..UNIVERSE))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => some_ids(6).prop_map(Op::Prepare),
        4 => (any::<u16>(), any::<Index>(), extra(), prop::bool::weighted(0.8)).prop_map(
            |(mask, rot, extra, success)| Op::Complete { mask, rot, extra, success }
        ),
        2 => some_ids(6).prop_map(Op::LookupPrefix),
        1 => some_ids(6).prop_map(Op::Lookup),
        3 => (any::<u16>(), any::<Index>(), extra())
            .prop_map(|(mask, rot, extra)| Op::Load { mask, rot, extra }),
        3 => (any::<u16>(), any::<Index>(), extra())
            .prop_map(|(mask, rot, extra)| Op::Unload { mask, rot, extra }),
        2 => (some_ids(6), any::<bool>()).prop_map(|(ids, reuse)| Op::Touch(ids, reuse)),
        1 => Just(Op::Reset),
        1 => (0u8..7, some_ids(4), any::<Index>(), any::<bool>())
            .prop_map(|(op, ids, at, long)| Op::BadKey { op, ids, at, long }),
    ]
}

/// The candidates whose bit is set in `mask`, rotated by `rot`, with `extra` inserted.
fn pick(cands: &[u8], mask: u16, rot: Index, extra: Option<(Index, u8)>) -> Vec<u8> {
    let mut v: Vec<u8> = cands
        .iter()
        .copied()
        .filter(|&k| mask & (1 << k) != 0)
        .collect();
    if !v.is_empty() {
        let r = rot.index(v.len());
        v.rotate_left(r);
    }
    if let Some((at, k)) = extra {
        let p = at.index(v.len() + 1);
        v.insert(p, k);
    }
    v
}

#[derive(Debug, Clone, PartialEq)]
struct MEntry {
    slot: u32,
    ready: bool,
    pins: u32,
    /// Dropped by `reset` while pending or pinned: answers absent, leaves when released.
    doomed: bool,
}

/// The reference model: a map from key to entry plus, for LRU, one recency list.
#[derive(Debug, Clone)]
struct Model {
    n: u32,
    lru: bool,
    entries: BTreeMap<u8, MEntry>,
    /// Every resident key (pending, doomed included), least recent first. Under ARC: the set
    /// of resident keys in no particular order.
    order: Vec<u8>,
    /// ARC only: keys known to be in T2 (touched while ready, and resident since).
    known_t2: BTreeSet<u8>,
    next_fresh: u32,
    free: Vec<u32>,
    hits: u64,
    misses: u64,
    evictions: u64,
    refusals: u64,
    completed: u64,
    failed: u64,
}

struct MPlan {
    indices: Vec<u32>,
    slots: Vec<u32>,
    evicted: Vec<u8>,
}

impl Model {
    fn new(n: u32, lru: bool) -> Self {
        Model {
            n,
            lru,
            entries: BTreeMap::new(),
            order: Vec::new(),
            known_t2: BTreeSet::new(),
            next_fresh: 0,
            free: Vec::new(),
            hits: 0,
            misses: 0,
            evictions: 0,
            refusals: 0,
            completed: 0,
            failed: 0,
        }
    }

    fn status(&self, k: u8) -> KeyStatus {
        match self.entries.get(&k) {
            None => KeyStatus::Absent,
            Some(e) if e.doomed => KeyStatus::Absent,
            Some(e) if e.ready => KeyStatus::Ready,
            Some(_) => KeyStatus::Pending,
        }
    }

    fn evictable(&self, k: u8) -> bool {
        let e = &self.entries[&k];
        e.ready && e.pins == 0 && !e.doomed
    }

    /// Removes a key and frees its slot.
    fn release(&mut self, k: u8) {
        let e = self.entries.remove(&k).expect("released key is resident");
        self.order.retain(|&x| x != k);
        self.known_t2.remove(&k);
        self.free.push(e.slot);
    }

    /// The store's counters as the model predicts them; the metadata size and ARC's adaptive
    /// target come from the store.
    fn expected_stats(&self, measured: &Stats) -> Stats {
        let count = |f: &dyn Fn(&MEntry) -> bool| self.entries.values().filter(|e| f(e)).count();
        Stats {
            num_slots: self.n.into(),
            usable_slots: self.n.into(),
            used_slots: self.entries.len() as u64,
            // Keys dropped by `reset` but still pending or pinned count nowhere.
            ready: count(&|e| e.ready && !e.doomed) as u64,
            pending: count(&|e| !e.ready && !e.doomed) as u64,
            pinned: count(&|e| e.pins > 0 && !e.doomed) as u64,
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
            store_refusals: self.refusals,
            stores_completed: self.completed,
            stores_failed: self.failed,
            metadata_bytes_per_slot: measured.metadata_bytes_per_slot,
            arc_target_t1: if self.lru {
                0.0
            } else {
                measured.arc_target_t1
            },
        }
    }

    /// `store_evicted`: under ARC, the victims the store chose (checked here, then applied).
    fn prepare(&mut self, ids: &[u8], store_evicted: Option<&[Vec<u8>]>) -> Option<MPlan> {
        let mut new = Vec::new();
        let mut indices = Vec::new();
        let offered: BTreeSet<u8> = ids.iter().copied().collect();
        for (i, &k) in ids.iter().enumerate() {
            if self.entries.contains_key(&k) || new.contains(&k) {
                continue;
            }
            new.push(k);
            indices.push(i as u32);
        }
        let free = (self.n - self.next_fresh) as usize + self.free.len();
        let need = new.len().saturating_sub(free);
        let candidates: Vec<u8> = self
            .order
            .iter()
            .copied()
            .filter(|&k| self.evictable(k) && !offered.contains(&k))
            .collect();
        // A key dropped by reset but not yet released blocks the whole offer.
        let blocked = ids
            .iter()
            .any(|k| self.entries.get(k).is_some_and(|e| e.doomed));
        if blocked || candidates.len() < need {
            self.refusals += 1;
            return None;
        }
        let victims: Vec<u8> = match (self.lru, store_evicted) {
            (false, Some(evicted)) => {
                let victims = ids_of(evicted);
                assert_eq!(victims.len(), need, "ARC evicted the wrong number of keys");
                let distinct: BTreeSet<u8> = victims.iter().copied().collect();
                assert_eq!(distinct.len(), victims.len(), "a key evicted twice");
                for v in &victims {
                    assert!(
                        candidates.contains(v),
                        "ARC evicted key {v}, which is pending, pinned, reset or offered"
                    );
                }
                victims
            }
            _ => candidates[..need].to_vec(),
        };
        for &v in &victims {
            self.release(v);
            self.evictions += 1;
        }
        let mut slots = Vec::new();
        for &k in &new {
            let slot = if self.next_fresh < self.n {
                self.next_fresh += 1;
                self.next_fresh - 1
            } else {
                self.free.pop().expect("room was made")
            };
            self.entries.insert(
                k,
                MEntry {
                    slot,
                    ready: false,
                    pins: 0,
                    doomed: false,
                },
            );
            self.order.push(k);
            slots.push(slot);
        }
        Some(MPlan {
            indices,
            slots,
            evicted: victims,
        })
    }

    /// Ok(keys that became ready) or Err(index of the offending key).
    fn complete(&mut self, ids: &[u8], success: bool) -> Result<Vec<u8>, usize> {
        for (i, k) in ids.iter().enumerate() {
            match self.entries.get(k) {
                Some(e) if !e.ready => {}
                _ => return Err(i),
            }
        }
        let mut seen = BTreeSet::new();
        for (i, &k) in ids.iter().enumerate() {
            if !seen.insert(k) {
                return Err(i);
            }
        }
        let mut stored = Vec::new();
        for &k in ids {
            let e = self.entries.get_mut(&k).unwrap();
            if success && !e.doomed {
                e.ready = true;
                self.completed += 1;
                stored.push(k);
            } else {
                if !success {
                    self.failed += 1;
                }
                self.release(k);
            }
        }
        Ok(stored)
    }

    fn lookup_prefix(&mut self, ids: &[u8]) -> (usize, bool) {
        for (i, &k) in ids.iter().enumerate() {
            match self.status(k) {
                KeyStatus::Ready => {}
                s => {
                    self.hits += i as u64;
                    self.misses += u64::from(s == KeyStatus::Absent);
                    return (i, s == KeyStatus::Pending);
                }
            }
        }
        self.hits += ids.len() as u64;
        (ids.len(), false)
    }

    fn lookup(&mut self, ids: &[u8]) -> Vec<KeyStatus> {
        let out: Vec<KeyStatus> = ids.iter().map(|&k| self.status(k)).collect();
        for s in &out {
            match s {
                KeyStatus::Ready => self.hits += 1,
                KeyStatus::Absent => self.misses += 1,
                KeyStatus::Pending => {}
            }
        }
        out
    }

    fn load(&mut self, ids: &[u8]) -> Result<Vec<u32>, usize> {
        for (i, &k) in ids.iter().enumerate() {
            if self.status(k) != KeyStatus::Ready {
                return Err(i);
            }
        }
        Ok(ids
            .iter()
            .map(|k| {
                let e = self.entries.get_mut(k).unwrap();
                e.pins += 1;
                e.slot
            })
            .collect())
    }

    fn unload(&mut self, ids: &[u8]) -> Result<(), usize> {
        for (i, k) in ids.iter().enumerate() {
            if !matches!(self.entries.get(k), Some(e) if e.pins > 0) {
                return Err(i);
            }
        }
        let mut listed: HashMap<u8, u32> = HashMap::new();
        for (i, k) in ids.iter().enumerate() {
            let c = listed.entry(*k).or_default();
            *c += 1;
            if *c > self.entries[k].pins {
                return Err(i);
            }
        }
        let mut gone = Vec::new();
        for k in ids {
            let e = self.entries.get_mut(k).unwrap();
            e.pins -= 1;
            if e.pins == 0 && e.doomed {
                gone.push(*k);
            }
        }
        for k in gone {
            self.release(k);
        }
        Ok(())
    }

    /// Returns the keys moved, in the order of their last move (the last one is the most recent).
    fn touch(&mut self, ids: &[u8], reuse: bool) -> Vec<u8> {
        let mut moved: Vec<u8> = Vec::new();
        for &k in ids.iter().rev() {
            if self.entries.get(&k).is_some_and(|e| !e.doomed) {
                self.order.retain(|&x| x != k);
                self.order.push(k);
                moved.retain(|&x| x != k);
                moved.push(k);
                if reuse && self.entries[&k].ready {
                    self.known_t2.insert(k);
                }
            }
        }
        moved
    }

    /// The keys announced removed, in slot order.
    fn reset(&mut self) -> Vec<u8> {
        let mut by_slot: Vec<(u32, u8)> = self.entries.iter().map(|(&k, e)| (e.slot, k)).collect();
        by_slot.sort_unstable();
        let mut removed = Vec::new();
        for (_, k) in by_slot {
            let e = self.entries.get_mut(&k).unwrap();
            if e.ready && e.pins == 0 {
                self.release(k);
                removed.push(k);
            } else {
                if e.ready && !e.doomed {
                    removed.push(k);
                }
                e.doomed = true;
            }
        }
        removed
    }
}

/// An independent check of the event stream: a key is announced stored only when it was not
/// announced already and into a slot no announced key holds; removed only when announced.
#[derive(Default)]
struct EventLog {
    /// Announced key → its slot.
    announced: BTreeMap<u8, u32>,
}

impl EventLog {
    fn apply(&mut self, events: &[Event], model: &Model) {
        for ev in events {
            assert!(!ev.keys.is_empty(), "empty event batch");
            for k in ids_of(ev.keys.iter()) {
                match ev.kind {
                    EventKind::Removed => {
                        assert!(
                            self.announced.remove(&k).is_some(),
                            "key {k} announced removed but never announced stored"
                        );
                    }
                    EventKind::Stored => {
                        let slot = model.entries[&k].slot;
                        assert!(
                            !self.announced.contains_key(&k),
                            "key {k} announced stored twice"
                        );
                        assert!(
                            !self.announced.values().any(|&s| s == slot),
                            "key {k} stored in slot {slot} before its previous key was removed"
                        );
                        self.announced.insert(k, slot);
                    }
                }
            }
        }
    }
}

fn event(kind: EventKind, ids: &[u8]) -> Vec<Event> {
    if ids.is_empty() {
        Vec::new()
    } else {
        vec![Event {
            kind,
            keys: KeyBuf::from_keys(&keys(ids)).unwrap(),
        }]
    }
}

/// What a refused or failed call must leave as it was (reserved memory may grow).
fn snapshot(store: &Store) -> (Stats, Vec<Vec<Vec<u8>>>) {
    let stats = Stats {
        metadata_bytes_per_slot: 0.0,
        ..store.stats()
    };
    (stats, store.recency_order())
}

fn assert_unchanged(store: &Store, before: &(Stats, Vec<Vec<Vec<u8>>>), what: &str) {
    assert_eq!(&snapshot(store), before, "{what} changed the store");
}

fn expect_state_error(got: Error, op: &str, index: usize) {
    match got {
        Error::InvalidState {
            op: o, index: i, ..
        } => {
            assert_eq!((o, i), (op, index), "wrong error: {got}");
        }
        other => panic!("{op}: expected InvalidState at {index}, got {other:?}"),
    }
}

fn resident_by_slot_order(model: &Model) -> Vec<u8> {
    let mut v: Vec<(u32, u8)> = model.entries.iter().map(|(&k, e)| (e.slot, k)).collect();
    v.sort_unstable();
    v.into_iter().map(|(_, k)| k).collect()
}

fn run(policy: PolicyKind, n: u32, events_on: bool, ops: &[Op]) {
    let lru = policy == PolicyKind::Lru;
    let mut store = Store::new(i64::from(n), policy, events_on).unwrap();
    let mut model = Model::new(n, lru);
    let mut log = EventLog::default();
    let all: Vec<u8> = (0..UNIVERSE).collect();

    for op in ops {
        let before = snapshot(&store);
        let mut expected_events: Vec<Event> = Vec::new();
        let mut touched: Option<(Vec<u8>, bool)> = None;
        match op {
            Op::Prepare(ids) => {
                let got = store.prepare_store(&keys(ids)).expect("valid keys");
                let store_evicted = got.as_ref().map(|p| p.evicted.to_vecs());
                let want = model.prepare(ids, store_evicted.as_deref());
                match (got, want) {
                    (None, None) => {
                        let mut after = before.clone();
                        after.0.store_refusals += 1;
                        assert_unchanged(&store, &after, "a refused prepare_store");
                    }
                    (
                        Some(StorePlan {
                            indices,
                            slots,
                            evicted,
                        }),
                        Some(w),
                    ) => {
                        assert_eq!(indices, w.indices, "keys to write");
                        assert_eq!(slots, w.slots, "slots handed out");
                        assert_eq!(ids_of(evicted.iter()), w.evicted, "victims");
                        expected_events = event(EventKind::Removed, &w.evicted);
                    }
                    (got, want) => panic!(
                        "prepare_store({ids:?}): store answered {:?}, model expected {}",
                        got.map(|p| p.slots),
                        if want.is_some() {
                            "a plan"
                        } else {
                            "cannot store now"
                        }
                    ),
                }
            }
            Op::Complete {
                mask,
                rot,
                extra,
                success,
            } => {
                let pending: Vec<u8> = resident_by_slot_order(&model)
                    .into_iter()
                    .filter(|k| !model.entries[k].ready)
                    .collect();
                let ids = pick(&pending, *mask, *rot, *extra);
                let got = store.complete_store(&keys(&ids), *success);
                match (got, model.complete(&ids, *success)) {
                    (Ok(()), Ok(stored)) => {
                        expected_events = event(EventKind::Stored, &stored);
                    }
                    (Err(e), Err(i)) => {
                        expect_state_error(e, "complete_store", i);
                        assert_unchanged(&store, &before, "a failed complete_store");
                    }
                    (got, want) => {
                        panic!("complete_store({ids:?}, {success}): {got:?} vs model {want:?}")
                    }
                }
            }
            Op::LookupPrefix(ids) => {
                let got = store.lookup_prefix(&keys(ids)).unwrap();
                assert_eq!(got, model.lookup_prefix(ids), "lookup_prefix({ids:?})");
            }
            Op::Lookup(ids) => {
                let got = store.lookup(&keys(ids)).unwrap();
                assert_eq!(got, model.lookup(ids), "lookup({ids:?})");
            }
            Op::Load { mask, rot, extra } => {
                let ready: Vec<u8> = all
                    .iter()
                    .copied()
                    .filter(|&k| model.status(k) == KeyStatus::Ready)
                    .collect();
                let ids = pick(&ready, *mask, *rot, *extra);
                match (store.prepare_load(&keys(&ids)), model.load(&ids)) {
                    (Ok(slots), Ok(want)) => assert_eq!(slots, want, "slots of a load"),
                    (Err(e), Err(i)) => {
                        expect_state_error(e, "prepare_load", i);
                        assert_unchanged(&store, &before, "a failed prepare_load");
                    }
                    (got, want) => panic!("prepare_load({ids:?}): {got:?} vs model {want:?}"),
                }
            }
            Op::Unload { mask, rot, extra } => {
                let pinned: Vec<u8> = all
                    .iter()
                    .copied()
                    .filter(|k| model.entries.get(k).is_some_and(|e| e.pins > 0))
                    .collect();
                let ids = pick(&pinned, *mask, *rot, *extra);
                match (store.complete_load(&keys(&ids)), model.unload(&ids)) {
                    (Ok(()), Ok(())) => {}
                    (Err(e), Err(i)) => {
                        expect_state_error(e, "complete_load", i);
                        assert_unchanged(&store, &before, "a failed complete_load");
                    }
                    (got, want) => panic!("complete_load({ids:?}): {got:?} vs model {want:?}"),
                }
            }
            Op::Touch(ids, reuse) => {
                store.touch(&keys(ids), *reuse).unwrap();
                touched = Some((model.touch(ids, *reuse), *reuse));
            }
            Op::Reset => {
                store.reset();
                let removed = model.reset();
                expected_events = event(EventKind::Removed, &removed);
            }
            Op::BadKey { op, ids, at, long } => {
                let mut ks = keys(ids);
                let at = at.index(ks.len() + 1);
                let bad_len = if *long { 65 } else { 0 };
                ks.insert(at, vec![7; bad_len]);
                let err = match op {
                    0 => store.prepare_store(&ks).map(|_| ()),
                    1 => store.complete_store(&ks, true),
                    2 => store.lookup_prefix(&ks).map(|_| ()),
                    3 => store.lookup(&ks).map(|_| ()),
                    4 => store.prepare_load(&ks).map(|_| ()),
                    5 => store.complete_load(&ks),
                    _ => store.touch(&ks, true),
                }
                .expect_err("a bad key must be refused");
                assert_eq!(
                    err,
                    Error::InvalidKeyLength {
                        index: at,
                        len: bad_len,
                        max: MAX_KEY_LEN
                    }
                );
                assert_unchanged(&store, &before, "a call with a bad key");
            }
        }

        // Every invariant, after every step.
        store.check_invariants().unwrap();
        let events = store.take_events();
        if events_on {
            assert_eq!(events, expected_events, "events of {op:?}");
            log.apply(&events, &model);
        } else {
            assert!(events.is_empty(), "events recorded while disabled");
        }

        let slots: BTreeSet<u32> = model.entries.values().map(|e| e.slot).collect();
        assert_eq!(slots.len(), model.entries.len(), "a slot used twice");
        assert!(slots.iter().all(|&s| s < n), "slot out of range");
        assert!(model.entries.len() <= n as usize, "more keys than slots");

        let stats = store.stats();
        assert!(stats.metadata_bytes_per_slot > 0.0);
        assert_eq!(stats, model.expected_stats(&stats), "after {op:?}");

        // Every key's answer (a lookup counts, so the model counts it too).
        assert_eq!(store.lookup(&keys(&all)).unwrap(), model.lookup(&all));

        // Announced keys are exactly the ready ones.
        if events_on {
            let ready: BTreeSet<u8> = all
                .iter()
                .copied()
                .filter(|&k| model.status(k) == KeyStatus::Ready)
                .collect();
            let announced: BTreeSet<u8> = log.announced.keys().copied().collect();
            assert_eq!(announced, ready, "announced keys vs ready keys");
        }

        let order = store.recency_order();
        if lru {
            assert_eq!(order.len(), 1);
            assert_eq!(ids_of(&order[0]), model.order, "LRU order after {op:?}");
        } else {
            assert_eq!(order.len(), 2);
            let t1 = ids_of(&order[0]);
            let t2 = ids_of(&order[1]);
            let mut both: Vec<u8> = t1.iter().chain(&t2).copied().collect();
            both.sort_unstable();
            let resident: Vec<u8> = model.entries.keys().copied().collect();
            assert_eq!(both, resident, "T1 + T2 hold each resident key once");
            for k in &model.known_t2 {
                assert!(t2.contains(k), "key {k} touched while ready is not in T2");
            }
            if let Some((moved, reuse)) = touched {
                // Each list ends with the keys just moved into it, in the order of their moves.
                for list in [&t1, &t2] {
                    let mine: Vec<u8> =
                        moved.iter().copied().filter(|k| list.contains(k)).collect();
                    assert!(
                        list.ends_with(&mine),
                        "touch order: list {list:?} should end with {mine:?}"
                    );
                }
                let t2_before = ids_of(&before.1[1]);
                for k in &moved {
                    if reuse && model.entries[k].ready {
                        assert!(t2.contains(k), "touched ready key {k} not promoted to T2");
                    } else {
                        // Seen again during its own store, or only reordered: not a second use,
                        // so no promotion.
                        assert_eq!(
                            t2.contains(k),
                            t2_before.contains(k),
                            "touching key {k} without a reuse moved it between T1 and T2"
                        );
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn lru_store_matches_the_model(
        n in 1u32..=8,
        events_on in prop::bool::weighted(0.8),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(PolicyKind::Lru, n, events_on, &ops);
    }

    #[test]
    fn arc_store_matches_the_model(
        n in 1u32..=8,
        events_on in prop::bool::weighted(0.8),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(PolicyKind::Arc, n, events_on, &ops);
    }
}
