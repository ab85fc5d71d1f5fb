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
}

impl Index {
    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.at.contains_key(key)
    }

    /// `key` was stored or read: the most recently used.
    pub fn touch(&mut self, key: &[u8]) {
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
        if self.at.contains_key(&key) {
            return;
        }
        self.scanned += 1;
        self.at.insert(key.clone(), self.scanned);
        self.order.insert(self.scanned, key);
    }

    pub fn remove(&mut self, key: &[u8]) -> bool {
        match self.at.remove(key) {
            Some(place) => {
                self.order.remove(&place);
                true
            }
            None => false,
        }
    }

    /// The least recently used chunk, taken out of the index.
    pub fn pop_oldest(&mut self) -> Option<Vec<u8>> {
        let (_, key) = self.order.pop_first()?;
        self.at.remove(&key);
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
        let order: Vec<Vec<u8>> = std::iter::from_fn(|| ix.pop_oldest()).collect();
        assert_eq!(
            order,
            vec![
                b"old1".to_vec(),
                b"old2".to_vec(),
                b"b".to_vec(),
                b"a".to_vec()
            ]
        );
        assert!(!ix.remove(b"a"));
    }
}
