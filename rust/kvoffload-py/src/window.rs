//! The store offer of a hybrid model's group (see `kvoffload_core::offered_chunks`).

use crate::ids::block_vec;
use crate::keys::new_bytes;
use kvoffload_core::WindowReach;
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

/// The chunks of `table` (a group's blocks from `first_block`, whole chunks) a store offers, as
/// offsets from its first chunk (int64 bytes).
#[pyfunction]
#[pyo3(signature = (table, first_block, blocks_per_chunk, reach = None))]
pub fn offered_chunks<'py>(
    py: Python<'py>,
    table: &Bound<'py, PyList>,
    first_block: u64,
    blocks_per_chunk: usize,
    reach: Option<Reach>,
) -> PyResult<Bound<'py, PyBytes>> {
    if blocks_per_chunk == 0 || table.len() % blocks_per_chunk != 0 {
        return Err(PyValueError::new_err(format!(
            "table has {} blocks, blocks_per_chunk={blocks_per_chunk}: expected whole chunks",
            table.len()
        )));
    }
    let blocks = block_vec(table, "table")?;
    let reach = reach.as_ref().map(window_reach);
    let chunks =
        kvoffload_core::offered_chunks(&blocks, first_block, blocks_per_chunk, reach.as_ref());
    let raw: Vec<u8> = chunks
        .iter()
        .flat_map(|&c| (c as i64).to_ne_bytes())
        .collect();
    new_bytes(py, &raw)
}
