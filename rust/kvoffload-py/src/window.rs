//! The key batches of a hybrid model's groups: a store's offer (see
//! `kvoffload_core::offer_batch`) and a load's chunk ranges.

use crate::errors::to_py;
use crate::ids::block_vec;
use crate::keys::{new_bytes, KeyList};
use kvoffload_core::{
    offer_batch, range_batch, used_keys, GroupBatch, GroupOffer, KeyBuf, WindowReach,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySet};

/// `(need, shift, segment, tail_ends)` of `WindowReach`.
type Reach = (u64, u64, Option<u64>, Vec<i64>);

fn window_reach(reach: &Reach) -> WindowReach<'_> {
    WindowReach {
        need: reach.0,
        shift: reach.1,
        segment: reach.2,
        tail_ends: &reach.3,
    }
}

/// Which of blocks `start..end` a later hit reads, as one bool per byte; `None`: all of them.
#[pyfunction]
pub fn reachable_blocks<'py>(
    py: Python<'py>,
    start: u64,
    end: u64,
    reach: Reach,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    if start > end {
        return Err(PyValueError::new_err(format!(
            "start={start} is invalid: it is past end={end}"
        )));
    }
    kvoffload_core::reachable_blocks(&window_reach(&reach), start, end)
        .map(|mask| {
            let raw: Vec<u8> = mask.into_iter().map(u8::from).collect();
            new_bytes(py, &raw)
        })
        .transpose()
}

/// One group's part of `group_offer`'s offers.
type Offer<'py> = (
    u32,
    Bound<'py, KeyList>,
    Bound<'py, PyList>,
    u64,
    Option<Reach>,
);
/// What `group_offer` and `group_ranges` answer.
type OfferBatch<'py> = (
    KeyList,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
);

/// A hybrid model's store offer of one request: per offering group `(group, keys, table,
/// first_chunk, reach)`, its blocks of chunks `first_chunk..` (whole chunks), as
/// `kvoffload_core::offer_batch` picks them: `(keys, groups, chunks, positions)`, the last three
/// int64 bytes.
#[pyfunction]
pub fn group_offer<'py>(
    py: Python<'py>,
    offers: Vec<Offer<'py>>,
    blocks_per_chunk: usize,
    num_groups: u32,
) -> PyResult<OfferBatch<'py>> {
    let mut tables = Vec::with_capacity(offers.len());
    for (group, _, table, _, _) in &offers {
        if blocks_per_chunk == 0 || table.len() % blocks_per_chunk != 0 {
            return Err(PyValueError::new_err(format!(
                "table of group {group} has {} blocks, blocks_per_chunk={blocks_per_chunk}: \
                 expected whole chunks",
                table.len()
            )));
        }
        tables.push(block_vec(table, "table")?);
    }
    let guards = offers
        .iter()
        .map(|(_, keys, ..)| keys.get().read())
        .collect::<PyResult<Vec<_>>>()?;
    let parts: Vec<GroupOffer<'_>> = offers
        .iter()
        .zip(&guards)
        .zip(&tables)
        .map(
            |(((group, _, _, first_chunk, reach), keys), table)| GroupOffer {
                group: *group,
                keys,
                table,
                first_chunk: *first_chunk,
                reach: reach.as_ref().map(window_reach),
            },
        )
        .collect();
    let batch = offer_batch(&parts, blocks_per_chunk, num_groups).map_err(to_py)?;
    drop(guards);
    batch_answer(py, batch)
}

/// Chunks `first..end` of each `(group, keys, first, end)`, as `kvoffload_core::range_batch`
/// gathers them: `(keys, groups, chunks, positions)`, the last three int64 bytes.
#[pyfunction]
pub fn group_ranges<'py>(
    py: Python<'py>,
    ranges: Vec<(u32, Bound<'py, KeyList>, u64, u64)>,
    num_groups: u32,
) -> PyResult<OfferBatch<'py>> {
    let guards = ranges
        .iter()
        .map(|(_, keys, ..)| keys.get().read())
        .collect::<PyResult<Vec<_>>>()?;
    let parts: Vec<(u32, &KeyBuf, u64, u64)> = ranges
        .iter()
        .zip(&guards)
        .map(|((group, _, first, end), keys)| (*group, &**keys, *first, *end))
        .collect();
    let batch = range_batch(&parts, num_groups).map_err(to_py)?;
    drop(guards);
    batch_answer(py, batch)
}

/// The keys of each `(keys, chunks)` group's chunks (a set of ints), by chunk, then group (see
/// `kvoffload_core::used_keys`).
#[pyfunction]
pub fn group_used_keys(groups: Vec<(Bound<'_, KeyList>, Bound<'_, PySet>)>) -> PyResult<KeyList> {
    let chunks = groups
        .iter()
        .map(|(_, set)| set.iter().map(|c| c.extract::<u64>()).collect())
        .collect::<PyResult<Vec<Vec<u64>>>>()?;
    let guards = groups
        .iter()
        .map(|(keys, _)| keys.get().read())
        .collect::<PyResult<Vec<_>>>()?;
    let parts: Vec<(&KeyBuf, &[u64])> = groups
        .iter()
        .zip(&guards)
        .zip(&chunks)
        .map(|((_, keys), chunks)| (&**keys, chunks.as_slice()))
        .collect();
    Ok(KeyList::from_buf(used_keys(&parts).map_err(to_py)?))
}

fn batch_answer(py: Python<'_>, batch: GroupBatch) -> PyResult<OfferBatch<'_>> {
    let groups: Vec<u8> = batch
        .groups
        .iter()
        .flat_map(|&g| i64::from(g).to_ne_bytes())
        .collect();
    let chunks: Vec<u8> = batch
        .chunks
        .iter()
        .flat_map(|&c| (c as i64).to_ne_bytes())
        .collect();
    let positions: Vec<u8> = batch
        .positions
        .iter()
        .flat_map(|p| p.to_ne_bytes())
        .collect();
    Ok((
        KeyList::from_buf(batch.keys),
        new_bytes(py, &groups)?,
        new_bytes(py, &chunks)?,
        new_bytes(py, &positions)?,
    ))
}
