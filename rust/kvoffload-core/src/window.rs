//! Which chunks of a hybrid model's group a store offers (vLLM 0.33's `reachable_block_mask` and
//! `_build_store_jobs`): per block, as pure functions over one group's table.

/// The engine's null block: a window group's table holds it where the group keeps no KV.
pub const NULL_BLOCK: u64 = 0;

/// The blocks a later hit reads of a sliding-window group.
#[derive(Debug, Clone, Copy)]
pub struct WindowReach<'a> {
    /// Blocks before a hit boundary that the hit reads.
    pub need: u64,
    /// Blocks every boundary moves right by (1 for an EAGLE group, whose boundary is a block
    /// later).
    pub shift: u64,
    /// Retained boundaries fall every `segment` blocks from `shift` (`None`: only at `tail_ends`).
    pub segment: Option<u64>,
    /// The block right after each further kept tail (a replay boundary or shared-prefix
    /// junction); may be negative or past the range.
    pub tail_ends: &'a [i64],
}

/// Which of blocks `start..end` a later hit reads: the last `need` blocks of every segment and
/// of every kept tail. `None` when a segment is no longer than `need`, so every block is read.
pub fn reachable_blocks(reach: &WindowReach<'_>, start: u64, end: u64) -> Option<Vec<bool>> {
    let need = reach.need;
    let mut mask = vec![false; end.saturating_sub(start) as usize];
    if let Some(segment) = reach.segment {
        if need >= segment {
            return None;
        }
        for (m, block) in mask.iter_mut().zip(start..end) {
            *m = block >= reach.shift && (block - reach.shift) % segment >= segment - need;
        }
    }
    let need = i64::try_from(need).unwrap_or(i64::MAX);
    let (lo_all, hi_all) = (start as i64, end as i64);
    for &tail_end in reach.tail_ends {
        let lo = lo_all.max(tail_end.saturating_sub(need));
        let hi = hi_all.min(tail_end);
        for block in lo..hi {
            mask[(block - lo_all) as usize] = true;
        }
    }
    Some(mask)
}

/// The chunks of `table` (whole chunks of `blocks_per_chunk` blocks, starting at block
/// `first_block` of the group) that a store offers, as offsets from the table's first chunk.
/// A chunk qualifies when its last block is live and, for a window group (`reach`), when a later
/// hit reads one of its blocks and none of those it reads is null; without `reach`, when all its
/// blocks are live.
pub fn offered_chunks(
    table: &[u64],
    first_block: u64,
    blocks_per_chunk: usize,
    reach: Option<&WindowReach<'_>>,
) -> Vec<u64> {
    let bpc = blocks_per_chunk.max(1);
    let end = first_block + table.len() as u64;
    let mask = reach.and_then(|r| reachable_blocks(r, first_block, end));
    table
        .chunks_exact(bpc)
        .enumerate()
        .filter(|&(c, blocks)| {
            if blocks[bpc - 1] == NULL_BLOCK {
                return false;
            }
            match &mask {
                Some(mask) => {
                    let reads = &mask[c * bpc..(c + 1) * bpc];
                    reads.iter().any(|&r| r)
                        && !blocks
                            .iter()
                            .zip(reads)
                            .any(|(&b, &r)| r && b == NULL_BLOCK)
                }
                None => blocks.iter().all(|&b| b != NULL_BLOCK),
            }
        })
        .map(|(c, _)| c as u64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reach(need: u64, shift: u64, segment: Option<u64>, tail_ends: &[i64]) -> WindowReach<'_> {
        WindowReach {
            need,
            shift,
            segment,
            tail_ends,
        }
    }

    fn marked(mask: &[bool]) -> Vec<usize> {
        (0..mask.len()).filter(|&i| mask[i]).collect()
    }

    #[test]
    fn segments_keep_their_last_blocks() {
        let m = reachable_blocks(&reach(2, 0, Some(4), &[]), 0, 10).unwrap();
        assert_eq!(marked(&m), [2, 3, 6, 7]);
        // Shifted a block right, and read from block 5 on.
        let m = reachable_blocks(&reach(2, 1, Some(4), &[]), 5, 12).unwrap();
        assert_eq!(marked(&m), [2, 3, 6]); // blocks 7, 8 and 11
        assert!(reachable_blocks(&reach(4, 0, Some(4), &[]), 0, 8).is_none());
    }

    #[test]
    fn tails_are_clipped_to_the_range() {
        let m = reachable_blocks(&reach(3, 0, None, &[2, 9, 40, -3]), 1, 8).unwrap();
        assert_eq!(marked(&m), [0, 5, 6]); // blocks 1, 6 and 7
        assert_eq!(
            reachable_blocks(&reach(3, 0, None, &[]), 4, 4),
            Some(vec![])
        );
    }

    #[test]
    fn chunks_need_a_live_read_block_and_no_null_read_one() {
        // Chunks of 2 blocks from block 4: (4,5) (6,7) (8,9) (10,11); blocks 7 and 9..11 read.
        let r = reach(1, 0, None, &[8, 10, 12]);
        let table = [41, 42, 0, 44, 45, 46, 47, 0];
        assert_eq!(offered_chunks(&table, 4, 2, Some(&r)), [1, 2]);
        // Block 8 (null) is read: chunk 2 is out; chunk 3 ends with a null block.
        let r = reach(2, 0, None, &[10]);
        let table = [41, 42, 43, 44, 0, 46, 47, 48];
        assert_eq!(offered_chunks(&table, 4, 2, Some(&r)), Vec::<u64>::new());
    }

    #[test]
    fn without_a_window_every_live_chunk_is_offered() {
        assert_eq!(offered_chunks(&[1, 2, 0, 4, 5, 6], 0, 2, None), [0, 2]);
        assert_eq!(offered_chunks(&[1, 2, 3, 0], 0, 2, None), [0]);
        // Every block read: the same as without a window.
        let r = reach(4, 0, Some(4), &[]);
        assert_eq!(offered_chunks(&[1, 2, 0, 4], 0, 2, Some(&r)), [0]);
    }
}
