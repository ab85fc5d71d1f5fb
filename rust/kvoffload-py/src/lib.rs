//! `kvoffload._rust`: translates Python arguments to `kvoffload-core` calls and back. No logic.

use kvoffload_core::{Error, EventKind, PolicyKind};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::sync::{Mutex, MutexGuard};

create_exception!(
    _rust,
    KVOffloadError,
    PyException,
    "Base class of every kvoffload error."
);
create_exception!(
    _rust,
    InvalidStateError,
    KVOffloadError,
    "A key is not in the state the call needs (e.g. loading a key that is not ready)."
);

fn to_py(err: Error) -> PyErr {
    match err {
        Error::InvalidKeyLength { .. }
        | Error::InvalidArgument { .. }
        | Error::UnknownPolicy(_) => PyValueError::new_err(err.to_string()),
        Error::InvalidState { .. } => InvalidStateError::new_err(err.to_string()),
    }
}

/// Keys copied out of Python objects, so the store can work with the GIL released.
struct KeyBatch {
    data: Vec<u8>,
    ends: Vec<usize>,
}

impl KeyBatch {
    fn extract(keys: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut batch = KeyBatch {
            data: Vec::new(),
            ends: Vec::new(),
        };
        let mut push = |index: usize, item: Bound<'_, PyAny>| -> PyResult<()> {
            let bytes = item.cast::<PyBytes>().map_err(|_| {
                let ty = item
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default();
                PyTypeError::new_err(format!("keys[{index}] must be bytes, got {ty}"))
            })?;
            batch.data.extend_from_slice(bytes.as_bytes());
            batch.ends.push(batch.data.len());
            Ok(())
        };
        if let Ok(list) = keys.cast::<PyList>() {
            for (i, item) in list.iter().enumerate() {
                push(i, item)?;
            }
        } else if keys.is_instance_of::<PyBytes>() {
            return Err(PyTypeError::new_err(
                "keys must be a sequence of bytes, got a single bytes object",
            ));
        } else {
            for (i, item) in keys.try_iter()?.enumerate() {
                push(i, item?)?;
            }
        }
        Ok(batch)
    }

    fn slices(&self) -> Vec<&[u8]> {
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let s = &self.data[start..end];
                start = end;
                s
            })
            .collect()
    }
}

fn int64_bytes<'py>(py: Python<'py>, slots: &[u32]) -> Bound<'py, PyBytes> {
    let wide: Vec<i64> = slots.iter().map(|&s| i64::from(s)).collect();
    let raw: Vec<u8> = wide.iter().flat_map(|s| s.to_ne_bytes()).collect();
    PyBytes::new(py, &raw)
}

fn bytes_list<'py>(py: Python<'py>, keys: &[Vec<u8>]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
}

/// The CPU-tier block store. Thread-safe: every call takes an internal lock, with the GIL released
/// while the store works.
#[pyclass(frozen, module = "kvoffload._rust")]
struct Store {
    inner: Mutex<kvoffload_core::Store>,
}

impl Store {
    fn lock(&self) -> PyResult<MutexGuard<'_, kvoffload_core::Store>> {
        self.inner.lock().map_err(|_| {
            KVOffloadError::new_err("the store is unusable: an earlier call panicked inside it")
        })
    }

    /// Runs `f` on the store with the keys copied out and the GIL released.
    fn with_keys<T: Send>(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        f: impl FnOnce(&mut kvoffload_core::Store, &[&[u8]]) -> Result<T, Error> + Send,
    ) -> PyResult<T> {
        let batch = KeyBatch::extract(keys)?;
        py.detach(|| {
            let mut store = self.lock()?;
            f(&mut store, &batch.slices()).map_err(to_py)
        })
    }
}

#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (num_slots, eviction_policy = "lru", enable_events = false))]
    fn new(num_slots: i64, eviction_policy: &str, enable_events: bool) -> PyResult<Self> {
        let policy: PolicyKind = eviction_policy.parse().map_err(to_py)?;
        let store = kvoffload_core::Store::new(num_slots, policy, enable_events).map_err(to_py)?;
        Ok(Store {
            inner: Mutex::new(store),
        })
    }

    #[getter]
    fn num_slots(&self) -> PyResult<u32> {
        Ok(self.lock()?.num_slots())
    }

    #[getter]
    fn eviction_policy(&self) -> PyResult<&'static str> {
        Ok(self.lock()?.policy().name())
    }

    #[getter]
    fn events_enabled(&self) -> PyResult<bool> {
        Ok(self.lock()?.events_enabled())
    }

    /// `None` when the store cannot take the keys now; else `(keys_to_write, indices, slots,
    /// evicted_keys)`: `keys_to_write` are the offered objects themselves, `indices` their
    /// positions in the offer and `slots` their slots (both int64 bytes).
    #[allow(clippy::type_complexity)]
    fn prepare_store<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<
        Option<(
            Bound<'py, PyList>,
            Bound<'py, PyBytes>,
            Bound<'py, PyBytes>,
            Bound<'py, PyList>,
        )>,
    > {
        let Some(plan) = self.with_keys(py, keys, |s, k| s.prepare_store(k))? else {
            return Ok(None);
        };
        let to_write = PyList::empty(py);
        for &i in &plan.indices {
            to_write.append(keys.get_item(i)?)?;
        }
        Ok(Some((
            to_write,
            int64_bytes(py, &plan.indices),
            int64_bytes(py, &plan.slots),
            bytes_list(py, &plan.evicted)?,
        )))
    }

    #[pyo3(signature = (keys, success = true))]
    fn complete_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        success: bool,
    ) -> PyResult<()> {
        self.with_keys(py, keys, |s, k| s.complete_store(k, success))
    }

    fn lookup_prefix(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<(usize, bool)> {
        self.with_keys(py, keys, |s, k| s.lookup_prefix(k))
    }

    /// One status byte per key: 0 absent, 1 pending, 2 ready.
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let statuses = self.with_keys(py, keys, |s, k| s.lookup(k))?;
        let raw: Vec<u8> = statuses.into_iter().map(|s| s as u8).collect();
        Ok(PyBytes::new(py, &raw))
    }

    fn prepare_load<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let slots = self.with_keys(py, keys, |s, k| s.prepare_load(k))?;
        Ok(int64_bytes(py, &slots))
    }

    fn complete_load(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_keys(py, keys, |s, k| s.complete_load(k))
    }

    fn touch(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_keys(py, keys, |s, k| s.touch(k))
    }

    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.lock().map(|mut s| s.reset()))
    }

    /// `[(kind, keys)]` with kind `"stored"` or `"removed"`, oldest first.
    fn take_events<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(&'static str, Bound<'py, PyList>)>> {
        let events = self.lock()?.take_events();
        events
            .iter()
            .map(|e| {
                let kind = match e.kind {
                    EventKind::Stored => "stored",
                    EventKind::Removed => "removed",
                };
                Ok((kind, bytes_list(py, &e.keys)?))
            })
            .collect()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (st, target) = {
            let s = self.lock()?;
            (s.stats(), s.arc_target_t1())
        };
        let d = PyDict::new(py);
        d.set_item("num_slots", st.num_slots)?;
        d.set_item("used_slots", st.used_slots)?;
        d.set_item("ready", st.ready)?;
        d.set_item("pending", st.pending)?;
        d.set_item("pinned", st.pinned)?;
        d.set_item("hits", st.hits)?;
        d.set_item("misses", st.misses)?;
        d.set_item("evictions", st.evictions)?;
        d.set_item("store_refusals", st.store_refusals)?;
        d.set_item("stores_completed", st.stores_completed)?;
        d.set_item("stores_failed", st.stores_failed)?;
        d.set_item("metadata_bytes_per_slot", st.metadata_bytes_per_slot)?;
        d.set_item("arc_target_t1", target)?;
        Ok(d)
    }

    /// Keys from least to most recently used, one list per policy list (T1, T2 under ARC).
    fn recency_order<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyList>>> {
        let order = self.lock()?.recency_order();
        order.iter().map(|l| bytes_list(py, l)).collect()
    }

    /// Verifies every internal invariant; raises on the first broken one. O(num_slots).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.lock().map(|s| s.check_invariants()))
    }
}

/// Keys of the complete chunks `start_chunk..` (see `kvoffload_core::chunk_keys`).
#[pyfunction]
fn chunk_keys<'py>(
    py: Python<'py>,
    block_hashes: &Bound<'py, PyAny>,
    blocks_per_chunk: usize,
    group_idx: u32,
    start_chunk: usize,
) -> PyResult<Bound<'py, PyList>> {
    let batch = KeyBatch::extract(block_hashes)?;
    let keys = py.detach(|| {
        kvoffload_core::chunk_keys(&batch.slices(), blocks_per_chunk, group_idx, start_chunk)
    });
    bytes_list(py, &keys.map_err(to_py)?)
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn storable_chunks(
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
fn load_window(
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
fn loadable_tokens(
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

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Store>()?;
    m.add_function(wrap_pyfunction!(chunk_keys, m)?)?;
    m.add_function(wrap_pyfunction!(storable_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(load_window, m)?)?;
    m.add_function(wrap_pyfunction!(loadable_tokens, m)?)?;
    m.add("KVOffloadError", m.py().get_type::<KVOffloadError>())?;
    m.add("InvalidStateError", m.py().get_type::<InvalidStateError>())?;
    m.add("MAX_KEY_LEN", kvoffload_core::MAX_KEY_LEN)?;
    m.add("POLICY_NAMES", kvoffload_core::POLICY_NAMES.to_vec())?;
    Ok(())
}
