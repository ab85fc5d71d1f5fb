//! Which chunks the tier holds, least recently used first, and how many bytes they take: what
//! answers lookups without touching the disk, and what `capacity_bytes` is held by.

use std::collections::{BTreeMap, HashMap};

#[derive(Default)]
pub(crate) struct Index {
    /// Key -> its place in `order` (a larger one was used more recently).
    at: HashMap<Vec<u8>, u64>,
    order: BTreeMap<u64, Vec<u8>>,
    next: u64,
    /// Places below zero: chunks found by the start-up scan, older than anything used since.
    scanned: u64,
    /// Chunks being stored or loaded now: never evicted under their I/O.
    busy: HashMap<Vec<u8>, u32>,
    /// Chunks seen or dropped since open: the start-up scan, which listed the directory
    /// before, must not bring them back (a dropped one's file is gone).
    known: std::collections::HashSet<Vec<u8>>,
}

impl Index {
    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.at.contains_key(key)
    }

    pub fn busy(&mut self, key: &[u8], on: bool) {
        let n = self.busy.entry(key.to_vec()).or_insert(0);
        if on {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.busy.remove(key);
            }
        }
    }

    /// `key` was stored or read: the most recently used.
    pub fn touch(&mut self, key: &[u8]) {
        self.known.insert(key.to_vec());
        if let Some(old) = self.at.remove(key) {
            self.order.remove(&old);
        }
        self.next += 1;
        let place = (1 << 62) + self.next;
        self.at.insert(key.to_vec(), place);
        self.order.insert(place, key.to_vec());
    }

    /// `key` found by the scan, in the order of its file's age: below every chunk used since
    /// open, and unless it is known already.
    pub fn add_scanned(&mut self, key: Vec<u8>) {
        if self.known.contains(&key) {
            return;
        }
        self.scanned += 1;
        self.at.insert(key.clone(), self.scanned);
        self.order.insert(self.scanned, key);
    }

    pub fn remove(&mut self, key: &[u8]) -> bool {
        self.known.insert(key.to_vec());
        match self.at.remove(key) {
            Some(place) => {
                self.order.remove(&place);
                true
            }
            None => false,
        }
    }

    /// The least recently used chunk not in flight, taken out of the index.
    pub fn pop_oldest_idle(&mut self) -> Option<Vec<u8>> {
        let (&place, _) = self
            .order
            .iter()
            .find(|(_, key)| !self.busy.contains_key(*key))?;
        let key = self.order.remove(&place).expect("found above");
        self.at.remove(&key);
        self.known.insert(key.clone());
        Some(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_first_with_scanned_chunks_below_used_ones() {
        let mut ix = Index::default();
        ix.touch(b"a");
        ix.touch(b"b");
        ix.add_scanned(b"old1".to_vec());
        ix.add_scanned(b"old2".to_vec());
        ix.add_scanned(b"a".to_vec()); // known already: keeps its place
        ix.touch(b"a");
        assert_eq!(ix.len(), 4);
        ix.busy(b"old1", true);
        let order: Vec<Vec<u8>> = std::iter::from_fn(|| ix.pop_oldest_idle()).collect();
        // "old1" is in flight: skipped, and left.
        assert_eq!(order, vec![b"old2".to_vec(), b"b".to_vec(), b"a".to_vec()]);
        assert!(ix.contains(b"old1") && ix.len() == 1);
        ix.busy(b"old1", false);
        assert_eq!(ix.pop_oldest_idle(), Some(b"old1".to_vec()));
        // Dropped since open: a late scan does not bring it back.
        ix.add_scanned(b"b".to_vec());
        assert!(!ix.contains(b"b"));
    }
}
