//! `SampledLru`: the simulator's model of a shared tier's eviction (`kvoffload_core::SampledLru`).

use crate::errors::{to_py, KVOffloadError};
use crate::keys::KeyArg;
use pyo3::prelude::*;
use std::sync::{Mutex, MutexGuard};

#[pyclass(frozen, module = "kvoffload._rust")]
pub struct SampledLru {
    inner: Mutex<kvoffload_core::SampledLru>,
}

impl SampledLru {
    fn lock(&self) -> PyResult<MutexGuard<'_, kvoffload_core::SampledLru>> {
        self.inner
            .lock()
            .map_err(|_| KVOffloadError::new_err("an earlier call panicked inside the tier"))
    }
}

#[pymethods]
impl SampledLru {
    #[new]
    #[pyo3(signature = (capacity, samples = 5, seed = 0))]
    fn new(capacity: usize, samples: usize, seed: u64) -> PyResult<Self> {
        let inner = kvoffload_core::SampledLru::new(capacity, samples, seed).map_err(to_py)?;
        Ok(SampledLru {
            inner: Mutex::new(inner),
        })
    }

    fn lookup_prefix(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, now: f64) -> PyResult<usize> {
        KeyArg::extract(keys)?.run(py, |k| Ok(self.lock()?.lookup_prefix(k, now)))
    }

    fn peek_prefix(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, now: f64) -> PyResult<usize> {
        KeyArg::extract(keys)?.run(py, |k| Ok(self.lock()?.peek_prefix(k, now)))
    }

    fn put(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, ready_at: f64) -> PyResult<usize> {
        KeyArg::extract(keys)?.run(py, |k| Ok(self.lock()?.put(k, ready_at)))
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.lock()?.check_invariants().map_err(to_py)
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.lock()?.len())
    }
}
