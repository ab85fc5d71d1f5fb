//! Memory a Python caller lends to a tier's store or load job. Buffers cross as raw addresses (the
//! abi3 build has no buffer protocol), each with the Python object that owns the memory: the
//! binding keeps that object until the job's completion is handed out, so the memory outlives
//! every worker access whatever the caller does with its own references.

use crate::keys::{new_bytes, KeyArg};
use kvoffload_tier::buf::{RawBuf, RawBufMut};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// The buffer object of each job whose completion is not handed out yet.
#[derive(Default)]
pub(crate) struct Lent {
    owners: Mutex<HashMap<u64, Py<PyAny>>>,
}

impl Lent {
    fn owners(&self) -> MutexGuard<'_, HashMap<u64, Py<PyAny>>> {
        // A plain map, valid whatever a panicking holder was doing.
        self.owners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Submits with the GIL released and records `buffer` as the job's owner under the same lock
    /// that `handed_out` takes, so a completion cannot be handed out before its owner is
    /// recorded.
    pub(crate) fn submit<E: Send>(
        &self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        submit: impl FnOnce() -> Result<u64, E> + Send,
    ) -> Result<u64, E> {
        let owner = buffer.clone().unbind();
        let res = py.detach(|| {
            let mut owners = self.owners();
            match submit() {
                Ok(id) => {
                    // Job ids are never reused, so no owner is replaced (and dropped detached).
                    owners.insert(id, owner);
                    Ok(id)
                }
                Err(e) => Err((e, owner)),
            }
        });
        // The refused job's owner is dropped here, attached.
        res.map_err(|(e, _owner)| e)
    }

    /// `[(job_id, statuses)]` for Python, the owners of those jobs dropped (attached and after
    /// the lock: a finalizer may call back into the tier).
    pub(crate) fn handed_out<'py>(
        &self,
        py: Python<'py>,
        done: Vec<(u64, Vec<u8>)>,
    ) -> PyResult<Bound<'py, PyList>> {
        let freed: Vec<Py<PyAny>> = {
            let mut owners = self.owners();
            done.iter()
                .filter_map(|(id, _)| owners.remove(id))
                .collect()
        };
        drop(freed);
        let items = done
            .into_iter()
            .map(|(id, statuses)| {
                PyTuple::new(
                    py,
                    [
                        id.into_pyobject(py)?.into_any(),
                        new_bytes(py, &statuses)?.into_any(),
                    ],
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// Drops every owner: call only once no worker touches any buffer (the tier is closed).
    pub(crate) fn clear(&self) {
        let freed = std::mem::take(&mut *self.owners());
        drop(freed);
    }
}

/// The items' addresses: `base + offset`, each chunk of `chunk` bytes checked to lie within the
/// buffer of `capacity` bytes.
fn spans(
    chunk: usize,
    n_keys: usize,
    base: u64,
    capacity: i64,
    offsets: &[i64],
) -> PyResult<Vec<usize>> {
    let chunk = chunk as i64;
    if offsets.len() != n_keys {
        return Err(PyValueError::new_err(format!(
            "len(offsets)={} differs from len(keys)={n_keys}; allowed: equal lengths",
            offsets.len()
        )));
    }
    let valid = base != 0
        && capacity >= 0
        && usize::try_from(base).is_ok_and(|b| b.checked_add(capacity as usize).is_some());
    if !valid {
        return Err(PyValueError::new_err(format!(
            "base=0x{base:x}, capacity={capacity} is not a valid buffer; allowed: a non-null \
             address and a capacity >= 0 that does not wrap the address space"
        )));
    }
    offsets
        .iter()
        .enumerate()
        .map(|(i, &off)| {
            if off >= 0 && off.checked_add(chunk).is_some_and(|end| end <= capacity) {
                Ok(base as usize + off as usize)
            } else if capacity < chunk {
                Err(PyValueError::new_err(format!(
                    "offsets[{i}]={off}: the buffer of {capacity} bytes holds no chunk of \
                     {chunk} bytes"
                )))
            } else {
                Err(PyValueError::new_err(format!(
                    "offsets[{i}]={off} puts a chunk of {chunk} bytes outside the buffer of \
                     {capacity} bytes; allowed: 0 <= offset <= {}",
                    capacity - chunk
                )))
            }
        })
        .collect()
}

/// A store or load job's memory as one Python call gives it: the keys, and the object `buffer`
/// whose memory holds each key's chunk at `base + offset` (within `capacity` bytes).
pub(crate) struct Loan<'a, 'py> {
    keys: &'a Bound<'py, PyAny>,
    pub(crate) buffer: &'a Bound<'py, PyAny>,
    base: u64,
    capacity: i64,
    offsets: Vec<i64>,
}

impl<'a, 'py> Loan<'a, 'py> {
    pub(crate) fn new(
        keys: &'a Bound<'py, PyAny>,
        buffer: &'a Bound<'py, PyAny>,
        base: u64,
        capacity: i64,
        offsets: Vec<i64>,
    ) -> Self {
        Loan {
            keys,
            buffer,
            base,
            capacity,
            offsets,
        }
    }

    /// A store's items: the keys, each with its chunk of `buffer`.
    ///
    /// # Safety
    /// `base..base+capacity` must be the memory of `buffer`, which the caller then hands to
    /// [`Lent::submit`] (which keeps it alive until the job's completion); the caller leaves it
    /// unchanged until then (each binding's documented contract). Each span is checked to lie
    /// in it.
    pub(crate) unsafe fn store_items(
        &self,
        py: Python<'_>,
        chunk: usize,
    ) -> PyResult<Vec<(Vec<u8>, RawBuf)>> {
        // SAFETY: guaranteed by the caller (above), each span checked by `items`.
        self.items(py, chunk, |a, n| unsafe { RawBuf::new(a as *const u8, n) })
    }

    /// A load's items, as [`Loan::store_items`].
    ///
    /// # Safety
    /// As [`Loan::store_items`]; the caller also leaves the spans untouched until the
    /// completion, and the tier refuses overlapping spans.
    pub(crate) unsafe fn load_items(
        &self,
        py: Python<'_>,
        chunk: usize,
    ) -> PyResult<Vec<(Vec<u8>, RawBufMut)>> {
        // SAFETY: guaranteed by the caller (above), each span checked by `items`.
        self.items(py, chunk, |a, n| unsafe { RawBufMut::new(a as *mut u8, n) })
    }

    fn items<B>(
        &self,
        py: Python<'_>,
        chunk: usize,
        span: impl Fn(usize, usize) -> B,
    ) -> PyResult<Vec<(Vec<u8>, B)>> {
        let keys: Vec<Vec<u8>> =
            KeyArg::extract(self.keys)?.run(py, |k| Ok(k.iter().map(|k| k.to_vec()).collect()))?;
        let addrs = spans(chunk, keys.len(), self.base, self.capacity, &self.offsets)?;
        Ok(keys
            .into_iter()
            .zip(addrs)
            .map(|(k, a)| (k, span(a, chunk)))
            .collect())
    }
}
