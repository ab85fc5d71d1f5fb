//! `Index`: a hash → `u32` id map with open addressing, linear probing and backward-shift deletion.
//!
//! A bucket packs the top 32 bits of the hash (its tag, which also picks the home bucket:
//! `tag * len / 2^32`, an equal share of tags per bucket) with the id, so a probe reads 8 bytes
//! and asks the caller to compare keys only when the tags match. There are no tombstones, so
//! deletions never call for a rehash; the table grows (a rehash from the tags alone) only as the
//! caller reserves room, up to a limit fixed at construction (for the store: its slots). Batches
//! prefetch the buckets they are about to probe.

const EMPTY: u64 = 0;
/// `home` multiplies a 32-bit tag by the table length in 64 bits.
pub(crate) const MAX_BUCKETS: usize = 1 << 32;
const INITIAL_CAPACITY: usize = 1024;

#[inline]
fn tag(hash: u64) -> u32 {
    (hash >> 32) as u32
}

pub(crate) struct Index {
    buckets: Box<[u64]>,
    len: usize,
    /// Ids the current buckets take.
    capacity: usize,
    /// Ids the table may ever hold: it grows up to this as `reserve` asks.
    limit: usize,
    max_load: f64,
}

/// Buckets for `capacity` ids at `max_load`, or `None` when memory refuses them.
fn try_buckets(capacity: usize, max_load: f64) -> Option<Box<[u64]>> {
    let n = ((capacity as f64 / max_load).ceil() as usize)
        .max(capacity + 1)
        .clamp(8, MAX_BUCKETS);
    let mut buckets = Vec::new();
    buckets.try_reserve_exact(n).ok()?;
    buckets.resize(n, EMPTY);
    Some(buckets.into_boxed_slice())
}

impl Index {
    /// An empty table for at most `limit` ids, kept at most `max_load` full; it starts small and
    /// grows with `reserve`. `limit / max_load` must not exceed `MAX_BUCKETS`.
    pub(crate) fn new(limit: usize, max_load: f64) -> Self {
        assert!(
            (limit as f64 / max_load) <= MAX_BUCKETS as f64,
            "index limit {limit} exceeds {MAX_BUCKETS} buckets"
        );
        let capacity = limit.min(INITIAL_CAPACITY);
        Index {
            buckets: try_buckets(capacity, max_load).expect("a small index fits"),
            len: 0,
            capacity,
            limit,
            max_load,
        }
    }

    /// A table sized for `capacity` ids at once (a batch's own keys); `None` when memory
    /// refuses.
    pub(crate) fn try_with_capacity(capacity: usize, max_load: f64) -> Option<Self> {
        let buckets = try_buckets(capacity, max_load)?;
        Some(Index {
            buckets,
            len: 0,
            capacity,
            limit: capacity,
            max_load,
        })
    }

    #[cfg(test)]
    pub(crate) fn with_capacity(capacity: usize, max_load: f64) -> Self {
        Self::try_with_capacity(capacity, max_load).expect("a test-sized index fits")
    }

    /// Makes room for `additional` more ids (within the limit), growing by at least half;
    /// false, with nothing changed, when memory refuses.
    #[must_use]
    pub(crate) fn reserve(&mut self, additional: usize) -> bool {
        let want = self.len + additional;
        assert!(want <= self.limit, "index over its limit");
        if want <= self.capacity {
            return true;
        }
        let capacity = want.max(self.capacity + self.capacity / 2).min(self.limit);
        let Some(buckets) = try_buckets(capacity, self.max_load) else {
            return false;
        };
        let old = std::mem::replace(&mut self.buckets, buckets);
        for &b in old.iter().filter(|&&b| b != EMPTY) {
            // A bucket's tag is all its home needs.
            let mut i = self.home(tag(b));
            while self.buckets[i] != EMPTY {
                i = self.next(i);
            }
            self.buckets[i] = b;
        }
        self.capacity = capacity;
        true
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.buckets.len() * core::mem::size_of::<u64>()
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        ((u64::from(tag) * self.buckets.len() as u64) >> 32) as usize
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.buckets.len() {
            0
        } else {
            i + 1
        }
    }

    /// The id stored under `hash` for which `eq` holds.
    #[inline]
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let t = tag(hash);
        let mut i = self.home(t);
        loop {
            let b = self.buckets[i];
            if b == EMPTY {
                return None;
            }
            if tag(b) == t && eq(b as u32 - 1) {
                return Some(b as u32 - 1);
            }
            i = self.next(i);
        }
    }

    /// The first id whose bucket matches `hash`'s tag, without comparing keys: a prefetch hint.
    #[inline]
    pub(crate) fn peek(&self, hash: u64) -> Option<u32> {
        self.find(hash, |_| true)
    }

    /// Stores `id` under `hash`; the caller guarantees it is not there yet and there is room.
    pub(crate) fn insert(&mut self, hash: u64, id: u32) {
        assert!(
            self.len < self.capacity,
            "index over capacity: reserve first"
        );
        debug_assert!(id < u32::MAX);
        let t = tag(hash);
        let mut i = self.home(t);
        while self.buckets[i] != EMPTY {
            i = self.next(i);
        }
        self.buckets[i] = (u64::from(t) << 32) | u64::from(id + 1);
        self.len += 1;
    }

    /// Removes `id` stored under `hash`; false if it is not there.
    pub(crate) fn remove(&mut self, hash: u64, id: u32) -> bool {
        let want = (u64::from(tag(hash)) << 32) | u64::from(id + 1);
        let mut hole = self.home(tag(hash));
        loop {
            match self.buckets[hole] {
                EMPTY => return false,
                b if b == want => break,
                _ => hole = self.next(hole),
            }
        }
        // Backward shift: pull later members of the probe run into the hole when their home
        // bucket lies at or before it, so every id stays reachable from its home without gaps.
        let n = self.buckets.len();
        // Forward distance on the ring, without a division: this runs for every bucket shifted.
        let dist = |from: usize, to: usize| if to >= from { to - from } else { to + n - from };
        let mut j = self.next(hole);
        while self.buckets[j] != EMPTY {
            let home = self.home(tag(self.buckets[j]));
            if dist(home, hole) < dist(home, j) {
                self.buckets[hole] = self.buckets[j];
                hole = j;
            }
            j = self.next(j);
        }
        self.buckets[hole] = EMPTY;
        self.len -= 1;
        true
    }

    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        prefetch(&self.buckets[self.home(tag(hash))]);
    }
}

/// Asks the CPU to start loading `value`'s cache line; a hint with no effect on results.
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching is a hint that never faults, and the pointer comes from a reference.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
            (value as *const T).cast::<i8>(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::OLD_PUBLIC_SEED;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn colliding_hashes_stay_reachable_after_removals() {
        let mut index = Index::with_capacity(6, 0.75);
        // Same tag for all: one long probe run that wraps around the 8 buckets.
        let h = 0xffff_ffff_0000_0000;
        for id in 0..6 {
            index.insert(h, id);
        }
        assert!(index.remove(h, 2));
        assert!(!index.remove(h, 2));
        for id in [0, 1, 3, 4, 5] {
            assert_eq!(index.find(h, |x| x == id), Some(id));
        }
        assert_eq!(index.find(h, |x| x == 2), None);
        assert_eq!(index.len(), 5);
    }

    #[test]
    fn grows_with_reserve_and_keeps_every_id() {
        let mut index = Index::new(100_000, 0.7);
        let before = index.heap_bytes();
        for id in 0..50_000u32 {
            assert!(index.reserve(1));
            index.insert(crate::key::hash_key(&id.to_le_bytes()), id);
        }
        assert!(index.heap_bytes() > before);
        for id in 0..50_000u32 {
            let h = crate::key::hash_key(&id.to_le_bytes());
            assert_eq!(index.find(h, |x| x == id), Some(id));
        }
    }

    /// The longest distance from an id's home bucket to where it sits.
    fn max_displacement(index: &Index) -> usize {
        let n = index.buckets.len();
        (0..n)
            .filter(|&i| index.buckets[i] != EMPTY)
            .map(|i| (i + n - index.home(tag(index.buckets[i]))) % n)
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn crafted_keys_spread_like_random_ones_under_the_process_seed() {
        let keys = crate::testing::colliding_keys(2_000, OLD_PUBLIC_SEED, 12);
        let fill = |hash: &dyn Fn(&[u8]) -> u64| {
            let mut index = Index::with_capacity(4_000, 0.7);
            for (id, k) in keys.iter().enumerate() {
                index.insert(hash(k), id as u32);
            }
            max_displacement(&index)
        };
        // Under the seed they were made for, they pile up in one run of buckets...
        let attacked = fill(&|k| crate::key::hash_key_with_seed(k, OLD_PUBLIC_SEED));
        assert!(attacked > 1_000, "crafted keys should collide: {attacked}");
        // ...under the process's random seed they do not.
        let defended = fill(&crate::key::hash_key);
        assert!(defended < 64, "max displacement {defended}");
    }

    proptest! {
        #[test]
        fn behaves_like_a_map(ops in prop::collection::vec((0u8..3, 0u64..40), 1..300)) {
            let mut index = Index::with_capacity(24, 0.8);
            let mut model: HashMap<u64, u32> = HashMap::new();
            // Few distinct tags so probe runs collide and wrap.
            let hash = |k: u64| (k % 7) << 61 | k;
            for (op, k) in ops {
                let id = k as u32;
                match op {
                    0 if !model.contains_key(&k) && model.len() < 24 => {
                        index.insert(hash(k), id);
                        model.insert(k, id);
                    }
                    1 => prop_assert_eq!(index.remove(hash(k), id), model.remove(&k).is_some()),
                    _ => {}
                }
                for (&mk, &mid) in &model {
                    prop_assert_eq!(index.find(hash(mk), |x| x == mid), Some(mid));
                }
                prop_assert_eq!(index.find(hash(k), |x| x == id), model.get(&k).copied());
                prop_assert_eq!(index.len(), model.len());
            }
        }
    }
}
