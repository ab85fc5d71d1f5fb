//! Which chunks the tier holds, least recently used first, and how many bytes they take: what
//! answers lookups without touching the disk, and what `capacity_bytes` is held by.

use std::collections::{BTreeMap, HashMap, HashSet};

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
    /// Bumped by every drop (eviction, removal): a scan that began before a chunk was dropped
    /// listed a file that is gone, and must not bring it back.
    epoch: u64,
    /// The chunks dropped while a scan runs, with the epoch of the drop (none between scans:
    /// then nothing can bring them back).
    dropped: HashMap<Vec<u8>, u64>,
    scanning: bool,
}

/// Where a scan began: what it may add, and what it may prune.
#[derive(Clone, Copy)]
pub(crate) struct ScanMark {
    epoch: u64,
    next: u64,
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
        if let Some(old) = self.at.remove(key) {
            self.order.remove(&old);
        }
        self.next += 1;
        let place = (1 << 62) + self.next;
        self.at.insert(key.to_vec(), place);
        self.order.insert(place, key.to_vec());
    }

    /// A scan starts: where it stands, for `add_scanned`, `prune` and `scan_done`.
    pub fn begin_scan(&mut self) -> ScanMark {
        self.scanning = true;
        ScanMark {
            epoch: self.epoch,
            next: self.next,
        }
    }

    /// `key` found by a scan that began at `since`, unless the index holds it or it was dropped
    /// after the scan began. The start-up scan's chunks go below every chunk used since open,
    /// in the order of their files' ages (`recent: false`); a later scan's are new files other
    /// engines wrote since the last one, taken as just used (`recent: true`).
    pub fn add_scanned(&mut self, key: Vec<u8>, since: ScanMark, recent: bool) {
        let since = since.epoch;
        if self.at.contains_key(&key) || self.dropped.get(&key).is_some_and(|&e| e > since) {
            return;
        }
        if recent {
            self.touch(&key);
            return;
        }
        self.scanned += 1;
        self.at.insert(key.clone(), self.scanned);
        self.order.insert(self.scanned, key);
    }

    /// Drops the chunks the scan that began at `since` did not list (another engine evicted or
    /// removed their files), unless they were stored or read since it began, or are in flight:
    /// at most `max` places of the recency order from place `from` on, so that a large index is
    /// never held long. Returns the place to go on from, or None when done.
    pub fn prune(
        &mut self,
        listed: &HashSet<Vec<u8>>,
        since: ScanMark,
        from: u64,
        max: usize,
    ) -> Option<u64> {
        let touched_since = (1 << 62) + since.next;
        let mut next = None;
        let mut gone = Vec::new();
        for (seen, (&place, key)) in self.order.range(from..=touched_since).enumerate() {
            if seen == max {
                next = Some(place);
                break;
            }
            if !listed.contains(key) && !self.busy.contains_key(key) {
                gone.push(key.clone());
            }
        }
        for key in &gone {
            self.remove(key);
        }
        next
    }

    /// The scan that began at `since` is done: drops before it no longer matter.
    pub fn scan_done(&mut self, since: ScanMark) {
        self.scanning = false;
        self.dropped.retain(|_, e| *e > since.epoch);
    }

    fn drop_key(&mut self, key: &[u8]) {
        self.epoch += 1;
        if self.scanning {
            self.dropped.insert(key.to_vec(), self.epoch);
        }
    }

    pub fn remove(&mut self, key: &[u8]) -> bool {
        self.drop_key(key);
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
        self.drop_key(&key);
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
        let since = ix.begin_scan();
        ix.add_scanned(b"old1".to_vec(), since, false);
        ix.add_scanned(b"old2".to_vec(), since, false);
        ix.add_scanned(b"a".to_vec(), since, false); // held already: keeps its place
        ix.touch(b"a");
        assert_eq!(ix.len(), 4);
        ix.busy(b"old1", true);
        let order: Vec<Vec<u8>> = std::iter::from_fn(|| ix.pop_oldest_idle()).collect();
        // "old1" is in flight: skipped, and left.
        assert_eq!(order, vec![b"old2".to_vec(), b"b".to_vec(), b"a".to_vec()]);
        assert!(ix.contains(b"old1") && ix.len() == 1);
        ix.busy(b"old1", false);
        assert_eq!(ix.pop_oldest_idle(), Some(b"old1".to_vec()));
        // Dropped after the scan began: that scan does not bring it back; the next one, which
        // lists the directory after the drop, does (another engine wrote it again).
        ix.add_scanned(b"b".to_vec(), since, false);
        assert!(!ix.contains(b"b"));
        ix.scan_done(since);
        let next = ix.begin_scan();
        ix.add_scanned(b"b".to_vec(), next, true);
        assert!(ix.contains(b"b"));
        ix.scan_done(next);
        // Between scans a drop is not remembered: nothing could bring it back.
        ix.remove(b"b");
        assert!(ix.dropped.is_empty());
    }

    #[test]
    fn a_scan_prunes_what_it_did_not_list_unless_used_since_or_in_flight() {
        let mut ix = Index::default();
        for key in [&b"gone"[..], b"kept", b"busy", b"late"] {
            ix.touch(key);
        }
        let since = ix.begin_scan();
        ix.add_scanned(b"old".to_vec(), since, false); // listed by an earlier scan, now gone
        ix.busy(b"busy", true);
        ix.touch(b"late"); // stored after this scan listed the directory
        let listed: HashSet<Vec<u8>> = [b"kept".to_vec()].into();
        // Two places at a time: old, gone | kept, busy (late is past the scan's mark).
        let mut from = Some(0);
        let mut rounds = 0;
        while let Some(at) = from {
            from = ix.prune(&listed, since, at, 2);
            rounds += 1;
        }
        assert_eq!(rounds, 2);
        assert!(!ix.contains(b"gone") && !ix.contains(b"old"));
        assert!(ix.contains(b"kept") && ix.contains(b"busy") && ix.contains(b"late"));
        // Pruned is dropped: this scan's own listing cannot bring it back.
        ix.add_scanned(b"gone".to_vec(), since, true);
        assert!(!ix.contains(b"gone"));
    }
}
