//! `KeyBuf`: many keys in one contiguous buffer, so a request's chunk keys cost two allocations
//! in all and a batch call borrows them without copying.

use crate::chunk::{positive, GROUP_SUFFIX_LEN};
use crate::error::{Error, Result};
use crate::key::{validate_keys, MAX_KEY_LEN};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyBuf {
    data: Vec<u8>,
    /// `ends[i]` is where key `i` ends in `data`.
    ends: Vec<usize>,
}

impl KeyBuf {
    pub fn new() -> Self {
        KeyBuf::default()
    }

    /// A buffer holding `keys`, each validated (1..=MAX_KEY_LEN bytes).
    pub fn from_keys<K: AsRef<[u8]>>(keys: &[K]) -> Result<Self> {
        let mut buf =
            KeyBuf::with_capacity(keys.len(), keys.first().map_or(0, |k| k.as_ref().len()));
        for k in keys {
            buf.push(k.as_ref())?;
        }
        Ok(buf)
    }

    /// Room for `keys` keys of about `key_len` bytes.
    pub fn with_capacity(keys: usize, key_len: usize) -> Self {
        KeyBuf {
            data: Vec::with_capacity(keys * key_len),
            ends: Vec::with_capacity(keys),
        }
    }

    /// Appends a key after checking its length; the error names its position in the buffer.
    pub fn push(&mut self, key: &[u8]) -> Result<()> {
        validate_keys(&[key]).map_err(|_| Error::InvalidKeyLength {
            index: self.len(),
            len: key.len(),
            max: MAX_KEY_LEN,
        })?;
        self.push_unchecked(key);
        Ok(())
    }

    pub(crate) fn reserve(&mut self, keys: usize, key_len: usize) {
        self.data.reserve(keys * key_len);
        self.ends.reserve(keys);
    }

    /// Appends the key `head + tail` (lengths already checked).
    pub(crate) fn push_concat_unchecked(&mut self, head: &[u8], tail: &[u8]) {
        self.data.extend_from_slice(head);
        self.push_unchecked(tail);
    }

    pub(crate) fn push_unchecked(&mut self, key: &[u8]) {
        self.data.extend_from_slice(key);
        self.ends.push(self.data.len());
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<&[u8]> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Some(&self.data[start..end])
    }

    /// The keys in order.
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> + '_ {
        (0..self.len()).map(|i| self.get(i).expect("in range"))
    }

    /// The keys as owned vectors (for tests and diagnostics).
    pub fn to_vecs(&self) -> Vec<Vec<u8>> {
        self.iter().map(<[u8]>::to_vec).collect()
    }

    /// Borrowed keys `start..end` (clamped to the buffer), in the form every store call takes.
    pub fn slices(&self, start: usize, end: usize) -> Vec<&[u8]> {
        let end = end.min(self.len());
        let mut from = if start == 0 || start > end {
            0
        } else {
            self.ends[start - 1]
        };
        self.ends[start.min(end)..end]
            .iter()
            .map(|&to| {
                let s = &self.data[from..to];
                from = to;
                s
            })
            .collect()
    }

    /// The keys at `indices` (relative to `offset`), in that order.
    pub fn gather(&self, offset: usize, indices: &[u32]) -> KeyBuf {
        let key_len = self.get(0).map_or(0, <[u8]>::len);
        let mut out = KeyBuf::with_capacity(indices.len(), key_len);
        for &i in indices {
            let key = self
                .get(offset + i as usize)
                .expect("gather index in range");
            out.push_unchecked(key);
        }
        out
    }

    /// The chunk keys `extend_chunk_keys` would append for `block_hashes` starting at the
    /// request's block `first_block`, as a buffer of their own (errors name block indices from
    /// `first_block`).
    pub fn chunk_keys<H: AsRef<[u8]>>(
        block_hashes: &[H],
        blocks_per_chunk: usize,
        group_idx: u32,
        first_block: usize,
    ) -> Result<KeyBuf> {
        let mut out = KeyBuf::new();
        append_chunk_keys(
            &mut out,
            block_hashes,
            blocks_per_chunk,
            group_idx,
            first_block,
        )?;
        Ok(out)
    }

    /// Appends `other`'s keys from `start` on.
    pub fn append_from(&mut self, other: &KeyBuf, start: usize) {
        for key in other.slices(start, other.len()) {
            self.push_unchecked(key);
        }
    }

    /// Appends chunk keys for `new_hashes`: a request's block hashes from the first block of the
    /// first chunk this buffer lacks (`self.len() * blocks_per_chunk`) on. Only complete chunks
    /// get a key. Returns how many were added; on error nothing is.
    pub fn extend_chunk_keys<H: AsRef<[u8]>>(
        &mut self,
        new_hashes: &[H],
        blocks_per_chunk: usize,
        group_idx: u32,
    ) -> Result<usize> {
        let before = self.len();
        let first_block = before * blocks_per_chunk;
        append_chunk_keys(self, new_hashes, blocks_per_chunk, group_idx, first_block)?;
        Ok(self.len() - before)
    }
}

/// Appends to `out` the keys of the complete chunks in `block_hashes`, one per chunk: the block
/// hash of the chunk's last GPU block (index `(i+1)*blocks_per_chunk - 1`) followed by the
/// big-endian group index (vLLM's `OffloadKey`). `block_hashes[0]` is the request's block
/// `first_block` (only for error messages). On error `out` is unchanged.
fn append_chunk_keys<H: AsRef<[u8]>>(
    out: &mut KeyBuf,
    block_hashes: &[H],
    blocks_per_chunk: usize,
    group_idx: u32,
    first_block: usize,
) -> Result<()> {
    positive("blocks_per_chunk", blocks_per_chunk as u64)?;
    let num_chunks = block_hashes.len() / blocks_per_chunk;
    let last_blocks = || (0..num_chunks).map(|i| (i + 1) * blocks_per_chunk - 1);
    for index in last_blocks() {
        let len = block_hashes[index].as_ref().len();
        if len == 0 || len + GROUP_SUFFIX_LEN > MAX_KEY_LEN {
            let index = first_block.saturating_add(index);
            return Err(Error::InvalidArgument {
                name: "block_hashes",
                value: format!("an entry of {len} bytes at index {index}"),
                allowed: "block hashes of 1..=60 bytes (60 + 4-byte group index = 64-byte key)",
            });
        }
    }
    let suffix = group_idx.to_be_bytes();
    out.reserve(
        num_chunks,
        block_hashes.first().map_or(0, |h| h.as_ref().len()) + GROUP_SUFFIX_LEN,
    );
    for index in last_blocks() {
        out.push_concat_unchecked(block_hashes[index].as_ref(), &suffix);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_take_the_last_hash_of_each_chunk_plus_group() {
        let hashes: Vec<Vec<u8>> = (0u8..7).map(|i| vec![i; 2]).collect();
        let mut buf = KeyBuf::new();
        append_chunk_keys(&mut buf, &hashes, 3, 1, 0).unwrap();
        assert_eq!(
            buf.slices(0, 9),
            vec![[2u8, 2, 0, 0, 0, 1].as_slice(), &[5, 5, 0, 0, 0, 1]]
        );
        append_chunk_keys(&mut buf, &hashes[3..], 3, 1, 3).unwrap();
        assert_eq!(buf.len(), 3);
        append_chunk_keys(&mut buf, &hashes[5..], 3, 1, 5).unwrap();
        assert_eq!(buf.len(), 3);
        assert!(append_chunk_keys(&mut buf, &hashes, 0, 0, 0).is_err());
        let err = append_chunk_keys(&mut buf, &[vec![0u8; 61]], 1, 0, 40).unwrap_err();
        assert!(
            err.to_string().contains("an entry of 61 bytes at index 40"),
            "{err}"
        );
        assert!(append_chunk_keys(&mut buf, &[vec![0u8; 0]], 1, 0, 0).is_err());
        assert_eq!(buf.len(), 3);
    }

    #[test]
    fn slices_gather_and_get() {
        let buf = KeyBuf::from_keys(&[b"a".as_slice(), b"bb", b"ccc"]).unwrap();
        assert_eq!(buf.slices(0, 3), vec![b"a".as_slice(), b"bb", b"ccc"]);
        assert_eq!(buf.slices(1, 9), vec![b"bb".as_slice(), b"ccc"]);
        assert!(buf.slices(3, 3).is_empty() && buf.slices(5, 2).is_empty());
        assert_eq!(
            buf.gather(1, &[1, 0]).slices(0, 2),
            vec![b"ccc".as_slice(), b"bb"]
        );
        assert_eq!(buf.get(2), Some(b"ccc".as_slice()));
        assert_eq!(buf.get(3), None);
        assert!(KeyBuf::from_keys(&[b"".as_slice()]).is_err());
    }

    #[test]
    fn chunk_keys_extend_only_new_complete_chunks() {
        let hashes: Vec<Vec<u8>> = (0u8..7).map(|i| vec![i; 2]).collect();
        let mut buf = KeyBuf::new();
        assert_eq!(buf.extend_chunk_keys(&hashes[..4], 3, 1).unwrap(), 1);
        assert_eq!(buf.extend_chunk_keys(&hashes[3..5], 3, 1).unwrap(), 0);
        assert_eq!(buf.extend_chunk_keys(&hashes[3..], 3, 1).unwrap(), 1);
        assert!(buf.extend_chunk_keys(&hashes, 0, 1).is_err());
        assert_eq!(
            buf.slices(0, 2),
            vec![[2u8, 2, 0, 0, 0, 1].as_slice(), &[5, 5, 0, 0, 0, 1]]
        );
    }
}
