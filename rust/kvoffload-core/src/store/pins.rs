//! Pins that keep a ready key from eviction: a load's and a write's hold (each counted).

use super::entry::{Entry, State, LOAD_PINS, WRITE_HOLD, WRITE_HOLDS};
use super::{RankedBatch, Store};
use crate::error::{Error, Result};
use crate::key::validate_keys;

impl Store {
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
        // A count that would reach the write holds' bits is refused (2**28 loads of one key).
        let room = |e: &Entry| (e.pins & LOAD_PINS) as usize + keys.len() < LOAD_PINS as usize;
        let slots = self.resolve(keys, "prepare_load", "ready", |e| {
            e.state == State::Ready && e.live() && room(e)
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

    /// Holds each key's slot while a write to a secondary tier reads it: not evictable, as if
    /// pinned, yet not a load in flight (`first_pinned`). Every key must be ready, held by fewer
    /// than 15 writes (one per tier of a chain), and listed once. Returns the slots.
    pub fn hold_for_write<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<u32>> {
        let needed = "ready and held by fewer than 15 writes";
        let slots = self.resolve(keys, "hold_for_write", needed, |e| {
            e.state == State::Ready && e.live() && e.pins & WRITE_HOLDS != WRITE_HOLDS
        })?;
        Self::refuse_repeats(keys, &slots, "hold_for_write")?;
        for &slot in &slots {
            let e = &mut self.entries[slot as usize];
            if e.pins == 0 {
                self.stats.pinned += 1;
            }
            e.pins += WRITE_HOLD;
        }
        Ok(slots)
    }

    /// Ends one write hold of each of `keys` (each held, listed once). A key dropped by `reset`
    /// meanwhile leaves the store once nothing pins it.
    pub fn release_write<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<()> {
        let needed = "held for a write";
        let slots = self.resolve(keys, "release_write", needed, |e| e.pins & WRITE_HOLDS != 0)?;
        Self::refuse_repeats(keys, &slots, "release_write")?;
        for &slot in &slots {
            let e = &mut self.entries[slot as usize];
            e.pins -= WRITE_HOLD;
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
}
