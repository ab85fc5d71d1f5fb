//! LRU's order: each key's rank (a request's keys ordered within it, as vLLM 0.33 orders them)
//! and the lazy heap that keeps the ranks in order.

use super::{PolicyNode, NO_LIST};
use crate::heap::QuadHeap;

/// Eviction order of a key under `Lru`, packed in 64 bits: the smallest leaves first. A plain
/// use takes the next value of a counter (`major`); a key used by a request takes that request's
/// rank (drawn once from the same counter) and sorts below every other use of that rank by its
/// position in the request, so within a request tails leave before heads, across all its batches
/// (vLLM 0.33's LRU ranks `(request_rank, -position)` and `(counter, 0)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rank(u64);

const MINOR_BITS: u32 = 24;
const MINOR_MAX: u64 = (1 << MINOR_BITS) - 1;
/// 2^40 draws: past that, ranks saturate (later uses tie, broken by slot) instead of wrapping.
const MAJOR_MAX: u64 = (1 << (64 - MINOR_BITS)) - 1;

impl Rank {
    /// A plain use: above every key of the same major.
    pub fn plain(major: u64) -> Rank {
        Rank((major.min(MAJOR_MAX) << MINOR_BITS) | MINOR_MAX)
    }

    /// Position `position` of a request of rank `major`: positions beyond 2^24 - 2 tie.
    pub fn at(major: u64, position: i64) -> Rank {
        let p = position.clamp(0, MINOR_MAX as i64 - 1) as u64;
        Rank((major.min(MAJOR_MAX) << MINOR_BITS) | (MINOR_MAX - 1 - p))
    }

    pub(crate) fn from_bits(bits: u64) -> Rank {
        Rank(bits)
    }

    pub(crate) fn to_bits(self) -> u64 {
        self.0
    }
}

/// LRU as a lazy min-heap of `(rank, slot)`: a key's current rank lives in its node, and an
/// entry whose rank is no longer its node's (or whose node left the order) is dropped when it
/// surfaces. A new use is then one push, mostly near the recent end (cheap to sift), instead of
/// a removal and an insertion in an ordered tree.
#[derive(Default)]
pub(super) struct Ranked {
    pub(super) heap: QuadHeap<(Rank, u32)>,
    counter: u64,
    pub(super) live: u32,
}

impl Ranked {
    pub(super) fn next(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    pub(super) fn insert<N: PolicyNode>(&mut self, nodes: &mut [N], i: u32, rank: Rank) {
        nodes[i as usize].set_rank(rank);
        self.heap.push((rank, i));
        self.live += 1;
        // Stale entries are at most twice the live ones (plus slack): rebuilding is linear.
        // A slot freed and taken again at an equal rank leaves equal entries: keep one (a
        // slot's current entries are all equal, its node holding their one rank).
        if self.heap.len() > 2 * self.live as usize + 64 {
            let mut kept = vec![false; nodes.len()];
            let mut current = self.heap.take();
            current.retain(|&e| {
                is_current(nodes, e) && !std::mem::replace(&mut kept[e.1 as usize], true)
            });
            // Gives back what a once larger order held, as the store's metadata bytes count it.
            current.shrink_to_fit();
            self.heap = QuadHeap::from_vec(current);
        }
    }

    /// Leaves the order; its entry goes stale (the caller takes the node out of the list, or
    /// inserts it again with a new rank).
    pub(super) fn remove(&mut self) {
        self.live -= 1;
    }

    /// The `n` first evictable slots in order, the heap as it was otherwise (their entries are
    /// consumed: the caller evicts them).
    pub(super) fn select<N: PolicyNode>(
        &mut self,
        nodes: &[N],
        n: usize,
        evictable: impl Fn(u32) -> bool,
    ) -> Option<Vec<u32>> {
        let mut victims = Vec::with_capacity(n);
        let mut kept = Vec::new();
        let mut last = None;
        while victims.len() < n {
            let Some(entry) = self.heap.pop() else {
                break;
            };
            // A slot freed and taken again at an equal rank can leave a duplicate: they pop in
            // a row.
            if !is_current(nodes, entry) || last == Some(entry) {
                continue;
            }
            last = Some(entry);
            if evictable(entry.1) {
                victims.push(entry.1);
            } else {
                kept.push(entry);
            }
        }
        let found = victims.len() == n;
        if !found {
            kept.extend(victims.iter().map(|&i| (nodes[i as usize].rank(), i)));
        }
        self.heap.extend(kept);
        found.then_some(victims)
    }

    /// The current entries, first to leave first.
    pub(super) fn sorted<N: PolicyNode>(&self, nodes: &[N]) -> Vec<(Rank, u32)> {
        let mut out: Vec<_> = self
            .heap
            .iter()
            .copied()
            .filter(|&e| is_current(nodes, e))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.heap.capacity() * core::mem::size_of::<(Rank, u32)>()
    }
}

fn is_current<N: PolicyNode>(nodes: &[N], (rank, i): (Rank, u32)) -> bool {
    let node = &nodes[i as usize];
    node.list() != NO_LIST && node.rank() == rank
}

#[cfg(test)]
mod tests {
    use super::Rank;

    #[test]
    fn rank_order() {
        // Within a request, tails leave first; the request's keys sit between older and newer
        // draws; positions past the minor range tie instead of wrapping.
        assert!(Rank::at(5, 3) < Rank::at(5, 0));
        assert!(Rank::at(5, 0) < Rank::plain(5));
        assert!(Rank::plain(4) < Rank::at(5, 1 << 30));
        assert!(Rank::at(5, 0) < Rank::plain(6));
        assert_eq!(Rank::at(5, 1 << 30), Rank::at(5, i64::MAX));
        assert_eq!(Rank::at(5, -3), Rank::at(5, 0));
        assert_eq!(Rank::plain(u64::MAX), Rank::plain(1 << 41));
    }
}
