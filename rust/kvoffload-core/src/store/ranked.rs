//! Where a request's keys sort in LRU order: its rank, and each key's position in it.

use super::Store;
use crate::error::{Error, Result};
use crate::policy::Rank;

/// Where one call's keys belong in LRU order: they are used by the request of `rank` (from
/// `Store::new_rank`), each at its position in that request. Ignored under ARC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankedBatch<'a> {
    pub rank: u64,
    pub positions: Positions<'a>,
}

/// The positions of a call's keys in their request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Positions<'a> {
    /// Key `j` is at `first + j`.
    From(i64),
    /// Key `j` is at `each[j]` (one per key); a negative value means the key has no position: a
    /// new key then takes a plain use of its own, and a resident one is left where it is.
    Each(&'a [i64]),
}

impl RankedBatch<'_> {
    pub(super) fn rank_at(batch: Option<RankedBatch<'_>>, j: usize) -> Option<Rank> {
        let b = batch?;
        let position = match b.positions {
            Positions::From(first) => first.saturating_add(j as i64),
            Positions::Each(each) => each[j],
        };
        (position >= 0).then(|| Rank::at(b.rank, position))
    }

    pub(super) fn check(batch: Option<RankedBatch<'_>>, num_keys: usize) -> Result<()> {
        match batch.map(|b| b.positions) {
            Some(Positions::Each(each)) if each.len() != num_keys => Err(Error::InvalidArgument {
                name: "positions",
                value: format!("<{} values for {num_keys} keys>", each.len()),
                allowed: "one position per key",
            }),
            _ => Ok(()),
        }
    }
}

impl Store {
    /// A new request rank: its keys (stored or loaded with it) sort as one group, tails first,
    /// older than every rank or use after it (see `RankedBatch`).
    pub fn new_rank(&mut self) -> u64 {
        self.policy.new_rank()
    }
}
