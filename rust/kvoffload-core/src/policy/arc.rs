//! ARC's ghosts: the fingerprints of recently evicted keys (B1, B2) and the target size of T1
//! they steer.

use crate::index::{Index, MAX_BUCKETS};
use crate::list::{Linked, List, NIL};

/// A remembered key: 16 bytes. The fingerprint's lowest bit is replaced by the ghost list
/// (0 = B1, 1 = B2), so fingerprints compare on their upper 63 bits.
#[derive(Clone, Copy)]
pub(super) struct Ghost {
    tagged: u64,
    prev: u32,
    next: u32,
}

const _: () = assert!(core::mem::size_of::<Ghost>() == 16);

impl Ghost {
    fn fingerprint(&self) -> u64 {
        self.tagged & !1
    }

    pub(super) fn list(&self) -> usize {
        (self.tagged & 1) as usize
    }
}

impl Linked for Ghost {
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

/// Ghosts are looked up on every insert and mostly miss, but they must stay within the metadata
/// budget per slot: a fuller table than the main index.
const GHOST_INDEX_LOAD: f64 = 0.8;

/// ARC's B1/B2: at most `capacity` fingerprints in all, so ghosts cost a bounded amount per slot.
pub(super) struct Ghosts {
    pub(super) capacity: u32,
    pub(super) target_t1: f64,
    pub(super) nodes: Vec<Ghost>,
    free: Vec<u32>,
    table: Index,
    pub(super) lists: [List; 2],
}

impl Ghosts {
    pub(super) fn new(capacity: u32) -> Self {
        Ghosts {
            capacity,
            target_t1: 0.0,
            nodes: Vec::new(),
            free: Vec::new(),
            // A call may add up to `capacity` ghosts before it trims (bounded by what the table
            // can address, far beyond any real call).
            table: Index::new(
                (2 * capacity as usize).min((MAX_BUCKETS as f64 * GHOST_INDEX_LOAD) as usize),
                GHOST_INDEX_LOAD,
            ),
            lists: [List::default(); 2],
        }
    }

    pub(super) fn find(&self, fp: u64) -> Option<u32> {
        let fp = fp & !1;
        let nodes = &self.nodes;
        self.table
            .find(fp, |g| nodes[g as usize].fingerprint() == fp)
    }

    /// The target after a hit in ghost list `list` (0 = B1: favour recency, 1 = B2: favour
    /// frequency) with the lists `lens` long.
    pub(super) fn adapted(&self, target: f64, list: usize, lens: [u32; 2]) -> f64 {
        let (b1, b2) = (f64::from(lens[0]), f64::from(lens[1]));
        if list == 0 {
            (target + (b2 / b1).max(1.0)).min(f64::from(self.capacity))
        } else {
            (target - (b1 / b2).max(1.0)).max(0.0)
        }
    }

    /// If `fp` is a ghost: adapt the target, forget the ghost, and report the hit.
    pub(super) fn hit(&mut self, fp: u64) -> bool {
        let Some(g) = self.find(fp) else { return false };
        let lens = [self.lists[0].len, self.lists[1].len];
        self.target_t1 = self.adapted(self.target_t1, self.nodes[g as usize].list(), lens);
        self.drop_ghost(g);
        true
    }

    /// ARC's bounds, given T1 and T2's lengths: |T1| + |B1| <= c, and all four lists <= 2c
    /// (the oldest ghosts go); ghosts alone never exceed c either (they can when failed stores
    /// left the cache below c).
    pub(super) fn trim(&mut self, t: [u32; 2]) {
        let c = self.capacity;
        let (t1, t2) = (u64::from(t[0]), u64::from(t[1]));
        let b = |g: &Ghosts, l: usize| u64::from(g.lists[l].len);
        while self.lists[0].len > 0 && t1 + b(self, 0) > u64::from(c) {
            self.drop_ghost(self.lists[0].head);
        }
        while self.lists[1].len > 0 && t1 + t2 + b(self, 0) + b(self, 1) > 2 * u64::from(c) {
            self.drop_ghost(self.lists[1].head);
        }
        while self.lists[0].len + self.lists[1].len > c {
            let from = usize::from(self.lists[1].len > 0);
            self.drop_ghost(self.lists[from].head);
        }
    }

    fn drop_ghost(&mut self, g: u32) {
        let list = self.nodes[g as usize].list();
        self.lists[list].unlink(&mut self.nodes, g);
        let fp = self.nodes[g as usize].fingerprint();
        let removed = self.table.remove(fp, g);
        debug_assert!(removed, "ghost {g} is indexed");
        self.free.push(g);
    }

    /// Remembers an evicted key. It cannot be a ghost already: its ghost, if any, was consumed
    /// when it was inserted (a fingerprint collision would only leave a harmless duplicate).
    pub(super) fn add(&mut self, list: u8, fp: u64) {
        let fp = fp & !1;
        let node = Ghost {
            tagged: fp | u64::from(list),
            prev: NIL,
            next: NIL,
        };
        let g = match self.free.pop() {
            Some(g) => {
                self.nodes[g as usize] = node;
                g
            }
            None => {
                // `reserve` made room.
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.lists[list as usize].push_mru(&mut self.nodes, g);
        self.table.insert(fp, g);
    }

    /// Room for `n` more evictions (a call may hold up to `capacity + n` ghosts until it
    /// trims): nodes, their index and the free list; false when memory refuses.
    pub(super) fn reserve(&mut self, n: usize) -> bool {
        let n = n.min(self.capacity as usize); // a call evicts at most every slot
        let fresh = n.saturating_sub(self.free.len());
        self.table.len() + n <= self.table.limit()
            && self.nodes.try_reserve(fresh).is_ok()
            && self.free.try_reserve(self.nodes.len() + fresh).is_ok()
            && self.table.reserve(n)
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * core::mem::size_of::<Ghost>()
            + self.free.capacity() * 4
            + self.table.heap_bytes()
    }
}
