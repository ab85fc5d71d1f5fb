//! Key arguments: a batch of `bytes` (copied out, so the store can run without the GIL) or a
//! `KeyList` (borrowed in place under its read lock), and the `KeyList` / `KeyRange` classes.

use crate::errors::{to_py, KVOffloadError};
use kvoffload_core::KeyBuf;
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyType};
use pyo3::Borrowed;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

fn type_name(obj: &Borrowed<'_, '_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// `items` as a list (itself when it is one), refusing a lone `bytes`.
fn as_list<'py>(items: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyList>> {
    if items.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a sequence of bytes, got a single bytes object"
        )));
    }
    match items.cast::<PyList>() {
        Ok(list) => Ok(list.clone()),
        Err(_) => Ok(items
            .py()
            .get_type::<PyList>()
            .call1((items,))?
            .cast_into()?),
    }
}

/// The contents of `list[start..]`, each checked to be `bytes`; `what` names the argument in
/// errors. A batch of thousands of keys crosses here on every call, so this reads the items
/// through the C API directly: no reference counting and no owned handle per item.
///
/// # Safety
/// The slices point into the list's bytes objects: the caller must be done with them before any
/// Python code can run (which could change the list and free those objects).
unsafe fn list_bytes<'a>(
    list: &'a Bound<'_, PyList>,
    start: usize,
    what: &str,
) -> PyResult<Vec<&'a [u8]>> {
    let py = list.py();
    let n = list.len();
    let mut out = Vec::with_capacity(n.saturating_sub(start));
    for i in start..n {
        // SAFETY: the GIL is held (we have `py`) and `i < len`, so PyList_GetItem returns a
        // borrowed, live item that the list keeps alive; no Python code runs while the slices
        // are used, so nothing can replace or free it. PyBytes_AsStringAndSize only runs on a
        // checked bytes object and gives its immutable buffer.
        unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t);
            if item.is_null() {
                return Err(PyErr::fetch(py));
            }
            if ffi::PyBytes_Check(item) == 0 {
                let ty = type_name(&Borrowed::from_ptr(py, item));
                return Err(PyTypeError::new_err(format!(
                    "{what}[{i}] must be bytes, got {ty}"
                )));
            }
            let mut data: *mut std::ffi::c_char = std::ptr::null_mut();
            let mut len: ffi::Py_ssize_t = 0;
            if ffi::PyBytes_AsStringAndSize(item, &mut data, &mut len) != 0 {
                return Err(PyErr::fetch(py));
            }
            out.push(std::slice::from_raw_parts(data.cast::<u8>(), len as usize));
        }
    }
    Ok(out)
}

fn copy_keys<'py>(items: &Bound<'py, PyAny>) -> PyResult<(KeyBuf, Bound<'py, PyList>)> {
    let list = as_list(items, "keys")?;
    // SAFETY: the slices are copied out before any Python code can run.
    let slices = unsafe { list_bytes(&list, 0, "keys")? };
    let buf = KeyBuf::from_keys(&slices).map_err(to_py)?;
    Ok((buf, list))
}

/// A new `bytes`, or `MemoryError` (pyo3's `PyBytes::new` panics when allocation fails).
pub(crate) fn new_bytes<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    // SAFETY: `data` is a valid slice for the call; the result is a new reference or NULL with
    // an exception set, which `from_owned_ptr_or_err` turns into the error.
    unsafe {
        let ptr = ffi::PyBytes_FromStringAndSize(
            data.as_ptr().cast::<std::ffi::c_char>(),
            data.len() as ffi::Py_ssize_t,
        );
        Ok(Bound::from_owned_ptr_or_err(py, ptr)?.cast_into_unchecked())
    }
}

pub(crate) fn int64_bytes<'py>(py: Python<'py>, values: &[u32]) -> PyResult<Bound<'py, PyBytes>> {
    i64_bytes(py, values.iter().map(|&v| i64::from(v)))
}

/// `values` as native-endian int64 bytes (what numpy's `frombuffer` reads), written straight
/// into a new `bytes`: collecting them byte by byte cost more than the work that made them.
pub(crate) fn i64_bytes<'py>(
    py: Python<'py>,
    values: impl ExactSizeIterator<Item = i64>,
) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, values.len() * 8, |buf| {
        for (dst, v) in buf.chunks_exact_mut(8).zip(values) {
            dst.copy_from_slice(&v.to_ne_bytes());
        }
        Ok(())
    })
}

pub(crate) fn bytes_list<'py, K: AsRef<[u8]>>(
    py: Python<'py>,
    keys: impl IntoIterator<Item = K>,
) -> PyResult<Bound<'py, PyList>> {
    let items = keys
        .into_iter()
        .map(|k| new_bytes(py, k.as_ref()))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

/// A `keys` argument of a store call.
pub(crate) enum KeyArg<'py> {
    /// A copy of the keys, and the list they came from.
    Copied(KeyBuf, Bound<'py, PyList>),
    Shared {
        list: Bound<'py, KeyList>,
        start: usize,
        end: usize,
    },
}

impl<'py> KeyArg<'py> {
    pub(crate) fn extract(keys: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(list) = keys.cast::<KeyList>() {
            let end = list.get().read()?.len();
            return Ok(KeyArg::Shared {
                list: list.clone(),
                start: 0,
                end,
            });
        }
        if let Ok(range) = keys.cast::<KeyRange>() {
            let r = range.get();
            return Ok(KeyArg::Shared {
                list: r.list.bind(keys.py()).clone(),
                start: r.start,
                end: r.end,
            });
        }
        let (buf, list) = copy_keys(keys)?;
        Ok(KeyArg::Copied(buf, list))
    }

    /// Runs `f` on the keys with the GIL released.
    pub(crate) fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&[&[u8]]) -> PyResult<T> + Send,
    ) -> PyResult<T> {
        match self {
            KeyArg::Copied(buf, _) => py.detach(|| f(&buf.slices(0, buf.len()))),
            KeyArg::Shared { list, start, end } => {
                let list: &KeyList = list.get();
                py.detach(|| f(&list.read()?.slices(*start, *end)))
            }
        }
    }

    /// The keys at `indices` of this argument, as the same kind of container it came in as.
    pub(crate) fn select(&self, py: Python<'py>, indices: &[u32]) -> PyResult<Bound<'py, PyAny>> {
        match self {
            KeyArg::Shared { list, start, .. } => {
                let picked = list.get().read()?.gather(*start, indices);
                Ok(Bound::new(py, KeyList::from_buf(picked))?.into_any())
            }
            // The caller's own objects (no new allocation, their hashes already cached), as long
            // as they still hold the keys the store saw: another thread may have changed the
            // list while the GIL was released.
            KeyArg::Copied(buf, list) => {
                let picked = indices
                    .iter()
                    .map(|&i| {
                        let key = buf.get(i as usize).expect("index in range");
                        match list.get_item(i as usize) {
                            Ok(item)
                                if item.cast::<PyBytes>().is_ok_and(|b| b.as_bytes() == key) =>
                            {
                                Ok(item)
                            }
                            _ => Ok(new_bytes(py, key)?.into_any()),
                        }
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                Ok(PyList::new(py, picked)?.into_any())
            }
        }
    }
}

/// Keys in one contiguous buffer. Store calls read it in place, so a request's chunk keys never
/// become Python objects on the hot path; it is also a read-only sequence of `bytes`.
#[pyclass(frozen, sequence, module = "kvoffload._rust")]
pub struct KeyList {
    inner: RwLock<KeyBuf>,
}

impl KeyList {
    pub(crate) fn from_buf(buf: KeyBuf) -> Self {
        KeyList {
            inner: RwLock::new(buf),
        }
    }

    pub(crate) fn read(&self) -> PyResult<RwLockReadGuard<'_, KeyBuf>> {
        self.inner
            .read()
            .map_err(|_| KVOffloadError::new_err("KeyList is unusable after a panic"))
    }

    /// Keys `start..end` as new bytes objects. They are made after the lock is released:
    /// allocating Python objects can run arbitrary Python code (garbage collection).
    fn range_list<'py>(
        &self,
        py: Python<'py>,
        start: usize,
        end: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        let copy = KeyBuf::from_keys(&self.read()?.slices(start, end)).map_err(to_py)?;
        bytes_list(py, copy.iter())
    }

    fn write(&self) -> PyResult<RwLockWriteGuard<'_, KeyBuf>> {
        self.inner
            .write()
            .map_err(|_| KVOffloadError::new_err("KeyList is unusable after a panic"))
    }
}

#[pymethods]
impl KeyList {
    #[new]
    #[pyo3(signature = (keys = None))]
    fn new(keys: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        Ok(KeyList::from_buf(
            keys.map(copy_keys)
                .transpose()?
                .map(|(buf, _)| buf)
                .unwrap_or_default(),
        ))
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.read()?.len())
    }

    fn __getitem__<'py>(&self, py: Python<'py>, index: isize) -> PyResult<Bound<'py, PyBytes>> {
        let (key, len) = {
            let buf = self.read()?;
            let i = if index < 0 {
                index + buf.len() as isize
            } else {
                index
            };
            (
                usize::try_from(i)
                    .ok()
                    .and_then(|i| buf.get(i))
                    .map(<[u8]>::to_vec),
                buf.len(),
            )
        };
        match key {
            Some(k) => new_bytes(py, &k),
            None => Err(PyIndexError::new_err(format!(
                "KeyList index {index} out of range for length {len}"
            ))),
        }
    }

    fn to_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.range_list(py, 0, usize::MAX)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.to_list(py)?.try_iter()?.into_any())
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        if let Ok(other) = other.cast::<KeyList>() {
            let theirs = other.get();
            return Ok(std::ptr::eq(self, theirs) || *self.read()? == *theirs.read()?);
        }
        // Converting `other` can run Python code: never while holding the lock.
        match copy_keys(other) {
            Ok((theirs, _)) => Ok(*self.read()? == theirs),
            Err(_) => Ok(false),
        }
    }

    fn __repr__(&self) -> PyResult<String> {
        Ok(format!("KeyList(<{} keys>)", self.read()?.len()))
    }

    fn __reduce__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyType>, (Bound<'py, PyList>,))> {
        Ok((py.get_type::<KeyList>(), (self.to_list(py)?,)))
    }

    /// A view of keys `start..end` that store calls accept without copying.
    fn view(slf: &Bound<'_, Self>, start: isize, end: isize) -> PyResult<KeyRange> {
        let len = slf.get().read()?.len();
        let (Ok(start), Ok(end)) = (usize::try_from(start), usize::try_from(end)) else {
            return Err(PyValueError::new_err(format!(
                "view({start}, {end}) is out of range: need 0 <= start <= end <= {len}"
            )));
        };
        if start > end || end > len {
            return Err(PyValueError::new_err(format!(
                "view({start}, {end}) is out of range: need start <= end <= {len}"
            )));
        }
        Ok(KeyRange {
            list: slf.clone().unbind(),
            start,
            end,
        })
    }

    /// Appends the keys of complete chunks that `block_hashes` (a request's hashes from its first
    /// block) has beyond the chunks already here; reads only the new hashes. Returns how many.
    #[pyo3(signature = (block_hashes, blocks_per_chunk, group_idx = 0))]
    fn extend_chunk_keys(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        blocks_per_chunk: usize,
        group_idx: u32,
    ) -> PyResult<usize> {
        extend_keys(py, &[(self, group_idx)], block_hashes, blocks_per_chunk)
    }
}

/// `KeyList.extend_chunk_keys` of every group of a hybrid model at once: `lists[g]` takes the
/// keys of group `g`, all from one read of the hashes. Returns how many keys were added in all.
#[pyfunction]
pub fn extend_group_keys(
    py: Python<'_>,
    lists: Vec<Bound<'_, KeyList>>,
    block_hashes: &Bound<'_, PyAny>,
    blocks_per_chunk: usize,
) -> PyResult<usize> {
    let lists: Vec<(&KeyList, u32)> = lists
        .iter()
        .enumerate()
        .map(|(g, l)| (l.get(), g as u32))
        .collect();
    extend_keys(py, &lists, block_hashes, blocks_per_chunk)
}

/// Appends to each `(list, group_idx)` the keys of the complete chunks `block_hashes` has past
/// the chunks the list has; the hashes past the shortest list are read once for all. Every
/// list's keys are made (with the GIL: converting to a list can run Python code) before any
/// list changes, so an error changes none of them; the locks are waited for without the GIL.
/// A list's length is checked again under its write lock, in one scope with the append, so
/// chunks a concurrent extender appended meanwhile are skipped rather than appended twice.
fn extend_keys(
    py: Python<'_>,
    lists: &[(&KeyList, u32)],
    block_hashes: &Bound<'_, PyAny>,
    blocks_per_chunk: usize,
) -> PyResult<usize> {
    let hashes = as_list(block_hashes, "block_hashes")?;
    let seen = lists
        .iter()
        .map(|(l, _)| py.detach(|| l.read().map(|b| b.len())))
        .collect::<PyResult<Vec<_>>>()?;
    let Some(&least) = seen.iter().min() else {
        return Ok(0);
    };
    let first_block = least.saturating_mul(blocks_per_chunk);
    // SAFETY: the slices are used below, before any Python code can run.
    let tail = unsafe { list_bytes(&hashes, first_block, "block_hashes")? };
    let mut fresh = Vec::with_capacity(lists.len());
    for (&(_, group), &n) in lists.iter().zip(&seen) {
        let skip = ((n - least) * blocks_per_chunk).min(tail.len());
        let keys = KeyBuf::chunk_keys(&tail[skip..], blocks_per_chunk, group, first_block + skip)
            .map_err(to_py)?;
        fresh.push(keys);
    }
    py.detach(|| {
        let mut added = 0;
        for ((&(list, _), keys), &n) in lists.iter().zip(&fresh).zip(&seen) {
            let mut buf = list.write()?;
            let skip = buf.len() - n;
            buf.append_from(keys, skip);
            added += keys.len().saturating_sub(skip);
        }
        Ok(added)
    })
}

/// Keys `start..end` of a `KeyList`, as made by `KeyList.view`.
#[pyclass(frozen, module = "kvoffload._rust")]
pub struct KeyRange {
    list: Py<KeyList>,
    #[pyo3(get)]
    start: usize,
    #[pyo3(get)]
    end: usize,
}

#[pymethods]
impl KeyRange {
    fn __len__(&self) -> usize {
        self.end - self.start
    }

    fn __repr__(&self) -> String {
        format!("KeyRange({}..{})", self.start, self.end)
    }

    fn to_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.list.get().range_list(py, self.start, self.end)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.to_list(py)?.try_iter()?.into_any())
    }
}
