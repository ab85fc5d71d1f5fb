//! A hybrid model's store batches across its KV-cache groups (the Python `HybridPlanner`): one
//! pass per request and step, where a numpy round trip per group cost more than the store's own
//! work.

use crate::error::{Error, Result};
use crate::keybuf::KeyBuf;
use crate::window::{offered_chunks, WindowReach, NULL_BLOCK};

/// One group's part of a store offer.
#[derive(Debug, Clone, Copy)]
pub struct GroupOffer<'a> {
    pub group: u32,
    /// The group's chunk keys, from its first chunk.
    pub keys: &'a KeyBuf,
    /// The group's blocks of chunks `first_chunk..`, whole chunks up to its storable end.
    pub table: &'a [u64],
    pub first_chunk: u64,
    /// A sliding-window group's reach (`offered_chunks`).
    pub reach: Option<WindowReach<'a>>,
}

/// Keys picked from a request's groups, in group order (chunk order within a group).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupBatch {
    pub keys: KeyBuf,
    pub groups: Vec<u32>,
    pub chunks: Vec<u64>,
    /// Each key's place in its request's eviction order: `chunk * groups + (groups - 1 -
    /// group)`, so that of one chunk's keys the smaller group index leaves first (vLLM ranks
    /// them by key bytes, which end with the group index).
    pub positions: Vec<i64>,
}

/// The chunks each group offers (`offered_chunks`), with their keys and positions; `num_groups`
/// is the model's group count.
pub fn offer_batch(
    offers: &[GroupOffer<'_>],
    blocks_per_chunk: usize,
    num_groups: u32,
) -> Result<GroupBatch> {
    let most = offers
        .iter()
        .map(|o| o.table.len() / blocks_per_chunk.max(1));
    let mut batch = GroupBatch::with_capacity(most.sum(), offers.first().map(|o| o.keys));
    for offer in offers {
        let chosen = offered_chunks(
            offer.table,
            offer.first_chunk * blocks_per_chunk as u64,
            blocks_per_chunk,
            offer.reach.as_ref(),
        );
        for c in chosen {
            batch.push(offer.group, offer.keys, offer.first_chunk + c, num_groups)?;
        }
    }
    Ok(batch)
}

/// Chunks `first..end` of each `(group, keys, first, end)`, in that order, with their
/// positions (`GroupBatch`); `num_groups` is the model's group count.
pub fn range_batch(ranges: &[(u32, &KeyBuf, u64, u64)], num_groups: u32) -> Result<GroupBatch> {
    let n = ranges
        .iter()
        // Only keys that exist: a range past them is refused below.
        .map(|r| r.3.min(r.1.len() as u64).saturating_sub(r.2) as usize)
        .sum();
    let mut batch = GroupBatch::with_capacity(n, ranges.first().map(|r| r.1));
    for &(group, keys, first, end) in ranges {
        for chunk in first..end {
            batch.push(group, keys, chunk, num_groups)?;
        }
    }
    Ok(batch)
}

/// One group's part of a load: chunks `first_chunk..` up to the load's end, written into
/// `num_blocks` GPU blocks, the first of them block `skip_leading_blocks` of chunk
/// `first_chunk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadPart {
    pub group: u32,
    pub first_chunk: u64,
    pub num_blocks: u64,
    pub skip_leading_blocks: u64,
}

/// A load's part of each group whose blocks `first_block..` (`fresh[g]`, up to the load's last
/// block) are not all the null block: from its first live block (a window group allocates only
/// its window) on. A null block after a live one is refused: the load would write it.
pub fn load_parts(
    fresh: &[&[u64]],
    first_block: u64,
    blocks_per_chunk: u64,
) -> Result<Vec<LoadPart>> {
    let mut parts = Vec::with_capacity(fresh.len());
    for (g, blocks) in fresh.iter().enumerate() {
        let Some(nulls) = blocks.iter().position(|&b| b != NULL_BLOCK) else {
            continue;
        };
        if let Some(i) = blocks[nulls..].iter().position(|&b| b == NULL_BLOCK) {
            let end = first_block + blocks.len() as u64 - 1;
            return Err(Error::InvalidArgument {
                name: "block_ids",
                value: format!(
                    "<group {g} has the null block (0) at block {}, among the blocks {}..{end} \
                     the load writes>",
                    first_block + (nulls + i) as u64,
                    first_block + nulls as u64,
                ),
                allowed: "null blocks only before a window",
            });
        }
        let start = first_block + nulls as u64;
        parts.push(LoadPart {
            group: g as u32,
            first_chunk: start / blocks_per_chunk,
            num_blocks: (blocks.len() - nulls) as u64,
            skip_leading_blocks: start % blocks_per_chunk,
        });
    }
    Ok(parts)
}

/// The keys of the chunks each group's `used` flags (one byte per chunk from chunk 0, nonzero:
/// used; chunks past its end are not), by chunk, then group: the order vLLM refreshes a
/// finished request's keys in.
pub fn used_keys<'a>(groups: &[(&'a KeyBuf, &[u8])]) -> Result<Vec<&'a [u8]>> {
    let chunks = groups.iter().map(|(_, used)| used.len()).max().unwrap_or(0);
    let mut keys = Vec::with_capacity(groups.iter().map(|(k, _)| k.len()).sum());
    for chunk in 0..chunks {
        for (g, (buf, used)) in groups.iter().enumerate() {
            if used.get(chunk).is_some_and(|&u| u != 0) {
                keys.push(buf.get(chunk).ok_or_else(|| Error::InvalidArgument {
                    name: "used",
                    value: format!("<chunk {chunk} of group {g}>"),
                    allowed: "chunks the group has keys for",
                })?);
            }
        }
    }
    Ok(keys)
}

impl GroupBatch {
    /// Room for `n` keys as long as the first of `keys`.
    fn with_capacity(n: usize, keys: Option<&KeyBuf>) -> Self {
        let key_len = keys.and_then(|k| k.get(0)).map_or(0, <[u8]>::len);
        GroupBatch {
            keys: KeyBuf::with_capacity(n, key_len),
            groups: Vec::with_capacity(n),
            chunks: Vec::with_capacity(n),
            positions: Vec::with_capacity(n),
        }
    }

    fn push(&mut self, group: u32, keys: &KeyBuf, chunk: u64, num_groups: u32) -> Result<()> {
        let key = usize::try_from(chunk)
            .ok()
            .and_then(|i| keys.get(i))
            .ok_or_else(|| Error::InvalidArgument {
                name: "chunks",
                value: format!("<chunk {chunk} of group {group}>"),
                allowed: "chunks the group has keys for",
            })?;
        let n = i64::from(num_groups);
        self.keys.push_unchecked(key);
        self.groups.push(group);
        self.chunks.push(chunk);
        self.positions
            .push(chunk as i64 * n + (n - 1 - i64::from(group)));
        Ok(())
    }
}

/// What a store job of a hybrid model reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreBlocks {
    /// The GPU blocks of every planned key, in plan order.
    pub blocks: Vec<u64>,
    /// How many planned keys each group has.
    pub counts: Vec<u32>,
    /// The live blocks of window groups among `blocks`: the engine may hand them out again while
    /// their request still runs.
    pub window_blocks: Vec<u64>,
}

/// The blocks of the offered keys at `indices` (a store plan's; key `i` is chunk `chunks[i]` of
/// group `groups[i]`), read from each group's `tables` entry `(first_chunk, blocks)`: its blocks
/// from chunk `first_chunk` on; `windowed` says which groups free blocks while their request
/// runs.
pub fn store_blocks(
    groups: &[u32],
    chunks: &[u64],
    indices: &[u32],
    tables: &[(u64, &[u64])],
    windowed: &[bool],
    blocks_per_chunk: usize,
) -> Result<StoreBlocks> {
    let bpc = blocks_per_chunk;
    let mut out = StoreBlocks {
        blocks: Vec::with_capacity(indices.len() * bpc),
        counts: vec![0; tables.len()],
        window_blocks: Vec::new(),
    };
    for &i in indices {
        let (Some(&g), Some(&chunk)) = (groups.get(i as usize), chunks.get(i as usize)) else {
            return Err(Error::InvalidArgument {
                name: "indices",
                value: format!("<{i} for {} keys>", groups.len().min(chunks.len())),
                allowed: "positions of offered keys",
            });
        };
        let g = g as usize;
        let blocks = tables
            .get(g)
            .and_then(|&(first_chunk, t)| {
                let first = usize::try_from(chunk.checked_sub(first_chunk)?)
                    .ok()?
                    .checked_mul(bpc)?;
                t.get(first..first.checked_add(bpc)?)
            })
            .ok_or_else(|| Error::InvalidArgument {
                name: "tables",
                value: format!("<chunk {chunk} of group {g}>"),
                allowed: "tables holding every planned chunk's blocks",
            })?;
        out.blocks.extend_from_slice(blocks);
        out.counts[g] += 1;
        if windowed.get(g).copied().unwrap_or(false) {
            out.window_blocks
                .extend(blocks.iter().filter(|&&b| b != NULL_BLOCK));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(group: u8, n: u8) -> KeyBuf {
        let keys: Vec<Vec<u8>> = (0..n).map(|c| vec![group, c]).collect();
        KeyBuf::from_keys(&keys).unwrap()
    }

    #[test]
    fn offers_live_chunks_in_group_order_with_positions() {
        let (full, window) = (keys(0, 5), keys(1, 4));
        let reach = WindowReach {
            need: 1,
            shift: 0,
            segment: None,
            tail_ends: &[4],
        };
        let mut offers = [
            GroupOffer {
                group: 0,
                keys: &full,
                table: &[5, 6, 0, 8],
                first_chunk: 1,
                reach: None,
            },
            GroupOffer {
                group: 1,
                keys: &window,
                table: &[0, 0, 7],
                first_chunk: 1,
                reach: Some(reach),
            },
        ];
        let batch = offer_batch(&offers, 1, 2).unwrap();
        let want: Vec<Vec<u8>> = vec![vec![0, 1], vec![0, 2], vec![0, 4], vec![1, 3]];
        assert_eq!(batch.keys.to_vecs(), want);
        assert_eq!(batch.groups, [0, 0, 0, 1]);
        assert_eq!(batch.chunks, [1, 2, 4, 3]);
        assert_eq!(batch.positions, [3, 5, 9, 6]);

        let blocks = store_blocks(
            &batch.groups,
            &batch.chunks,
            &[1, 3],
            &[(1, &[5, 6, 0, 8]), (1, &[0, 0, 7])],
            &[false, true],
            1,
        )
        .unwrap();
        assert_eq!(blocks.blocks, [6, 7]);
        assert_eq!(blocks.counts, [1, 1]);
        assert_eq!(blocks.window_blocks, [7]);
        // Two blocks a chunk, a table from chunk 2: chunk 3 is its blocks 2 and 3.
        let two = store_blocks(&[0], &[3], &[0], &[(2, &[1, 2, 3, 4])], &[true], 2).unwrap();
        assert_eq!((two.blocks, two.window_blocks), (vec![3, 4], vec![3, 4]));
        // A chunk before its group's table is refused.
        assert!(store_blocks(&[0], &[1], &[0], &[(2, &[1, 2, 3, 4])], &[true], 2).is_err());

        // A chunk past the group's keys is refused, not read out of range.
        offers[1].keys = &full;
        offers[0].keys = &window;
        assert!(offer_batch(&offers, 1, 2).is_err());
        assert!(store_blocks(
            &batch.groups,
            &batch.chunks,
            &[2],
            &[(0, &[1, 2]), (0, &[])],
            &[false, true],
            1
        )
        .is_err());
        assert!(store_blocks(&[0], &[0], &[1], &[(0, &[1])], &[false], 1).is_err());
    }

    #[test]
    fn used_keys_go_by_chunk_then_group() {
        let (full, window) = (keys(0, 5), keys(1, 4));
        let got = used_keys(&[(&full, &[1, 1, 0, 1]), (&window, &[0, 1, 1])]).unwrap();
        let want: Vec<&[u8]> = vec![&[0, 0], &[0, 1], &[1, 1], &[1, 2], &[0, 3]];
        assert_eq!(got, want);
        assert!(used_keys(&[(&window, &[0, 0, 0, 0, 1])]).is_err());
        // A flag past the group's keys that is not set is no use of it.
        assert_eq!(used_keys(&[(&window, &[0, 0, 0, 0, 0])]).unwrap().len(), 0);
    }

    #[test]
    fn a_load_starts_at_each_group_s_first_live_block() {
        // Blocks 4..8 of three groups, two blocks a chunk: full, a window from block 6, nothing.
        let parts = load_parts(&[&[5, 6, 7, 8], &[0, 0, 9, 10], &[0, 0, 0, 0]], 4, 2).unwrap();
        assert_eq!(
            parts,
            [
                LoadPart {
                    group: 0,
                    first_chunk: 2,
                    num_blocks: 4,
                    skip_leading_blocks: 0
                },
                LoadPart {
                    group: 1,
                    first_chunk: 3,
                    num_blocks: 2,
                    skip_leading_blocks: 0
                },
            ]
        );
        // A window from an odd block skips the first block of its chunk.
        let odd = load_parts(&[&[0, 3, 4]], 5, 2).unwrap();
        assert_eq!((odd[0].first_chunk, odd[0].skip_leading_blocks), (3, 0));
        let odd = load_parts(&[&[0, 0, 4]], 5, 2).unwrap();
        assert_eq!((odd[0].first_chunk, odd[0].skip_leading_blocks), (3, 1));
        assert_eq!(odd[0].num_blocks, 1);
        // A null block among the ones the load writes is refused, naming it.
        let err = load_parts(&[&[1, 2], &[0, 3, 0, 4]], 4, 1).unwrap_err();
        assert!(err
            .to_string()
            .contains("group 1 has the null block (0) at block 6, among the blocks 5..7"));
        assert!(load_parts(&[], 0, 1).unwrap().is_empty());
    }

    #[test]
    fn ranges_keep_their_order() {
        let (full, window) = (keys(0, 5), keys(1, 4));
        let batch = range_batch(&[(1, &window, 2, 4), (0, &full, 3, 5)], 2).unwrap();
        let want: Vec<Vec<u8>> = vec![vec![1, 2], vec![1, 3], vec![0, 3], vec![0, 4]];
        assert_eq!(batch.keys.to_vecs(), want);
        assert_eq!(
            (batch.groups, batch.chunks),
            (vec![1, 1, 0, 0], vec![2, 3, 3, 4])
        );
        assert_eq!(batch.positions, [4, 6, 7, 9]);
        assert!(range_batch(&[(1, &window, 3, 5)], 2).is_err());
    }
}
