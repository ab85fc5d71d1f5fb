//! A hybrid model's load of one request: each group from its first live block (`load_parts`),
//! its keys gathered in group order (`range_batch`), and the pins that hold them meanwhile.

use crate::error::{Error, Result};
use crate::groups::{load_parts, range_batch, GroupBatch};
use crate::keybuf::KeyBuf;
use crate::store::{Positions, RankedBatch, Store};
use std::ops::Range;

/// A hybrid model's load of GPU blocks `first_block..num_blocks` up to chunk `end_chunk`.
#[derive(Debug, Clone, Copy)]
pub struct GroupLoadAsk<'a> {
    /// Each group's chunk keys, from chunk 0.
    pub keys: &'a [&'a KeyBuf],
    /// Each group's blocks `first_block..num_blocks` of its table: the blocks the load writes,
    /// the null block (0) before a window group's first live one.
    pub blocks: &'a [&'a [u64]],
    pub first_block: u64,
    pub num_blocks: u64,
    /// The chunk of block `num_blocks - 1`, plus one.
    pub end_chunk: u64,
    pub blocks_per_chunk: u64,
}

/// One loading group's part of a `GroupLoad`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedGroup {
    pub group: u32,
    /// Its chunks, one slot each.
    pub chunks: Range<u64>,
    /// The GPU blocks it writes, the first of them block `skip_leading_blocks` of chunk
    /// `chunks.start`.
    pub num_blocks: u64,
    pub skip_leading_blocks: u64,
}

impl LoadedGroup {
    pub fn num_slots(&self) -> u64 {
        self.chunks.end.saturating_sub(self.chunks.start)
    }
}

/// What a hybrid model's load reads and writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupLoad {
    /// The loading groups' keys, group by group; their positions rank them for the pins.
    pub batch: GroupBatch,
    /// The GPU blocks the keys are loaded into, in key order.
    pub gpu_blocks: Vec<u64>,
    /// The loading groups, in group order.
    pub parts: Vec<LoadedGroup>,
}

/// The keys and GPU blocks of `ask`: each group whose blocks are not all null loads from its
/// first live block to `end_chunk`.
pub fn group_load(ask: &GroupLoadAsk<'_>) -> Result<GroupLoad> {
    check_ask(ask)?;
    let parts = load_parts(ask.blocks, ask.first_block, ask.blocks_per_chunk)?;
    let ranges: Vec<(u32, &KeyBuf, u64, u64)> = parts
        .iter()
        .map(|p| {
            let keys = ask.keys[p.group as usize];
            (p.group, keys, p.first_chunk, ask.end_chunk)
        })
        .collect();
    let batch = range_batch(&ranges, ask.keys.len() as u32)?;
    let gpu_blocks = parts
        .iter()
        .flat_map(|p| {
            let blocks = ask.blocks[p.group as usize];
            &blocks[blocks.len() - p.num_blocks as usize..]
        })
        .copied()
        .collect();
    let parts = parts
        .iter()
        .map(|p| LoadedGroup {
            group: p.group,
            chunks: p.first_chunk..ask.end_chunk,
            num_blocks: p.num_blocks,
            skip_leading_blocks: p.skip_leading_blocks,
        })
        .collect();
    Ok(GroupLoad {
        batch,
        gpu_blocks,
        parts,
    })
}

fn check_ask(ask: &GroupLoadAsk<'_>) -> Result<()> {
    let (first, num, bpc) = (ask.first_block, ask.num_blocks, ask.blocks_per_chunk);
    if ask.keys.len() != ask.blocks.len()
        || bpc == 0
        || first > num
        || num.div_ceil(bpc) != ask.end_chunk
    {
        return Err(Error::InvalidArgument {
            name: "load",
            value: format!(
                "<{} key lists, {} tables, blocks {first}..{num}, blocks_per_chunk={bpc}, \
                 end_chunk={}>",
                ask.keys.len(),
                ask.blocks.len(),
                ask.end_chunk
            ),
            allowed: "one table per key list, a block range, blocks_per_chunk >= 1, the chunk \
                      of the last block + 1",
        });
    }
    match ask
        .blocks
        .iter()
        .position(|b| b.len() as u64 != num - first)
    {
        Some(g) => Err(Error::InvalidArgument {
            name: "blocks",
            value: format!("<{} for group {g}>", ask.blocks[g].len()),
            allowed: "the load's blocks first_block..num_blocks of every group",
        }),
        None => Ok(()),
    }
}

impl Store {
    /// Pins a load's keys (every one ready) in request `rank`'s eviction order and returns their
    /// slots; with `touch`, they are also used again (ARC's frequent list).
    pub fn pin_group_load(&mut self, load: &GroupLoad, rank: u64, touch: bool) -> Result<Vec<u32>> {
        let keys = load.batch.keys.slices(0, load.batch.keys.len());
        let ranked = Some(RankedBatch {
            rank,
            positions: Positions::Each(&load.batch.positions),
        });
        let slots = self.prepare_load_ranked(&keys, ranked)?;
        if touch {
            self.touch(&keys, true)?;
        }
        Ok(slots)
    }

    /// Undoes `pin_group_load` for a caller that cannot run the load.
    pub fn unpin_group_load(&mut self, load: &GroupLoad) -> Result<()> {
        self.complete_load(&load.batch.keys.slices(0, load.batch.keys.len()))
    }
}
