//! The CPU-tier store: which chunk key lives in which slot of the pinned pool, and in what state.
//!
//! The slab `entries` is indexed by slot, so a key's slot is its entry's position and the hash
//! index only maps key → slot. Every call validates its whole batch before it changes anything.

use crate::error::{Error, Result};
use crate::events::{Event, EventKind};
use crate::index::{prefetch, Index};
use crate::key::{hash_key, validate_keys, InlineKey, MAX_KEY_LEN};
use crate::keybuf::KeyBuf;
use crate::list::{Linked, NIL};
use crate::policy::{Policy, PolicyKind, PolicyNode, Rank, NO_LIST};

/// The main index is at most this full (linear probing stays short below ~0.8).
const INDEX_LOAD: f64 = 0.7;

/// Largest pool the store addresses: the key index holds at most 2^32 buckets.
pub const MAX_SLOTS: u32 = 1 << 31;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum KeyStatus {
    Absent = 0,
    Pending = 1,
    Ready = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Pending,
    Ready,
}

/// Set by `reset` on a key that cannot go yet (pending or pinned): it answers as absent and is
/// dropped when released.
const DOOMED: u8 = 1;
/// Set during one `prepare_store` on ready keys of that call, so they are not evicted for it.
const PROTECTED: u8 = 2;
/// Set for the length of one call on the keys it lists, to find a key listed twice.
const LISTED: u8 = 4;

/// The top bit of `pins`: a write to the shared tier reads the slot. It keeps the key from
/// eviction as a load pin does, but it is not a load (`first_pinned` does not see it).
const WRITE_HOLD: u32 = 1 << 31;
/// The load pins, below `WRITE_HOLD`.
const LOAD_PINS: u32 = WRITE_HOLD - 1;

#[derive(Clone, Copy)]
struct Entry {
    key: InlineKey,
    state: State,
    flags: u8,
    list: u8,
    pins: u32,
    prev: u32,
    next: u32,
}

impl Entry {
    const FREE: Entry = Entry {
        key: InlineKey::EMPTY,
        state: State::Free,
        flags: 0,
        list: NO_LIST,
        pins: 0,
        prev: NIL,
        next: NIL,
    };

    fn live(&self) -> bool {
        self.flags & DOOMED == 0
    }

    fn status(&self) -> KeyStatus {
        match self.state {
            _ if !self.live() => KeyStatus::Absent,
            State::Free => KeyStatus::Absent,
            State::Pending => KeyStatus::Pending,
            State::Ready => KeyStatus::Ready,
        }
    }

    fn state_name(&self) -> &'static str {
        match (self.state, self.live(), self.pins) {
            (State::Free, _, _) => "absent",
            (_, false, _) => "absent (reset)",
            (State::Pending, _, _) => "pending",
            (State::Ready, _, 0) => "ready",
            (State::Ready, _, _) => "ready and pinned",
        }
    }
}

impl Linked for Entry {
    fn prev(&self) -> u32 {
        self.prev
    }
    fn next(&self) -> u32 {
        self.next
    }
    fn set_prev(&mut self, v: u32) {
        self.prev = v;
    }
    fn set_next(&mut self, v: u32) {
        self.next = v;
    }
}

impl PolicyNode for Entry {
    fn list(&self) -> u8 {
        self.list
    }
    fn set_list(&mut self, list: u8) {
        self.list = list;
    }
    // LRU keeps no links: the rank takes their 8 bytes.
    fn rank(&self) -> Rank {
        Rank::from_bits((u64::from(self.prev) << 32) | u64::from(self.next))
    }
    fn set_rank(&mut self, rank: Rank) {
        let bits = rank.to_bits();
        self.prev = (bits >> 32) as u32;
        self.next = bits as u32;
    }
}

/// Where one call's keys belong in LRU order: they are used by the request of `rank` (from
/// `Store::new_rank`), each at its position in that request. Ignored under ARC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankedBatch<'a> {
    pub rank: u64,
    pub positions: Positions<'a>,
}

/// The positions of a call's keys in their request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Positions<'a> {
    /// Key `j` is at `first + j`.
    From(i64),
    /// Key `j` is at `each[j]` (one per key); a negative value means the key has no position: a
    /// new key then takes a plain use of its own, and a resident one is left where it is.
    Each(&'a [i64]),
}

impl RankedBatch<'_> {
    fn rank_at(batch: Option<RankedBatch<'_>>, j: usize) -> Option<Rank> {
        let b = batch?;
        let position = match b.positions {
            Positions::From(first) => first.saturating_add(j as i64),
            Positions::Each(each) => each[j],
        };
        (position >= 0).then(|| Rank::at(b.rank, position))
    }

    fn check(batch: Option<RankedBatch<'_>>, num_keys: usize) -> Result<()> {
        match batch.map(|b| b.positions) {
            Some(Positions::Each(each)) if each.len() != num_keys => Err(Error::InvalidArgument {
                name: "positions",
                value: format!("<{} values for {num_keys} keys>", each.len()),
                allowed: "one position per key",
            }),
            _ => Ok(()),
        }
    }
}

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

    /// Reserves slots for the keys that are neither pending nor ready, evicting unpinned ready
    /// keys by the policy if the free slots do not suffice. `Ok(None)` means "cannot store now":
    /// the store is unchanged (only the refusal counter moves).
    pub fn prepare_store<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Option<StorePlan>> {
        self.prepare_store_ranked(keys, None, false)
    }

    /// A new request rank: its keys (stored or loaded with it) sort as one group, tails first,
    /// older than every rank or use after it (see `RankedBatch`).
    pub fn new_rank(&mut self) -> u64 {
        self.policy.new_rank()
    }

    /// `prepare_store` by a request: new keys take their place in `batch`; ready keys of the
    /// offer move up to theirs if they sort below it, even when the offer is refused (as in
    /// vLLM, where the offer is a use of them).
    ///
    /// With `partial`, an offer that could never fit whole (its new keys and its resident ones
    /// together outnumber the slots) stores the longest run of its new keys, in offer order,
    /// that fits now: the head of a prefix is what later lookups can hit. The plan then lists
    /// only those keys. Without it, such an offer is refused every time (vLLM's behaviour).
    pub fn prepare_store_ranked<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        batch: Option<RankedBatch<'_>>,
        partial: bool,
    ) -> Result<Option<StorePlan>> {
        self.prepare_store_scanned(keys, batch, partial, None)
    }

    /// `lookup` then `prepare_store_ranked` of the same keys, each hashed and found once: every
    /// key's status before the store (counted as `lookup` counts it), and the plan.
    pub fn lookup_and_prepare_store_ranked<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        batch: Option<RankedBatch<'_>>,
        partial: bool,
    ) -> Result<(Vec<KeyStatus>, Option<StorePlan>)> {
        let mut statuses = Vec::new();
        let plan = self.prepare_store_scanned(keys, batch, partial, Some(&mut statuses))?;
        Ok((statuses, plan))
    }

    fn prepare_store_scanned<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        batch: Option<RankedBatch<'_>>,
        partial: bool,
        mut statuses: Option<&mut Vec<KeyStatus>>,
    ) -> Result<Option<StorePlan>> {
        validate_keys(keys)?;
        RankedBatch::check(batch, keys.len())?;
        let oom = |what| Error::OutOfMemory {
            what,
            bytes: keys.len().saturating_mul(32),
        };
        let mut found: Vec<(u64, Option<u32>)> = Vec::new();
        found
            .try_reserve_exact(keys.len())
            .map_err(|_| oom("the batch's lookups"))?;
        if let Some(out) = statuses.as_deref_mut() {
            out.try_reserve_exact(keys.len())
                .map_err(|_| oom("the batch's statuses"))?;
        }
        self.scan(keys, |_, hash, slot| {
            found.push((hash, slot));
            if let Some(out) = statuses.as_deref_mut() {
                out.push(self.status_at(slot));
            }
            true
        });
        for status in statuses.as_deref().map_or(&[][..], Vec::as_slice) {
            match status {
                KeyStatus::Ready => self.stats.hits += 1,
                KeyStatus::Absent => self.stats.misses += 1,
                KeyStatus::Pending => {}
            }
        }
        // First pass, changing nothing: the new keys (each once), the resident ones.
        let mut new: Vec<(u32, u64)> = Vec::new();
        new.try_reserve_exact(keys.len())
            .map_err(|_| oom("the batch's new keys"))?;
        let mut seen =
            Index::try_with_capacity(keys.len(), 0.5).ok_or_else(|| oom("the batch's index"))?;
        let mut resident: Vec<(usize, u32)> = Vec::new();
        let mut blocked_by_reset = false;
        for (i, &(hash, slot)) in found.iter().enumerate() {
            if let Some(slot) = slot {
                // Dropped by `reset` but still pending or pinned: it answers absent, yet cannot be
                // stored again until released. Refusing keeps the caller's frontier before it.
                blocked_by_reset |= !self.entries[slot as usize].live();
                resident.push((i, slot));
                continue;
            }
            let key = keys[i].as_ref();
            if seen
                .find(hash, |j| keys[j as usize].as_ref() == key)
                .is_none()
            {
                seen.insert(hash, i as u32);
                new.push((i as u32, hash));
            }
        }
        self.reserve(new.len())?;
        // Ready keys of the offer are protected from its evictions, and moved up to its rank.
        let mut protected: Vec<u32> = Vec::new();
        let mut protected_unpinned = 0u64;
        for &(i, slot) in &resident {
            let e = &mut self.entries[slot as usize];
            if e.state == State::Ready && e.flags == 0 {
                e.flags |= PROTECTED;
                protected.push(slot);
                protected_unpinned += u64::from(e.pins == 0);
                if let Some(rank) = RankedBatch::rank_at(batch, i) {
                    self.policy.raise(&mut self.entries, slot, rank);
                }
            }
        }
        let mut nothing_fits = false;
        // Counted only for a partial offer: the all-or-nothing path never needs it.
        let live_resident = || {
            resident
                .iter()
                .filter(|&&(_, s)| self.entries[s as usize].live())
                .count()
        };
        if partial && new.len() + live_resident() > self.usable as usize {
            // Room now: the free slots and every unpinned ready key not offered here.
            let evictable = self.stats.ready - self.stats.pinned - protected_unpinned;
            new.truncate(self.free_slots() + evictable as usize);
            // Not even the first key fits now (all pinned or pending): ask again later.
            nothing_fits = new.is_empty();
        }
        let need = new.len().saturating_sub(self.free_slots());
        let fingerprints: Vec<u64> = new.iter().map(|&(_, hash)| hash).collect();
        let victims = if blocked_by_reset || nothing_fits {
            None
        } else {
            let entries = &self.entries;
            let replace = self.policy.ghost_outcome(&fingerprints);
            self.policy
                .select_victims(entries, need, replace, |s| Self::evictable(entries, s))
        };
        for &slot in &protected {
            self.entries[slot as usize].flags &= !PROTECTED;
        }
        let Some(victims) = victims else {
            self.stats.store_refusals += 1;
            return Ok(None);
        };

        // Ghost hits count before the evictions add ghosts, so a call never trims its own
        // keys' ghosts.
        let ghost_hits = self.policy.take_ghosts(&fingerprints);
        let mut evicted = KeyBuf::with_capacity(victims.len(), MAX_KEY_LEN);
        for (j, &slot) in victims.iter().enumerate() {
            if let Some(&ahead) = victims.get(j + 4) {
                prefetch(&self.entries[ahead as usize]);
            }
            let hash = hash_key(self.entries[slot as usize].key.as_slice());
            self.policy.evict(&mut self.entries, slot, hash);
            let key = self.unindex_and_free(slot, hash);
            evicted.push_unchecked(key.as_slice());
        }
        self.stats.evictions += evicted.len() as u64;

        let mut plan = StorePlan {
            indices: Vec::with_capacity(new.len()),
            slots: Vec::with_capacity(new.len()),
            evicted,
        };
        for (j, &(i, hash)) in new.iter().enumerate() {
            let entry = Entry {
                key: InlineKey::new(keys[i as usize].as_ref()),
                state: State::Pending,
                ..Entry::FREE
            };
            // Fresh slots first (in increasing order), then freed ones; `reserve` made room.
            let slot = if self.used_high_mark() < self.usable {
                self.entries.push(entry);
                self.used_high_mark() - 1
            } else {
                let slot = self.free.pop().expect("room was made for every new key");
                self.entries[slot as usize] = entry;
                slot
            };
            self.index.insert(hash, slot);
            let rank = RankedBatch::rank_at(batch, i as usize);
            self.policy
                .insert(&mut self.entries, slot, ghost_hits[j], rank);
            self.stats.pending += 1;
            plan.indices.push(i);
            plan.slots.push(slot);
        }
        self.policy.trim_ghosts();
        if self.events.is_some() {
            self.emit(EventKind::Removed, plan.evicted.clone());
        }
        Ok(Some(plan))
    }

    /// Finishes stores: on success the keys become ready (one "stored" event), on failure they
    /// are removed and their slots freed with no event. Every key must be pending.
    pub fn complete_store<K: AsRef<[u8]>>(&mut self, keys: &[K], success: bool) -> Result<()> {
        let slots = self.resolve(keys, "complete_store", "pending", |e| {
            e.state == State::Pending
        })?;
        // A key listed twice is no longer pending at its second listing: refuse the whole call
        // rather than complete it twice.
        if let Some(index) = self.first_repeat(&slots) {
            return Err(Error::InvalidState {
                op: "complete_store",
                index,
                key: keys[index].as_ref().to_vec(),
                state: "listed twice",
                needed: "pending and listed once",
            });
        }
        let mut stored = KeyBuf::new();
        for slot in slots {
            let e = &mut self.entries[slot as usize];
            if success && e.live() {
                e.state = State::Ready;
                self.stats.pending -= 1;
                self.stats.ready += 1;
                self.stats.stores_completed += 1;
                if self.events.is_some() {
                    stored.push_unchecked(e.key.as_slice());
                }
            } else {
                if !success {
                    self.stats.stores_failed += 1;
                }
                self.release_slot(slot);
            }
        }
        self.emit(EventKind::Stored, stored);
        Ok(())
    }

    /// The position of the first slot of `slots` that repeats an earlier one. Leaves no mark.
    fn first_repeat(&mut self, slots: &[u32]) -> Option<usize> {
        let mut repeat = None;
        let mut marked = 0;
        for (i, &slot) in slots.iter().enumerate() {
            let e = &mut self.entries[slot as usize];
            if e.flags & LISTED != 0 {
                repeat = Some(i);
                break;
            }
            e.flags |= LISTED;
            marked = i + 1;
        }
        for &slot in &slots[..marked] {
            self.entries[slot as usize].flags &= !LISTED;
        }
        repeat
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

    /// The position of the first key with a load in flight (pinned by `prepare_load`, not only
    /// held for a write, and not dropped by `reset`), or `keys.len()` when none is.
    pub fn first_pinned<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<usize> {
        validate_keys(keys)?;
        let mut at = 0;
        self.scan(keys, |_, _, slot| {
            let pinned = slot.is_some_and(|s| {
                let e = &self.entries[s as usize];
                e.pins & LOAD_PINS > 0 && e.live()
            });
            at += usize::from(!pinned);
            !pinned
        });
        Ok(at)
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

    /// Pins every key for a load and returns its slot. Every key must be ready; a key listed
    /// twice is pinned twice.
    pub fn prepare_load<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<u32>> {
        self.prepare_load_ranked(keys, None)
    }

    /// `prepare_load` by a request: each key moves up to its place in `batch` if it sorts below.
    pub fn prepare_load_ranked<K: AsRef<[u8]>>(
        &mut self,
        keys: &[K],
        batch: Option<RankedBatch<'_>>,
    ) -> Result<Vec<u32>> {
        RankedBatch::check(batch, keys.len())?;
        let slots = self.resolve(keys, "prepare_load", "ready", |e| {
            e.state == State::Ready && e.live()
        })?;
        for (j, &slot) in slots.iter().enumerate() {
            if let Some(rank) = RankedBatch::rank_at(batch, j) {
                self.policy.raise(&mut self.entries, slot, rank);
            }
        }
        for &slot in &slots {
            let e = &mut self.entries[slot as usize];
            e.pins += 1;
            if e.pins == 1 {
                self.stats.pinned += 1;
            }
        }
        Ok(slots)
    }

    /// Unpins each key once. Every key must be pinned as often as it is listed. A key dropped
    /// by `reset` while pinned leaves the store at its last unpin.
    pub fn complete_load<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<()> {
        let slots = self.resolve(keys, "complete_load", "pinned", |e| e.pins & LOAD_PINS > 0)?;
        let mut doomed = Vec::new();
        for (done, &slot) in slots.iter().enumerate() {
            if self.entries[slot as usize].pins & LOAD_PINS == 0 {
                self.undo_unpins(&slots[..done]);
                let key = keys[done].as_ref().to_vec();
                return Err(Error::InvalidState {
                    op: "complete_load",
                    index: done,
                    key,
                    state: "listed more often than it is pinned",
                    needed: "pinned once per listing",
                });
            }
            let e = &mut self.entries[slot as usize];
            e.pins -= 1;
            if e.pins == 0 {
                if e.live() {
                    self.stats.pinned -= 1;
                } else {
                    doomed.push(slot);
                }
            }
        }
        for slot in doomed {
            self.release_slot(slot);
        }
        Ok(())
    }

    /// Holds each key's slot while a write to the shared tier reads it: not evictable, as if
    /// pinned, yet not a load in flight (`first_pinned`). Every key must be ready and not held
    /// already, and listed once. Returns the slots.
    pub fn hold_for_write<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<u32>> {
        let needed = "ready and not held for a write";
        let slots = self.resolve(keys, "hold_for_write", needed, |e| {
            e.state == State::Ready && e.live() && e.pins & WRITE_HOLD == 0
        })?;
        Self::refuse_repeats(keys, &slots, "hold_for_write")?;
        for &slot in &slots {
            let e = &mut self.entries[slot as usize];
            if e.pins == 0 {
                self.stats.pinned += 1;
            }
            e.pins |= WRITE_HOLD;
        }
        Ok(slots)
    }

    /// Ends the write holds of `keys` (each held, listed once). A key dropped by `reset`
    /// meanwhile leaves the store once nothing pins it.
    pub fn release_write<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<()> {
        let needed = "held for a write";
        let slots = self.resolve(keys, "release_write", needed, |e| e.pins & WRITE_HOLD != 0)?;
        Self::refuse_repeats(keys, &slots, "release_write")?;
        for &slot in &slots {
            let e = &mut self.entries[slot as usize];
            e.pins &= !WRITE_HOLD;
            if e.pins == 0 {
                if e.live() {
                    self.stats.pinned -= 1;
                } else {
                    self.release_slot(slot);
                }
            }
        }
        Ok(())
    }

    fn refuse_repeats<K: AsRef<[u8]>>(keys: &[K], slots: &[u32], op: &'static str) -> Result<()> {
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        let Some(twice) = sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0]) else {
            return Ok(());
        };
        let index = slots.iter().rposition(|&s| s == twice).expect("listed");
        Err(Error::InvalidState {
            op,
            index,
            key: keys[index].as_ref().to_vec(),
            state: "listed twice",
            needed: "listed once",
        })
    }

    fn undo_unpins(&mut self, slots: &[u32]) {
        for &slot in slots {
            let e = &mut self.entries[slot as usize];
            if e.pins == 0 && e.live() {
                self.stats.pinned += 1;
            }
            e.pins += 1;
        }
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

    /// Checks every internal invariant; `Error::BrokenInvariant` describes the first broken one
    /// (the store stays usable). For tests and debugging: O(slots used).
    pub fn check_invariants(&self) -> Result<()> {
        macro_rules! ensure {
            ($cond:expr, $($msg:tt)+) => {
                if !$cond {
                    return Err(Error::BrokenInvariant(format!($($msg)+)));
                }
            };
        }
        let (mut ready, mut pending, mut pinned) = (0, 0, 0);
        let mut live_slots = 0u32;
        for (slot, e) in self.entries.iter().enumerate() {
            let slot = slot as u32;
            match e.state {
                State::Free => {
                    ensure!(e.list == NO_LIST, "free slot {slot} is in a policy list");
                    ensure!(e.pins == 0, "free slot {slot} is pinned");
                    continue;
                }
                State::Pending => {
                    pending += u64::from(e.live());
                    ensure!(e.pins == 0, "pending slot {slot} is pinned");
                }
                State::Ready => ready += u64::from(e.live()),
            }
            ensure!(e.flags & PROTECTED == 0, "slot {slot} left protected");
            ensure!(e.flags & LISTED == 0, "slot {slot} left marked as listed");
            live_slots += 1;
            pinned += u64::from(e.pins > 0 && e.live());
            ensure!(
                self.find_key(e.key.as_slice()) == Some(slot),
                "slot {slot} is not indexed"
            );
            ensure!(e.list != NO_LIST, "slot {slot} is in no policy list");
        }
        ensure!(self.index.len() as u32 == live_slots, "index size");
        let mut free = self.free.clone();
        free.sort_unstable();
        free.dedup();
        ensure!(free.len() == self.free.len(), "a slot is free twice");
        for &s in &free {
            ensure!(
                s < self.used_high_mark() && self.entries[s as usize].state == State::Free,
                "free slot {s} is in use"
            );
        }
        ensure!(
            live_slots + free.len() as u32 == self.used_high_mark(),
            "slots lost"
        );
        ensure!(
            self.used_high_mark() <= self.usable && self.usable <= self.num_slots,
            "slots handed out past the usable {} (of {})",
            self.usable,
            self.num_slots
        );
        ensure!(
            (ready, pending, pinned) == (self.stats.ready, self.stats.pending, self.stats.pinned),
            "counters: ready, pending, pinned are {:?}, counted {:?}",
            (ready, pending, pinned),
            (self.stats.ready, self.stats.pending, self.stats.pinned)
        );
        let mut in_lists = 0;
        for list in 0..self.policy.num_lists() {
            let members = self.policy.list_members(&self.entries, list);
            ensure!(
                members.len() as u32 == self.policy.list_len(list),
                "list {list} length"
            );
            for s in members {
                ensure!(
                    self.entries[s as usize].list == list,
                    "slot {s} in the wrong list"
                );
            }
            in_lists += self.policy.list_len(list);
        }
        ensure!(
            in_lists == live_slots,
            "policy lists hold every live slot once"
        );
        if let Some(s) = self.policy.rank_mismatch(&self.entries) {
            ensure!(false, "slot {s} is ordered by a stale rank");
        }
        if let Some(problem) = self.policy.ghost_problem() {
            ensure!(false, "{problem}");
        }
        Ok(())
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
    fn a_broken_invariant_is_an_error_and_the_store_stays_usable() {
        let mut s = Store::new(4, PolicyKind::Lru, false).unwrap();
        s.prepare_store(&[b"a"]).unwrap().unwrap();
        s.stats.ready += 1; // a counting bug
        let err = s.check_invariants().unwrap_err();
        assert!(matches!(&err, Error::BrokenInvariant(m) if m.starts_with("counters")));
        s.stats.ready -= 1;
        s.complete_store(&[b"a"], true).unwrap();
        s.check_invariants().unwrap();
    }

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
}
