//! Offers to store keys: where each new key goes (evicting by the policy to make room), and
//! the completion that makes it ready or frees it.

use super::entry::{Entry, State, LISTED, PROTECTED};
use super::{KeyStatus, RankedBatch, Store, StorePlan};
use crate::error::{Error, Result};
use crate::events::EventKind;
use crate::index::{prefetch, Index};
use crate::key::{hash_key, validate_keys, InlineKey, MAX_KEY_LEN};
use crate::keybuf::KeyBuf;

impl Store {
    /// Reserves slots for the keys that are neither pending nor ready, evicting unpinned ready
    /// keys by the policy if the free slots do not suffice. `Ok(None)` means "cannot store now":
    /// the store is unchanged (only the refusal counter moves).
    pub fn prepare_store<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Option<StorePlan>> {
        self.prepare_store_ranked(keys, None, false)
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
}
