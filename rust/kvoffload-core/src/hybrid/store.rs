//! A hybrid model's store of one request, in one call on the store: which offered chunks are a
//! use, the plan, and the GPU blocks its job reads. A plan whose blocks cannot be named is undone
//! before the call returns: no caller could complete its stores.

use crate::error::{Error, Result};
use crate::groups::{store_blocks, GroupBatch, StoreBlocks};
use crate::keybuf::KeyBuf;
use crate::store::{KeyStatus, Positions, RankedBatch, Store};

/// A hybrid model's store offer of one request.
#[derive(Debug, Clone, Copy)]
pub struct GroupStoreOffer<'a> {
    /// The offered keys (`offer_batch`), each at its position in request `rank`.
    pub batch: &'a GroupBatch,
    /// One `(first_chunk, blocks)` per group of the model: its blocks from chunk `first_chunk`
    /// on, which the planned keys are read from (`store_blocks`).
    pub tables: &'a [(u64, &'a [u64])],
    /// Which groups free blocks while their request runs.
    pub windowed: &'a [bool],
    pub blocks_per_chunk: usize,
    /// The request's rank (`Store::new_rank`).
    pub rank: u64,
}

/// What `Store::offer_group_store` answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupStoreOutcome {
    /// Per group, its offered chunks that no other store is writing now, in offer order: a use
    /// of them, even when the offer is refused.
    pub used: Vec<Vec<u64>>,
    /// `None` when the store cannot take the keys now.
    pub plan: Option<GroupStorePlan>,
}

/// An accepted offer: write `keys[i]` (chunk `chunks[i]` of its group) to `slots[i]` from its
/// blocks in `blocks`, then complete the stores of `keys`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupStorePlan {
    /// The keys to write, in offer order.
    pub keys: KeyBuf,
    pub slots: Vec<u32>,
    pub chunks: Vec<u64>,
    pub blocks: StoreBlocks,
}

impl Store {
    /// `lookup_and_prepare_store_ranked` of a hybrid model's offer, with the blocks each planned
    /// key is read from. On an error nothing stays pending (the lookup's counts stay).
    pub fn offer_group_store(&mut self, offer: &GroupStoreOffer<'_>) -> Result<GroupStoreOutcome> {
        let batch = offer.batch;
        check_batch(batch, offer.tables.len())?;
        let keys = batch.keys.slices(0, batch.keys.len());
        let ranked = Some(RankedBatch {
            rank: offer.rank,
            positions: Positions::Each(&batch.positions),
        });
        let (statuses, plan) = self.lookup_and_prepare_store_ranked(&keys, ranked, false)?;
        let mut used = vec![Vec::new(); offer.tables.len()];
        for (i, status) in statuses.into_iter().enumerate() {
            if status != KeyStatus::Pending {
                used[batch.groups[i] as usize].push(batch.chunks[i]);
            }
        }
        let Some(plan) = plan else {
            return Ok(GroupStoreOutcome { used, plan: None });
        };
        let blocks = store_blocks(
            &batch.groups,
            &batch.chunks,
            &plan.indices,
            offer.tables,
            offer.windowed,
            offer.blocks_per_chunk,
        );
        let blocks = match blocks {
            Ok(blocks) => blocks,
            Err(err) => {
                let new: Vec<&[u8]> = plan.indices.iter().map(|&i| keys[i as usize]).collect();
                self.complete_store(&new, false)?;
                return Err(err);
            }
        };
        let plan = GroupStorePlan {
            keys: batch.keys.gather(0, &plan.indices),
            chunks: plan
                .indices
                .iter()
                .map(|&i| batch.chunks[i as usize])
                .collect(),
            slots: plan.slots,
            blocks,
        };
        Ok(GroupStoreOutcome {
            used,
            plan: Some(plan),
        })
    }

    /// Undoes a plan the caller cannot hand out (its job would never complete): its stores
    /// fail, so the keys leave and their slots are free again.
    pub fn withdraw_group_store(&mut self, plan: &GroupStorePlan) -> Result<()> {
        self.complete_store(&plan.keys.slices(0, plan.keys.len()), false)
    }
}

/// A batch `offer_batch` did not make could index past its own vectors or the groups.
fn check_batch(batch: &GroupBatch, num_groups: usize) -> Result<()> {
    let n = batch.keys.len();
    if batch.groups.len() != n || batch.chunks.len() != n {
        return Err(Error::InvalidArgument {
            name: "batch",
            value: format!(
                "<{n} keys, {} groups, {} chunks>",
                batch.groups.len(),
                batch.chunks.len()
            ),
            allowed: "one group and one chunk per key",
        });
    }
    match batch.groups.iter().find(|&&g| g as usize >= num_groups) {
        Some(g) => Err(Error::InvalidArgument {
            name: "batch",
            value: format!("<group {g} for {num_groups} tables>"),
            allowed: "groups with a table each",
        }),
        None => Ok(()),
    }
}
