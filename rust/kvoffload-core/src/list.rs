//! Intrusive doubly-linked lists over a slab of nodes addressed by `u32` index: O(1) move-to-MRU
//! and unlink with no per-node allocation, which keeps an index entry small.

pub(crate) const NIL: u32 = u32::MAX;

pub(crate) trait Linked {
    fn prev(&self) -> u32;
    fn next(&self) -> u32;
    fn set_prev(&mut self, v: u32);
    fn set_next(&mut self, v: u32);
}

/// One list: `head` is the least recently used end, `tail` the most recently used end.
#[derive(Debug, Clone, Copy)]
pub(crate) struct List {
    pub(crate) head: u32,
    pub(crate) tail: u32,
    pub(crate) len: u32,
}

impl Default for List {
    fn default() -> Self {
        List {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl List {
    pub(crate) fn push_mru<N: Linked>(&mut self, nodes: &mut [N], i: u32) {
        let node = &mut nodes[i as usize];
        node.set_prev(self.tail);
        node.set_next(NIL);
        if self.tail == NIL {
            self.head = i;
        } else {
            nodes[self.tail as usize].set_next(i);
        }
        self.tail = i;
        self.len += 1;
    }

    pub(crate) fn unlink<N: Linked>(&mut self, nodes: &mut [N], i: u32) {
        let (prev, next) = (nodes[i as usize].prev(), nodes[i as usize].next());
        if prev == NIL {
            self.head = next;
        } else {
            nodes[prev as usize].set_next(next);
        }
        if next == NIL {
            self.tail = prev;
        } else {
            nodes[next as usize].set_prev(prev);
        }
        self.len -= 1;
    }

    /// Iterates from the least recently used end.
    pub(crate) fn iter<'a, N: Linked>(&self, nodes: &'a [N]) -> Iter<'a, N> {
        Iter {
            nodes,
            cur: self.head,
        }
    }
}

pub(crate) struct Iter<'a, N> {
    nodes: &'a [N],
    cur: u32,
}

impl<N: Linked> Iterator for Iter<'_, N> {
    type Item = u32;
    fn next(&mut self) -> Option<u32> {
        if self.cur == NIL {
            return None;
        }
        let i = self.cur;
        self.cur = self.nodes[i as usize].next();
        Some(i)
    }
}
