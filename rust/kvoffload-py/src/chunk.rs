//! The scheduler's chunk arithmetic (see `kvoffload_core::chunk`), as plain functions.

use crate::errors::to_py;
use pyo3::prelude::*;

#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn storable_chunks(
    computed_tokens: u64,
    num_tokens: u64,
    num_prompt_tokens: u64,
    max_offload_tokens: Option<u64>,
    offload_prompt_only: bool,
    tokens_per_chunk: u64,
    num_gpu_blocks: u64,
    blocks_per_chunk: u64,
    num_keys: u64,
) -> PyResult<u64> {
    kvoffload_core::storable_chunks(&kvoffload_core::StoreBounds {
        computed_tokens,
        num_tokens,
        num_prompt_tokens,
        max_offload_tokens,
        offload_prompt_only,
        tokens_per_chunk,
        num_gpu_blocks,
        blocks_per_chunk,
        num_keys,
    })
    .map_err(to_py)
}

/// `(first_chunk, end_chunk, max_hit_tokens)`, or `None` when no lookup is needed.
#[pyfunction]
pub fn load_window(
    num_tokens: u64,
    num_local_tokens: u64,
    max_load_tokens: Option<u64>,
    num_keys: u64,
    tokens_per_chunk: u64,
) -> PyResult<Option<(u64, u64, u64)>> {
    let w = kvoffload_core::load_window(
        num_tokens,
        num_local_tokens,
        max_load_tokens,
        num_keys,
        tokens_per_chunk,
    )
    .map_err(to_py)?;
    Ok(w.map(|w| (w.first_chunk, w.end_chunk, w.max_hit_tokens)))
}

#[pyfunction]
pub fn loadable_tokens(
    window: (u64, u64, u64),
    hits: u64,
    num_local_tokens: u64,
    tokens_per_chunk: u64,
) -> u64 {
    let (first_chunk, end_chunk, max_hit_tokens) = window;
    let w = kvoffload_core::LoadWindow {
        first_chunk,
        end_chunk,
        max_hit_tokens,
    };
    kvoffload_core::loadable_tokens(&w, hits, num_local_tokens, tokens_per_chunk)
}
