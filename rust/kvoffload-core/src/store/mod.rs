//! The CPU-tier store: which chunk key lives in which slot of the pinned pool, and in what state.
//!
//! The slab `entries` is indexed by slot, so a key's slot is its entry's position and the hash
//! index only maps key → slot. Every call validates its whole batch before it changes anything.

mod entry;
mod invariants;
mod offers;
mod pins;
mod ranked;

pub use entry::KeyStatus;
pub use ranked::{Positions, RankedBatch};

use crate::error::{Error, Result};
use crate::events::{Event, EventKind};
use crate::index::{prefetch, Index};
use crate::key::{hash_key, validate_keys, InlineKey};
use crate::keybuf::KeyBuf;
use crate::policy::{Policy, PolicyKind};
use entry::{Entry, State, DOOMED};

/// The main index is at most this full (linear probing stays short below ~0.8).
const INDEX_LOAD: f64 = 0.7;

/// Largest pool the store addresses: the key index holds at most 2^32 buckets.
pub const MAX_SLOTS: u32 = 1 << 31;

/// The answer of a successful `prepare_store`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorePlan {
    /// Positions in the offered batch of the keys to write, in offer order.
    pub indices: Vec<u32>,
    /// The slot each of those keys is written to.
    pub slots: Vec<u32>,
    /// Keys evicted to make room, oldest first.
    pub evicted: KeyBuf,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub num_slots: u64,
    /// Slots that may be handed out now (see `Store::set_usable_slots`); `num_slots` unless the
    /// pool behind them is still being prepared.
    pub usable_slots: u64,
    pub used_slots: u64,
    pub ready: u64,
    pub pending: u64,
    /// Keys with at least one load in flight.
    pub pinned: u64,
    /// Keys found ready by `lookup`/`lookup_prefix`.
    pub hits: u64,
    /// Keys found absent by `lookup`, or the absent key that ended a `lookup_prefix`.
    pub misses: u64,
    pub evictions: u64,
    /// `prepare_store` calls answered "cannot store now".
    pub store_refusals: u64,
    pub stores_completed: u64,
    pub stores_failed: u64,
    /// Bytes of index metadata (entries, hash table, ghost lists) per slot handed out so far
    /// (metadata grows with use), key copies included.
    pub metadata_bytes_per_slot: f64,
    /// ARC's adaptive target size for its recency list (0 under LRU).
    pub arc_target_t1: f64,
}

/// Metadata grows with use: `entries` holds the slots handed out so far (the rest were never
/// used), and the index grows with the keys it holds, so a huge pool costs nothing until filled.
pub struct Store {
    num_slots: u32,
    /// Slots below this may be handed out; it only grows, up to `num_slots`.
    usable: u32,
    entries: Vec<Entry>,
    index: Index,
    policy: Policy,
    /// Freed slots, reused last-freed-first. Its capacity always covers `entries`, so freeing
    /// never allocates.
    free: Vec<u32>,
    events: Option<Vec<Event>>,
    stats: Stats,
}

impl Store {
    pub fn new(num_slots: i64, policy: PolicyKind, enable_events: bool) -> Result<Self> {
        if num_slots < 1 || num_slots > i64::from(MAX_SLOTS) {
            return Err(Error::InvalidArgument {
                name: "num_slots",
                value: num_slots.to_string(),
                allowed: "an integer in 1..=2147483648",
            });
        }
        let n = num_slots as u32;
        Ok(Store {
            num_slots: n,
            usable: n,
            entries: Vec::new(),
            index: Index::new(n as usize, INDEX_LOAD),
            policy: Policy::new(policy, n),
            free: Vec::new(),
            events: enable_events.then(Vec::new),
            stats: Stats {
                num_slots: n.into(),
                usable_slots: n.into(),
                ..Stats::default()
            },
        })
    }

    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// A store whose slots from `usable` up are not ready yet (their memory is still being
    /// pinned): none of them is handed out until `set_usable_slots` says so. For a new store.
    pub fn with_usable_slots(mut self, usable: i64) -> Result<Self> {
        if self.used_high_mark() > 0 || !(0..=i64::from(self.num_slots)).contains(&usable) {
            return Err(Error::InvalidArgument {
                name: "usable_slots",
                value: usable.to_string(),
                allowed: "an integer in 0..=num_slots, on a store that handed out no slot",
            });
        }
        self.usable = usable as u32;
        self.stats.usable_slots = self.usable.into();
        Ok(self)
    }

    /// Raises the slots that may be handed out to `usable` (it never shrinks: a slot in use
    /// stays in use).
    pub fn set_usable_slots(&mut self, usable: i64) -> Result<()> {
        if !(i64::from(self.usable)..=i64::from(self.num_slots)).contains(&usable) {
            return Err(Error::InvalidArgument {
                name: "usable_slots",
                value: usable.to_string(),
                allowed: "an integer from the current usable slots up to num_slots",
            });
        }
        self.usable = usable as u32;
        self.stats.usable_slots = self.usable.into();
        Ok(())
    }

    pub fn usable_slots(&self) -> u32 {
        self.usable
    }

    /// Slots handed out so far.
    fn used_high_mark(&self) -> u32 {
        self.entries.len() as u32
    }

    /// Room for `keys` more keys in every structure that grows with use, before a call changes
    /// anything; an error naming the size when memory refuses.
    fn reserve(&mut self, keys: usize) -> Result<()> {
        let fresh = keys.min((self.usable - self.used_high_mark()) as usize);
        let oom = |what: &'static str, items: usize, size: usize| Error::OutOfMemory {
            what,
            bytes: items.saturating_mul(size),
        };
        let slots = self.entries.len() + fresh;
        let entry = core::mem::size_of::<Entry>();
        grow(&mut self.entries, slots, self.num_slots as usize)
            .map_err(|_| oom("slot entries", slots, entry))?;
        grow(&mut self.free, slots, self.num_slots as usize)
            .map_err(|_| oom("the free-slot list", slots, 4))?;
        let indexed = keys.min(self.num_slots as usize - self.index.len());
        if !self.index.reserve(indexed) {
            return Err(oom("the key index", self.index.len() + indexed, 8));
        }
        if !self.policy.reserve(keys) {
            return Err(oom("the eviction order", keys, 16));
        }
        Ok(())
    }

    pub fn policy(&self) -> PolicyKind {
        self.policy.kind()
    }

    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// The slot holding `key`, one probe at a time (batch calls use `scan`).
    fn find_key(&self, key: &[u8]) -> Option<u32> {
        let entries = &self.entries;
        self.index
            .find(hash_key(key), |s| entries[s as usize].key.as_slice() == key)
    }

    /// Finds each key's slot in order and calls `visit(i, hash, slot)` until it returns false.
    /// Lookups are memory-bound, so while key `i` is compared, the index bucket of key
    /// `i + 2*AHEAD` is prefetched and the first candidate entry of key `i + AHEAD` is picked
    /// from its (by then cached) bucket and prefetched; key `i` then only confirms its candidate.
    #[inline]
    fn scan<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        mut visit: impl FnMut(usize, u64, Option<u32>) -> bool,
    ) {
        const AHEAD: usize = 8;
        const RING: usize = 4 * AHEAD;
        const NONE: u32 = u32::MAX;
        let n = keys.len();
        let entries = &self.entries;
        let mut hashes = [0u64; RING];
        let mut candidates = [NONE; RING];
        let hash_ahead = |hashes: &mut [u64; RING], j: usize| {
            hashes[j % RING] = hash_key(keys[j].as_ref());
            self.index.prefetch(hashes[j % RING]);
        };
        let entry_ahead = |candidates: &mut [u32; RING], hashes: &[u64; RING], j: usize| {
            let c = self.index.peek(hashes[j % RING]).unwrap_or(NONE);
            candidates[j % RING] = c;
            if c != NONE {
                let e = &entries[c as usize];
                prefetch(e);
                prefetch(&e.next);
            }
        };
        for j in 0..n.min(2 * AHEAD) {
            hash_ahead(&mut hashes, j);
        }
        for j in 0..n.min(AHEAD) {
            entry_ahead(&mut candidates, &hashes, j);
        }
        for i in 0..n {
            if i + 2 * AHEAD < n {
                hash_ahead(&mut hashes, i + 2 * AHEAD);
            }
            if i + AHEAD < n {
                entry_ahead(&mut candidates, &hashes, i + AHEAD);
            }
            let (hash, candidate) = (hashes[i % RING], candidates[i % RING]);
            let probe = InlineKey::new(keys[i].as_ref());
            let slot = match candidate {
                // No bucket with this tag: absent.
                NONE => None,
                c if entries[c as usize].key == probe => Some(c),
                // The first tag match was another key: search the whole probe run.
                _ => self.index.find(hash, |s| entries[s as usize].key == probe),
            };
            if !visit(i, hash, slot) {
                return;
            }
        }
    }

    #[inline]
    fn status_at(&self, slot: Option<u32>) -> KeyStatus {
        slot.map_or(KeyStatus::Absent, |s| self.entries[s as usize].status())
    }

    fn free_slots(&self) -> usize {
        (self.usable - self.used_high_mark()) as usize + self.free.len()
    }

    fn evictable(entries: &[Entry], slot: u32) -> bool {
        let e = &entries[slot as usize];
        e.state == State::Ready && e.pins == 0 && e.flags == 0
    }

    fn emit(&mut self, kind: EventKind, keys: KeyBuf) {
        if let Some(events) = &mut self.events {
            if !keys.is_empty() {
                events.push(Event { kind, keys });
            }
        }
    }

    /// Takes the slot out of the policy, the index and the counters, and frees it. Returns the key.
    fn release_slot(&mut self, slot: u32) -> InlineKey {
        self.policy.remove(&mut self.entries, slot);
        let hash = hash_key(self.entries[slot as usize].key.as_slice());
        self.unindex_and_free(slot, hash)
    }

    /// The part of freeing a slot (its key hashing to `hash`) after the policy has let go of it.
    fn unindex_and_free(&mut self, slot: u32, hash: u64) -> InlineKey {
        let entry = self.entries[slot as usize];
        let removed = self.index.remove(hash, slot);
        assert!(removed, "live slot {slot} is indexed");
        // A key dropped by `reset` left the counters then.
        match entry.state {
            _ if !entry.live() => {}
            State::Pending => self.stats.pending -= 1,
            State::Ready => self.stats.ready -= 1,
            State::Free => unreachable!("freed a free slot"),
        }
        self.entries[slot as usize] = Entry::FREE;
        self.free.push(slot);
        entry.key
    }

    /// Looks every key up and checks `ok` on its entry before anything changes.
    fn resolve<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        op: &'static str,
        needed: &'static str,
        ok: impl Fn(&Entry) -> bool,
    ) -> Result<Vec<u32>> {
        validate_keys(keys)?;
        let mut slots = Vec::with_capacity(keys.len());
        let mut bad = None;
        self.scan(keys, |index, _, slot| match slot {
            Some(s) if ok(&self.entries[s as usize]) => {
                slots.push(s);
                true
            }
            _ => {
                bad = Some((index, slot));
                false
            }
        });
        if let Some((index, slot)) = bad {
            let state = slot.map_or("absent", |s| self.entries[s as usize].state_name());
            let key = keys[index].as_ref().to_vec();
            return Err(Error::InvalidState {
                op,
                index,
                key,
                state,
                needed,
            });
        }
        Ok(slots)
    }

    /// Number of leading keys that are ready, and whether the first key that is not is pending.
    pub fn lookup_prefix<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<(usize, bool)> {
        validate_keys(keys)?;
        let (mut hits, mut stop) = (0, KeyStatus::Ready);
        self.scan(keys, |_, _, slot| {
            stop = self.status_at(slot);
            hits += usize::from(stop == KeyStatus::Ready);
            stop == KeyStatus::Ready
        });
        self.stats.hits += hits as u64;
        self.stats.misses += u64::from(stop == KeyStatus::Absent);
        Ok((hits, stop == KeyStatus::Pending))
    }

    /// The status of every key.
    pub fn lookup<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<KeyStatus>> {
        validate_keys(keys)?;
        let mut out = Vec::with_capacity(keys.len());
        self.scan(keys, |_, _, slot| {
            out.push(self.status_at(slot));
            true
        });
        for s in &out {
            match s {
                KeyStatus::Ready => self.stats.hits += 1,
                KeyStatus::Absent => self.stats.misses += 1,
                KeyStatus::Pending => {}
            }
        }
        Ok(out)
    }

    /// Marks keys as just used, so that the earlier keys of `keys` end up the most recent: a
    /// prefix's head outlives its tail. Keys that are not resident are ignored. `reuse` says the
    /// keys were used again (a load hit): ARC then promotes the ready ones to its frequent list;
    /// without it, keys only move to the recent end of the list they are in (e.g. a request
    /// refreshing the prefix order of the chunks it stored).
    pub fn touch<K: AsRef<[u8]>>(&mut self, keys: &[K], reuse: bool) -> Result<()> {
        validate_keys(keys)?;
        let mut slots = Vec::with_capacity(keys.len());
        self.scan(keys, |_, _, slot| {
            slots.extend(slot);
            true
        });
        for &slot in slots.iter().rev() {
            let e = &self.entries[slot as usize];
            if e.live() {
                let promote = reuse && e.state == State::Ready;
                self.policy.touch(&mut self.entries, slot, promote);
            }
        }
        Ok(())
    }

    /// Drops every ready, unpinned key now (one "removed" event); pending and pinned keys answer
    /// as absent from now on, leave the counters, and are dropped when their store or last load
    /// completes.
    pub fn reset(&mut self) {
        let mut removed = KeyBuf::new();
        for slot in 0..self.used_high_mark() {
            let e = self.entries[slot as usize];
            if e.state == State::Free || !e.live() {
                continue;
            }
            if e.state == State::Ready && e.pins == 0 {
                self.release_slot(slot);
                removed.push_unchecked(e.key.as_slice());
                continue;
            }
            match e.state {
                // Announced as stored, so announced as removed now: lookups miss it from now on.
                State::Ready => {
                    removed.push_unchecked(e.key.as_slice());
                    self.stats.ready -= 1;
                }
                _ => self.stats.pending -= 1,
            }
            self.stats.pinned -= u64::from(e.pins > 0);
            self.entries[slot as usize].flags |= DOOMED;
        }
        self.policy.forget_history();
        self.emit(EventKind::Removed, removed);
    }

    /// Drains the events recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<Event> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn stats(&self) -> Stats {
        let mut stats = self.stats.clone();
        stats.used_slots = u64::from(self.used_high_mark()) - self.free.len() as u64;
        stats.metadata_bytes_per_slot =
            self.metadata_bytes() as f64 / f64::from(self.used_high_mark().max(1));
        stats.arc_target_t1 = self.policy.target_t1();
        stats
    }

    fn metadata_bytes(&self) -> usize {
        self.entries.capacity() * core::mem::size_of::<Entry>()
            + self.index.heap_bytes()
            + self.free.capacity() * 4
            + self.policy.heap_bytes()
    }

    /// Keys from least to most recently used, per policy list (T1 then T2 under ARC).
    pub fn recency_order(&self) -> Vec<Vec<Vec<u8>>> {
        (0..self.policy.num_lists())
            .map(|l| {
                self.policy
                    .list_members(&self.entries, l)
                    .into_iter()
                    .map(|s| self.entries[s as usize].key.as_slice().to_vec())
                    .collect()
            })
            .collect()
    }
}

/// Makes `v`'s capacity at least `want`, doubling but never past `limit` (the pool's slots), so
/// a full store holds no spare capacity.
fn grow<T>(v: &mut Vec<T>, want: usize, limit: usize) -> core::result::Result<(), ()> {
    if want <= v.capacity() {
        return Ok(());
    }
    let target = want.max(2 * v.capacity()).min(limit).max(want);
    v.try_reserve_exact(target - v.len()).map_err(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_pool_costs_nothing_until_used() {
        let mut s = Store::new(i64::from(MAX_SLOTS), PolicyKind::Arc, false).unwrap();
        assert!(s.metadata_bytes() < 1 << 20, "{} bytes", s.metadata_bytes());
        let keys: Vec<[u8; 4]> = (0..10_000u32).map(u32::to_le_bytes).collect();
        let plan = s.prepare_store(&keys).unwrap().unwrap();
        assert_eq!(plan.slots, (0..10_000).collect::<Vec<u32>>());
        s.check_invariants().unwrap();
        assert!(Store::new(i64::from(MAX_SLOTS) + 1, PolicyKind::Lru, false).is_err());
    }

    #[test]
    fn the_refusal_of_a_larger_pool_names_max_slots() {
        // The message is a literal (`Error` holds `&'static str`): this keeps it MAX_SLOTS.
        let err = Store::new(i64::from(MAX_SLOTS) + 1, PolicyKind::Lru, false).err();
        let message = err.expect("refused").to_string();
        assert!(message.ends_with(&format!("1..={MAX_SLOTS}")), "{message}");
    }
}
