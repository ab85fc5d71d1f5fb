//! `QuadHeap`: a min-heap with four children per node. LRU's eviction order pops tens of
//! thousands of entries a run from a heap of tens of thousands, each pop a walk from the root to
//! a leaf that misses the cache at every level: four children per node halve the levels (and
//! the four sit side by side), at a few more comparisons per level.

#[derive(Debug, Clone)]
pub(crate) struct QuadHeap<T> {
    items: Vec<T>,
}

impl<T> Default for QuadHeap<T> {
    fn default() -> Self {
        QuadHeap { items: Vec::new() }
    }
}

impl<T: Ord + Copy> QuadHeap<T> {
    /// A heap of `items`, in linear time.
    pub(crate) fn from_vec(items: Vec<T>) -> Self {
        let mut heap = QuadHeap { items };
        for i in (0..heap.items.len().div_ceil(4)).rev() {
            heap.sift_down(i);
        }
        heap
    }

    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.items.capacity()
    }

    /// The entries, in no particular order.
    pub(crate) fn iter(&self) -> core::slice::Iter<'_, T> {
        self.items.iter()
    }

    /// Empties the heap, handing over its entries in no particular order.
    pub(crate) fn take(&mut self) -> Vec<T> {
        std::mem::take(&mut self.items)
    }

    pub(crate) fn push(&mut self, item: T) {
        self.items.push(item);
        let mut i = self.items.len() - 1;
        while i > 0 {
            let parent = (i - 1) / 4;
            if self.items[parent] <= item {
                break;
            }
            self.items[i] = self.items[parent];
            i = parent;
        }
        self.items[i] = item;
    }

    /// The smallest entry, taken out.
    pub(crate) fn pop(&mut self) -> Option<T> {
        let last = self.items.pop()?;
        if self.items.is_empty() {
            return Some(last);
        }
        let top = std::mem::replace(&mut self.items[0], last);
        self.sift_down(0);
        Some(top)
    }

    fn sift_down(&mut self, mut i: usize) {
        let n = self.items.len();
        let item = self.items[i];
        loop {
            let first = 4 * i + 1;
            if first >= n {
                break;
            }
            let mut least = first;
            for c in first + 1..(first + 4).min(n) {
                if self.items[c] < self.items[least] {
                    least = c;
                }
            }
            if self.items[least] >= item {
                break;
            }
            self.items[i] = self.items[least];
            i = least;
        }
        self.items[i] = item;
    }
}

impl<T: Ord + Copy> Extend<T> for QuadHeap<T> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        for item in iter {
            self.push(item);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::cmp::Reverse;
    use proptest::prelude::*;
    use std::collections::BinaryHeap;

    #[test]
    fn pops_in_order_with_duplicates() {
        let mut heap = QuadHeap::from_vec(vec![5, 1, 9, 1, 7, 3, 3, 8, 2, 6, 4]);
        heap.push(0);
        heap.push(10);
        let mut out = Vec::new();
        while let Some(x) = heap.pop() {
            out.push(x);
        }
        assert_eq!(out, vec![0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(heap.pop(), None);
        assert_eq!(heap.len(), 0);
    }

    #[test]
    fn take_hands_over_every_entry() {
        let mut heap = QuadHeap::default();
        heap.extend([4, 2, 2]);
        let mut all = heap.take();
        all.sort_unstable();
        assert_eq!(all, vec![2, 2, 4]);
        assert_eq!(heap.len(), 0);
    }

    proptest! {
        /// Any sequence of pushes, pops and rebuilds answers as std's BinaryHeap does.
        #[test]
        fn matches_binary_heap(ops in prop::collection::vec((0u8..4, 0u64..50), 0..400)) {
            let mut ours = QuadHeap::default();
            let mut theirs = BinaryHeap::new();
            for (op, value) in ops {
                match op {
                    0 | 1 => {
                        ours.push((value, op));
                        theirs.push(Reverse((value, op)));
                    }
                    2 => prop_assert_eq!(ours.pop(), theirs.pop().map(|Reverse(x)| x)),
                    _ => ours = QuadHeap::from_vec(ours.take()),
                }
                prop_assert_eq!(ours.len(), theirs.len());
            }
            while let Some(Reverse(x)) = theirs.pop() {
                prop_assert_eq!(ours.pop(), Some(x));
            }
            prop_assert_eq!(ours.pop(), None);
        }
    }
}
