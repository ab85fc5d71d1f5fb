//! The key batches of a hybrid model's groups: a store's offer (see
//! `kvoffload_core::offer_batch`) and a load's chunk ranges.

use crate::errors::to_py;
use crate::ids::{block_slice, block_vec};
use crate::keys::{i64_bytes, new_bytes, KeyList};
use kvoffload_core::{
    offer_batch, range_batch, GroupBatch, GroupKind, GroupOffer, GroupRule, KeyBuf, KeyStatus,
    WindowReach,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

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

/// A group as `Store.lookup_groups` takes it: `(kind, window_chunks, window,
/// extra_retained_tokens, eagle)` (the Python `KVGroup`'s fields and its window in chunks).
pub(crate) type GroupSpec = (String, Option<u64>, u64, u64, bool);

/// Each spec as a `GroupRule`, or a ValueError when a kind is unknown, a window does not fit
/// its kind, or the specs are not one per key list.
pub(crate) fn group_rules(specs: &[GroupSpec], num_lists: usize) -> PyResult<Vec<GroupRule>> {
    if specs.len() != num_lists {
        return Err(PyValueError::new_err(format!(
            "specs has {} groups for {num_lists} key lists: expected one per key list",
            specs.len()
        )));
    }
    specs
        .iter()
        .map(
            |(kind_name, window_chunks, window, extra_retained_tokens, eagle)| {
                let kind = match kind_name.as_str() {
                    "full" => GroupKind::Full,
                    "sliding" => GroupKind::Sliding,
                    "chunked_local" => GroupKind::ChunkedLocal,
                    "mamba" => GroupKind::Mamba,
                    _ => {
                        return Err(PyValueError::new_err(format!(
                        "kind={kind_name:?} is invalid; allowed: full, sliding, chunked_local, \
                         mamba"
                    )))
                    }
                };
                let valid = match window_chunks {
                    None => kind == GroupKind::Full,
                    Some(w) => kind != GroupKind::Full && *w >= 1,
                };
                if !valid {
                    let shown = window_chunks.map_or("None".to_string(), |w| w.to_string());
                    return Err(PyValueError::new_err(format!(
                    "window_chunks={shown} of a {kind_name} group is invalid; allowed: None for \
                     full attention, an int >= 1 for a window group",
                )));
                }
                Ok(GroupRule {
                    kind,
                    window_chunks: *window_chunks,
                    window: *window,
                    extra_retained_tokens: *extra_retained_tokens,
                    eagle: *eagle,
                })
            },
        )
        .collect()
}

/// `GroupRule::load_window_chunks` of a group given as `Store.lookup_groups` takes it (for the
/// tests that compare the core's rule with vLLM's own).
#[pyfunction]
pub fn load_window_chunks(
    spec: GroupSpec,
    num_tokens: u64,
    tokens_per_chunk: u64,
) -> PyResult<Option<u64>> {
    let rule = group_rules(std::slice::from_ref(&spec), 1)?[0];
    Ok(rule.load_window_chunks(num_tokens, tokens_per_chunk))
}

/// `kvoffload_core::window_hits` of one status byte per key (0 absent, 1 pending, 2 ready), for
/// the tests that compare the core's rule with vLLM's own.
#[pyfunction]
pub fn window_hits(status: &[u8], window: usize, first_window: usize) -> PyResult<Option<usize>> {
    let status = status
        .iter()
        .map(|&s| match s {
            0 => Ok(KeyStatus::Absent),
            1 => Ok(KeyStatus::Pending),
            2 => Ok(KeyStatus::Ready),
            _ => Err(PyValueError::new_err(format!(
                "status holds {s}: allowed: 0 (absent), 1 (pending), 2 (ready)"
            ))),
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(kvoffload_core::window_hits(&status, window, first_window))
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
pub(crate) type Offer<'py> = (
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
    let (batch, _) = offered(&offers, blocks_per_chunk, num_groups)?;
    batch_answer(py, batch)
}

/// A group's offered blocks, from chunk `first_chunk` on: `(first_chunk, blocks)`.
pub(crate) type OfferTable = (u64, Vec<u64>);

/// The batch `offers` make (`group_offer`), and each group's `(first_chunk, table)` of them
/// (empty for a group that offers nothing).
pub(crate) fn offered(
    offers: &[Offer<'_>],
    blocks_per_chunk: usize,
    num_groups: u32,
) -> PyResult<(GroupBatch, Vec<OfferTable>)> {
    let mut tables = vec![(0, Vec::new()); num_groups as usize];
    for (group, _, table, first_chunk, _) in offers {
        if blocks_per_chunk == 0 || table.len() % blocks_per_chunk != 0 {
            return Err(PyValueError::new_err(format!(
                "table of group {group} has {} blocks, blocks_per_chunk={blocks_per_chunk}: \
                 expected whole chunks",
                table.len()
            )));
        }
        let slot = tables.get_mut(*group as usize).ok_or_else(|| {
            PyValueError::new_err(format!(
                "group={group} is invalid: the model has {num_groups} groups"
            ))
        })?;
        *slot = (*first_chunk, block_vec(table, "table")?);
    }
    let guards = offers
        .iter()
        .map(|(_, keys, ..)| keys.get().read())
        .collect::<PyResult<Vec<_>>>()?;
    let parts: Vec<GroupOffer<'_>> = offers
        .iter()
        .zip(&guards)
        .map(|((group, _, _, first_chunk, reach), keys)| GroupOffer {
            group: *group,
            keys,
            table: &tables[*group as usize].1,
            first_chunk: *first_chunk,
            reach: reach.as_ref().map(window_reach),
        })
        .collect();
    let batch = offer_batch(&parts, blocks_per_chunk, num_groups).map_err(to_py)?;
    drop(parts);
    drop(guards);
    Ok((batch, tables))
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

/// Blocks `first_block..num_blocks` of each of a load's `tables` (one per key list, of which it
/// has `num_lists`), read from the Python lists. The core checks the load again; checked here
/// first, the ValueError names the Python arguments.
pub(crate) fn load_tables(
    num_lists: usize,
    tables: &[Bound<'_, PyList>],
    first_block: usize,
    num_blocks: usize,
    end_chunk: u64,
    blocks_per_chunk: u64,
) -> PyResult<Vec<Vec<u64>>> {
    if num_lists != tables.len()
        || blocks_per_chunk == 0
        || first_block > num_blocks
        || (num_blocks as u64).div_ceil(blocks_per_chunk) != end_chunk
    {
        return Err(PyValueError::new_err(format!(
            "a load of {num_lists} key lists, {} tables, blocks {first_block}..{num_blocks}, \
             blocks_per_chunk={blocks_per_chunk}, end_chunk={end_chunk} is invalid: one table per \
             key list, a block range, blocks_per_chunk >= 1, the chunk of the last block + 1",
            tables.len()
        )));
    }
    let mut blocks = Vec::with_capacity(tables.len());
    for (g, table) in tables.iter().enumerate() {
        if table.len() < num_blocks {
            return Err(PyValueError::new_err(format!(
                "block_ids of group {g} has {} blocks; the load needs {num_blocks}",
                table.len()
            )));
        }
        blocks.push(block_slice(
            table,
            first_block,
            num_blocks,
            &format!("block_ids[{g}]"),
        )?);
    }
    Ok(blocks)
}

fn batch_answer(py: Python<'_>, batch: GroupBatch) -> PyResult<OfferBatch<'_>> {
    Ok((
        KeyList::from_buf(batch.keys),
        i64_bytes(py, batch.groups.iter().map(|&g| i64::from(g)))?,
        i64_bytes(py, batch.chunks.iter().map(|&c| c as i64))?,
        i64_bytes(py, batch.positions.into_iter())?,
    ))
}
