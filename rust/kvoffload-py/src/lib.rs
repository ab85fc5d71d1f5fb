//! `kvoffload._rust`: translates Python arguments to `kvoffload-core` calls and back. No logic.

mod chunk;
mod disk;
mod errors;
mod ids;
mod keys;
mod lent;
mod remote;
mod sampled;
mod store;
mod tier_glue;
mod window;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// Benchmark input: `n` keys crafted to collide under the hash seed of kvoffload < 0.2 (public);
/// see `kvoffload_core::testing::colliding_keys`.
#[pyfunction]
#[pyo3(name = "_colliding_keys", signature = (n, bits = 12))]
fn colliding_keys(py: Python<'_>, n: usize, bits: u32) -> PyResult<Bound<'_, PyList>> {
    if !(1..=16).contains(&bits) || n > 1 << 20 {
        return Err(PyValueError::new_err(format!(
            "n={n}, bits={bits} are invalid; allowed: n <= 1048576, bits in 1..=16"
        )));
    }
    let keys = py.detach(|| {
        kvoffload_core::testing::colliding_keys(n, kvoffload_core::OLD_PUBLIC_SEED, bits)
    });
    keys::bytes_list(py, keys.iter())
}

// Not free-threading safe yet: `list_bytes` borrows list items that only the GIL keeps alive.
#[pymodule(gil_used = true)]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<store::Store>()?;
    m.add_class::<ids::BlockSet>()?;
    m.add_class::<keys::KeyList>()?;
    m.add_class::<keys::KeyRange>()?;
    m.add_class::<sampled::SampledLru>()?;
    m.add_function(wrap_pyfunction!(chunk::storable_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(chunk::load_window, m)?)?;
    m.add_function(wrap_pyfunction!(chunk::loadable_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(ids::are_block_ids, m)?)?;
    m.add_function(wrap_pyfunction!(ids::block_tables, m)?)?;
    m.add_function(wrap_pyfunction!(keys::extend_group_keys, m)?)?;
    m.add_function(wrap_pyfunction!(window::group_offer, m)?)?;
    m.add_function(wrap_pyfunction!(window::group_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(window::reachable_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(window::window_hits, m)?)?;
    m.add_function(wrap_pyfunction!(window::load_window_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(colliding_keys, m)?)?;
    m.add("KVOffloadError", py.get_type::<errors::KVOffloadError>())?;
    m.add(
        "InvalidStateError",
        py.get_type::<errors::InvalidStateError>(),
    )?;
    remote::register(m)?;
    disk::register(m)?;
    m.add("MAX_KEY_LEN", kvoffload_core::MAX_KEY_LEN)?;
    m.add("MAX_SLOTS", kvoffload_core::MAX_SLOTS)?;
    m.add("POLICY_NAMES", kvoffload_core::POLICY_NAMES.to_vec())?;
    Ok(())
}
