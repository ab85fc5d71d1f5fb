//! `kvoffload._rust`: translates Python arguments to `kvoffload-core` calls and back. No logic.

mod chunk;
mod errors;
mod keys;
mod store;

use pyo3::prelude::*;

// Not free-threading safe yet: `list_bytes` borrows list items that only the GIL keeps alive.
#[pymodule(gil_used = true)]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<store::Store>()?;
    m.add_class::<keys::KeyList>()?;
    m.add_class::<keys::KeyRange>()?;
    m.add_function(wrap_pyfunction!(chunk::storable_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(chunk::load_window, m)?)?;
    m.add_function(wrap_pyfunction!(chunk::loadable_tokens, m)?)?;
    m.add("KVOffloadError", py.get_type::<errors::KVOffloadError>())?;
    m.add(
        "InvalidStateError",
        py.get_type::<errors::InvalidStateError>(),
    )?;
    m.add("MAX_KEY_LEN", kvoffload_core::MAX_KEY_LEN)?;
    m.add("POLICY_NAMES", kvoffload_core::POLICY_NAMES.to_vec())?;
    Ok(())
}
