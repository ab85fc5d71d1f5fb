//! `SampledLru`: a key set evicted as Redis's `allkeys-lru` evicts, for the simulator's model of a
//! shared tier. Redis does not keep an LRU order: to make room it samples `maxmemory-samples`
//! keys at random and evicts the least recently used of them, so a hot key can go and a cold one
//! stay. Each key also carries the time its write lands, before which it cannot be read.

use crate::error::{Error, Result};
use foldhash::fast::FixedState;
use std::collections::HashMap;

pub struct SampledLru {
    capacity: usize,
    samples: usize,
    /// Key -> its slot in the dense arrays below (sampling a random key is then O(1)).
    index: HashMap<Box<[u8]>, usize, FixedState>,
    keys: Vec<Box<[u8]>>,
    ready_at: Vec<f64>,
    used: Vec<u64>,
    clock: u64,
    rng: u64,
}

impl SampledLru {
    /// Holds at most `capacity` keys; evicts the least recently used of `samples` drawn at random
    /// (with repeats, as Redis's sampling may), from a generator seeded with `seed`.
    pub fn new(capacity: usize, samples: usize, seed: u64) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::InvalidArgument {
                name: "capacity",
                value: capacity.to_string(),
                allowed: "an int >= 1",
            });
        }
        if !(1..=64).contains(&samples) {
            return Err(Error::InvalidArgument {
                name: "samples",
                value: samples.to_string(),
                allowed: "an int in 1..=64",
            });
        }
        Ok(SampledLru {
            capacity,
            samples,
            index: HashMap::with_hasher(FixedState::with_seed(seed)),
            keys: Vec::new(),
            ready_at: Vec::new(),
            used: Vec::new(),
            clock: 0,
            // SplitMix64's state: any value works, zero included.
            rng: seed,
        })
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// How many leading `keys` are readable at `now`; each hit is a use.
    pub fn lookup_prefix(&mut self, keys: &[&[u8]], now: f64) -> usize {
        for (i, key) in keys.iter().enumerate() {
            match self.index.get(*key) {
                Some(&slot) if self.ready_at[slot] <= now => {
                    self.clock += 1;
                    self.used[slot] = self.clock;
                }
                _ => return i,
            }
        }
        keys.len()
    }

    /// How many leading `keys` are readable at `now`, none of them used: what a router that
    /// indexes the tier (from its events) sees, which must not keep a key longer.
    pub fn peek_prefix(&self, keys: &[&[u8]], now: f64) -> usize {
        let readable =
            |key: &&[u8]| matches!(self.index.get(*key), Some(&slot) if self.ready_at[slot] <= now);
        keys.iter().take_while(|k| readable(k)).count()
    }

    /// Writes `keys`, readable from `ready_at`; returns how many keys were evicted for them. A
    /// key written again is used again and stays readable from the earlier of its two times.
    pub fn put(&mut self, keys: &[&[u8]], ready_at: f64) -> usize {
        let mut evicted = 0;
        for key in keys {
            self.clock += 1;
            if let Some(&slot) = self.index.get(*key) {
                self.ready_at[slot] = self.ready_at[slot].min(ready_at);
                self.used[slot] = self.clock;
                continue;
            }
            if self.keys.len() >= self.capacity {
                self.evict();
                evicted += 1;
            }
            self.index.insert((*key).into(), self.keys.len());
            self.keys.push((*key).into());
            self.ready_at.push(ready_at);
            self.used.push(self.clock);
        }
        evicted
    }

    fn next_random(&mut self) -> u64 {
        // SplitMix64: small, fast and well spread; the samples need no more.
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn evict(&mut self) {
        let n = self.keys.len() as u64;
        let mut victim = (self.next_random() % n) as usize;
        for _ in 1..self.samples {
            let slot = (self.next_random() % n) as usize;
            if self.used[slot] < self.used[victim] {
                victim = slot;
            }
        }
        let last = self.keys.len() - 1;
        let key = self.keys.swap_remove(victim);
        self.ready_at.swap_remove(victim);
        self.used.swap_remove(victim);
        self.index.remove(&key);
        if victim != last {
            *self.index.get_mut(&self.keys[victim]).expect("indexed") = victim;
        }
    }

    /// Whether the index and the arrays agree (for tests).
    pub fn check_invariants(&self) -> Result<()> {
        let ok = self.index.len() == self.keys.len()
            && self.keys.len() <= self.capacity
            && self.ready_at.len() == self.keys.len()
            && self.used.len() == self.keys.len()
            && self
                .keys
                .iter()
                .enumerate()
                .all(|(i, k)| self.index.get(k) == Some(&i));
        if ok {
            Ok(())
        } else {
            Err(Error::BrokenInvariant(
                "sampled LRU: index and slots disagree".into(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> Vec<u8> {
        i.to_le_bytes().to_vec()
    }

    fn keys(range: std::ops::Range<u32>) -> Vec<Vec<u8>> {
        range.map(key).collect()
    }

    fn refs(keys: &[Vec<u8>]) -> Vec<&[u8]> {
        keys.iter().map(|k| k.as_slice()).collect()
    }

    #[test]
    fn keys_are_readable_once_their_write_lands() {
        let mut t = SampledLru::new(10, 5, 0).unwrap();
        let ks = keys(0..4);
        assert_eq!(t.put(&refs(&ks), 2.0), 0);
        assert_eq!(t.lookup_prefix(&refs(&ks), 1.9), 0);
        assert_eq!(t.lookup_prefix(&refs(&ks), 2.0), 4);
        // A rewrite that lands later keeps the key readable from the earlier time.
        t.put(&refs(&ks[..1]), 9.0);
        assert_eq!(t.lookup_prefix(&refs(&ks), 3.0), 4);
        let gap = [ks[0].clone(), key(99), ks[1].clone()];
        assert_eq!(t.lookup_prefix(&refs(&gap), 3.0), 1);
    }

    #[test]
    fn a_peek_sees_what_a_lookup_sees_and_uses_nothing() {
        // Room for 2 and 64 samples (of 2 keys): the victim is the least recently used.
        let mut t = SampledLru::new(2, 64, 0).unwrap();
        let ks = keys(0..3);
        t.put(&refs(&ks[..2]), 1.0);
        assert_eq!(t.peek_prefix(&refs(&ks[..2]), 0.5), 0);
        assert_eq!(t.peek_prefix(&refs(&ks), 1.0), 2);
        // A lookup of key 0 would make key 1 the victim; after a peek key 0 still goes first.
        assert_eq!(t.peek_prefix(&refs(&ks[..1]), 1.0), 1);
        t.put(&refs(&ks[2..]), 1.0);
        assert_eq!(t.peek_prefix(&refs(&ks[..1]), 1.0), 0);
        assert_eq!(t.peek_prefix(&refs(&ks[1..]), 1.0), 2);
    }

    #[test]
    fn a_full_tier_evicts_one_key_per_new_key_and_never_grows() {
        let mut t = SampledLru::new(100, 5, 7).unwrap();
        let ks = keys(0..250);
        assert_eq!(t.put(&refs(&ks), 0.0), 150);
        assert_eq!(t.len(), 100);
        t.check_invariants().unwrap();
        assert_eq!(t.put(&refs(&ks[249..]), 0.0), 0); // resident: no eviction
    }

    #[test]
    fn sampling_keeps_recently_used_keys_far_more_often() {
        // 1,000 keys, the first 100 used after every batch of new writes: with 5 samples a hot
        // key is picked as victim only if all 5 samples are hot (about 1e-5 per eviction).
        let mut t = SampledLru::new(1000, 5, 3).unwrap();
        let ks = keys(0..1000);
        t.put(&refs(&ks), 0.0);
        let hot = refs(&ks[..100]);
        for round in 0..20u32 {
            assert_eq!(t.lookup_prefix(&hot, 1.0), 100, "round {round}");
            let fresh = keys(10_000 + round * 50..10_000 + (round + 1) * 50);
            t.put(&refs(&fresh), 0.0);
        }
        assert_eq!(t.lookup_prefix(&hot, 1.0), 100);
        t.check_invariants().unwrap();
    }

    #[test]
    fn the_seed_decides_which_keys_go() {
        let survivors = |seed| {
            let mut t = SampledLru::new(50, 5, seed).unwrap();
            let all = keys(0..200);
            t.put(&refs(&all), 0.0);
            all.iter()
                .filter(|k| t.lookup_prefix(&[k.as_slice()], 0.0) == 1)
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(survivors(1).len(), 50);
        assert_eq!(survivors(1), survivors(1));
        assert_ne!(survivors(1), survivors(2));
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert!(matches!(
            SampledLru::new(0, 5, 0),
            Err(Error::InvalidArgument {
                name: "capacity",
                ..
            })
        ));
        assert!(matches!(
            SampledLru::new(1, 0, 0),
            Err(Error::InvalidArgument {
                name: "samples",
                ..
            })
        ));
    }
}
