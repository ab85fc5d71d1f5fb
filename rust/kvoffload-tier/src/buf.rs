//! Raw memory lent by the caller to a store or load job, and the check that a load's
//! destinations are disjoint.

/// Raw memory the caller lends to a store job.
#[derive(Debug)]
pub struct RawBuf {
    ptr: *const u8,
    len: usize,
}

/// Raw memory the caller lends to a load job.
#[derive(Debug)]
pub struct RawBufMut {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the creator promised (in `new`) that the memory stays valid, and for loads untouched,
// until the job completes; the job reads or writes it from one worker thread at a time.
unsafe impl Send for RawBuf {}
unsafe impl Send for RawBufMut {}

impl RawBuf {
    /// # Safety
    /// `ptr..ptr+len` must be readable and stay valid and unchanged until the job that takes this
    /// buffer has its completion returned (by `poll`, `wait` or `drain`), or the tier is dropped.
    pub unsafe fn new(ptr: *const u8, len: usize) -> RawBuf {
        RawBuf { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn slice(&self) -> &[u8] {
        // SAFETY: guaranteed by the contract of `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl RawBufMut {
    /// # Safety
    /// `ptr..ptr+len` must be writable, and nothing else may read or write it, until the job that
    /// takes this buffer has its completion returned, or the tier is dropped. The items of one
    /// load must not overlap either; `Tier::submit_load` checks that one.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawBufMut {
        RawBufMut { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn slice_mut(&mut self) -> &mut [u8] {
        // SAFETY: guaranteed by the contract of `new`; `&mut self` keeps this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// The first pair of items (by index, lower first) whose destinations share a byte, if any.
/// Two `RawBufMut` over one byte would be two live `&mut` slices of it: undefined behaviour, and
/// in practice one item's bytes overwritten by the other's while both report OK.
pub fn first_overlap<K>(items: &[(K, RawBufMut)]) -> Option<(usize, usize)> {
    let mut spans: Vec<(usize, usize, usize)> = items
        .iter()
        .enumerate()
        .map(|(i, (_, b))| (b.ptr as usize, b.ptr as usize + b.len, i))
        .collect();
    spans.sort_unstable();
    // The span reaching furthest so far: a long one may cover several that start after it.
    let mut reach: Option<(usize, usize)> = None;
    for &(start, end, i) in &spans {
        if let Some((far, j)) = reach {
            if start < far {
                return Some((i.min(j), i.max(j)));
            }
        }
        match reach {
            Some((far, _)) if far >= end => {}
            _ => reach = Some((end, i)),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(mem: &mut [u8], spans: &[(usize, usize)]) -> Vec<((), RawBufMut)> {
        let base = mem.as_mut_ptr();
        // SAFETY: never dereferenced; only the addresses are compared.
        spans
            .iter()
            .map(|&(off, len)| ((), unsafe { RawBufMut::new(base.add(off), len) }))
            .collect()
    }

    #[test]
    fn overlaps_are_found_whatever_the_order() {
        let mut mem = vec![0u8; 64];
        assert_eq!(
            first_overlap(&items(&mut mem, &[(0, 8), (8, 8), (16, 8)])),
            None
        );
        assert_eq!(
            first_overlap(&items(&mut mem, &[(16, 8), (0, 8), (8, 8)])),
            None
        );
        assert_eq!(
            first_overlap(&items(&mut mem, &[(0, 8), (4, 8)])),
            Some((0, 1))
        );
        assert_eq!(
            first_overlap(&items(&mut mem, &[(20, 8), (0, 8), (20, 8)])),
            Some((0, 2))
        );
        // A long span covering a later one that does not touch its neighbour.
        let spans = [(0, 40), (10, 2), (30, 2)];
        assert_eq!(first_overlap(&items(&mut mem, &spans)), Some((0, 1)));
        assert_eq!(first_overlap::<()>(&[]), None);
    }
}
