//! `BlockSet`: the GPU blocks an engine handed out in one schedule. A hybrid model's window
//! groups free blocks while their request runs; the blocks handed out again must not be read by
//! the stores still to plan, and fence the stores in flight that read them. An engine hands out
//! thousands of blocks per step and only membership is asked.

use std::collections::HashSet;

use crate::window::NULL_BLOCK;

/// Ids below this live in a bitmap (at most 8 MiB), the rest in a hash set: GPU block ids are
/// dense from 0, and a step hands out thousands of them.
const BITMAP_IDS: u64 = 1 << 26;

#[derive(Debug, Clone, Default)]
pub struct BlockSet {
    bits: Vec<u64>,
    far: HashSet<u64, foldhash::fast::FixedState>,
    len: usize,
}

impl BlockSet {
    pub fn new() -> Self {
        BlockSet::default()
    }

    pub fn extend(&mut self, ids: &[u64]) {
        if let Some(&most) = ids.iter().filter(|&&id| id < BITMAP_IDS).max() {
            let words = (most / 64 + 1) as usize;
            if self.bits.len() < words {
                self.bits.resize(words, 0);
            }
        }
        for &id in ids {
            self.insert(id);
        }
    }

    pub fn insert(&mut self, id: u64) {
        if id >= BITMAP_IDS {
            self.len += usize::from(self.far.insert(id));
            return;
        }
        let (word, bit) = ((id / 64) as usize, 1u64 << (id % 64));
        if self.bits.len() <= word {
            self.bits.resize(word + 1, 0);
        }
        self.len += usize::from(self.bits[word] & bit == 0);
        self.bits[word] |= bit;
    }

    pub fn remove(&mut self, id: u64) {
        if id >= BITMAP_IDS {
            self.len -= usize::from(self.far.remove(&id));
            return;
        }
        let (word, bit) = ((id / 64) as usize, 1u64 << (id % 64));
        if let Some(w) = self.bits.get_mut(word) {
            self.len -= usize::from(*w & bit != 0);
            *w &= !bit;
        }
    }

    pub fn contains(&self, id: u64) -> bool {
        if id >= BITMAP_IDS {
            return self.far.contains(&id);
        }
        self.bits
            .get((id / 64) as usize)
            .is_some_and(|w| w & (1u64 << (id % 64)) != 0)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The ids, ascending.
    pub fn sorted(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.len);
        for (w, &word) in self.bits.iter().enumerate() {
            let mut rest = word;
            while rest != 0 {
                out.push(w as u64 * 64 + u64::from(rest.trailing_zeros()));
                rest &= rest - 1;
            }
        }
        let mut far: Vec<u64> = self.far.iter().copied().collect();
        far.sort_unstable();
        out.extend(far);
        out
    }

    /// Replaces every block of `table` that is in the set by the null block, and returns how
    /// many it replaced: a window table stops reading blocks handed out again.
    pub fn null_members(&self, table: &mut [u64]) -> usize {
        if self.is_empty() {
            return 0;
        }
        let mut replaced = 0;
        for block in table.iter_mut() {
            if *block != NULL_BLOCK && self.contains(*block) {
                *block = NULL_BLOCK;
                replaced += 1;
            }
        }
        replaced
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_and_order() {
        let mut set = BlockSet::new();
        assert!(set.is_empty());
        set.extend(&[9, 3, 9, 41]);
        set.insert(7);
        set.remove(41);
        set.remove(1000); // absent: nothing changes
        assert_eq!(set.len(), 3);
        assert!(set.contains(3) && set.contains(7) && set.contains(9));
        assert!(!set.contains(41));
        assert_eq!(set.sorted(), vec![3, 7, 9]);
    }

    #[test]
    fn ids_past_the_bitmap() {
        let mut set = BlockSet::new();
        let far = BITMAP_IDS + 5;
        set.extend(&[u64::MAX >> 1, far, 64, far, 63]);
        assert_eq!(set.len(), 4);
        assert!(set.contains(far) && set.contains(u64::MAX >> 1));
        assert!(!set.contains(far + 1));
        assert_eq!(set.sorted(), vec![63, 64, far, u64::MAX >> 1]);
        set.remove(far);
        set.remove(far);
        set.remove(64);
        assert_eq!(set.len(), 2);
        assert_eq!(set.sorted(), vec![63, u64::MAX >> 1]);
        // The bitmap grew only as far as the largest id below its limit.
        assert_eq!(set.bits.len(), 2);
    }

    #[test]
    fn nulls_members_only() {
        let mut set = BlockSet::new();
        set.extend(&[5, 6, 8]);
        let mut table = vec![5, 1, 6, 0, 8, 5, 2];
        assert_eq!(set.null_members(&mut table[2..]), 3);
        assert_eq!(table, vec![5, 1, 0, 0, 0, 0, 2]);
        assert_eq!(set.null_members(&mut table), 1);
        assert_eq!(table, vec![0, 1, 0, 0, 0, 0, 2]);
        // Nothing left to replace: an idempotent second pass.
        assert_eq!(set.null_members(&mut table), 0);
    }

    #[test]
    fn the_null_block_is_never_counted() {
        let mut set = BlockSet::new();
        set.extend(&[NULL_BLOCK, 4]);
        let mut table = vec![NULL_BLOCK, 4, NULL_BLOCK];
        assert_eq!(set.null_members(&mut table), 1);
        assert_eq!(table, vec![NULL_BLOCK, NULL_BLOCK, NULL_BLOCK]);
    }

    #[test]
    fn an_empty_set_leaves_tables_alone() {
        let set = BlockSet::new();
        let mut table = vec![3, 4];
        assert_eq!(set.null_members(&mut table), 0);
        assert_eq!(table, vec![3, 4]);
    }
}
