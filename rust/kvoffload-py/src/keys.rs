//! Key arguments: a batch of `bytes` (copied out, so the store can run without the GIL) or a
//! `KeyList` (borrowed in place under its read lock), and the `KeyList` / `KeyRange` classes.

use crate::errors::{to_py, KVOffloadError};
use kvoffload_core::KeyBuf;
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple, PyType};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// Borrows each item of `items[start..]` as bytes; `what` names the argument in errors.
fn borrow_bytes<'py>(
    items: &Bound<'py, PyAny>,
    start: usize,
    what: &str,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if items.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a sequence of bytes, got a single bytes object"
        )));
    }
    let cast = |i: usize, item: Bound<'py, PyAny>| {
        if !item.is_instance_of::<PyBytes>() {
            let ty = type_name(&item);
            return Err(PyTypeError::new_err(format!(
                "{what}[{i}] must be bytes, got {ty}"
            )));
        }
        item.cast_into::<PyBytes>().map_err(PyErr::from)
    };
    if let Ok(list) = items.cast::<PyList>() {
        return (start..list.len())
            .map(|i| cast(i, list.get_item(i)?))
            .collect();
    }
    if let Ok(tuple) = items.cast::<PyTuple>() {
        return (start..tuple.len())
            .map(|i| cast(i, tuple.get_item(i)?))
            .collect();
    }
    items
        .try_iter()?
        .enumerate()
        .skip(start)
        .map(|(i, item)| cast(i, item?))
        .collect()
}

fn copy_keys(items: &Bound<'_, PyAny>) -> PyResult<KeyBuf> {
    let owned = borrow_bytes(items, 0, "keys")?;
    let mut buf =
        KeyBuf::with_capacity(owned.len(), owned.first().map_or(0, |b| b.as_bytes().len()));
    for b in &owned {
        buf.push(b.as_bytes()).map_err(to_py)?;
    }
    Ok(buf)
}

pub(crate) fn int64_bytes<'py>(py: Python<'py>, values: &[u32]) -> Bound<'py, PyBytes> {
    let raw: Vec<u8> = values
        .iter()
        .flat_map(|&v| i64::from(v).to_ne_bytes())
        .collect();
    PyBytes::new(py, &raw)
}

pub(crate) fn bytes_list<'py, K: AsRef<[u8]>>(
    py: Python<'py>,
    keys: impl IntoIterator<Item = K>,
) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, keys.into_iter().map(|k| PyBytes::new(py, k.as_ref())))
}

/// A `keys` argument of a store call.
pub(crate) enum KeyArg<'py> {
    Copied(KeyBuf),
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
        copy_keys(keys).map(KeyArg::Copied)
    }

    /// Runs `f` on the keys with the GIL released.
    pub(crate) fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&[&[u8]]) -> PyResult<T> + Send,
    ) -> PyResult<T> {
        match self {
            KeyArg::Copied(buf) => py.detach(|| f(&buf.slices(0, buf.len()))),
            KeyArg::Shared { list, start, end } => {
                let list: &KeyList = list.get();
                py.detach(|| f(&list.read()?.slices(*start, *end)))
            }
        }
    }

    /// The keys at `indices` of this argument, as the same kind of container it came in as.
    pub(crate) fn select(
        &self,
        py: Python<'py>,
        original: &Bound<'py, PyAny>,
        indices: &[u32],
    ) -> PyResult<Bound<'py, PyAny>> {
        match self {
            KeyArg::Shared { list, start, .. } => {
                let picked = list.get().read()?.gather(*start, indices);
                Ok(Bound::new(py, KeyList::from_buf(picked))?.into_any())
            }
            KeyArg::Copied(buf) => {
                let out = PyList::empty(py);
                let as_list = original.cast::<PyList>().ok();
                for &i in indices {
                    match as_list {
                        // The offered objects themselves: no new bytes objects.
                        Some(l) => out.append(l.get_item(i as usize)?)?,
                        None => out.append(PyBytes::new(
                            py,
                            buf.get(i as usize).expect("index in range"),
                        ))?,
                    }
                }
                Ok(out.into_any())
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

    fn read(&self) -> PyResult<RwLockReadGuard<'_, KeyBuf>> {
        self.inner
            .read()
            .map_err(|_| KVOffloadError::new_err("KeyList is unusable after a panic"))
    }

    fn range_list<'py>(
        &self,
        py: Python<'py>,
        start: usize,
        end: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.read()?
                .slices(start, end)
                .into_iter()
                .map(|k| PyBytes::new(py, k)),
        )
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
            keys.map(copy_keys).transpose()?.unwrap_or_default(),
        ))
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.read()?.len())
    }

    fn __getitem__<'py>(&self, py: Python<'py>, index: isize) -> PyResult<Bound<'py, PyBytes>> {
        let buf = self.read()?;
        let i = if index < 0 {
            index + buf.len() as isize
        } else {
            index
        };
        let key = usize::try_from(i).ok().and_then(|i| buf.get(i));
        key.map(|k| PyBytes::new(py, k)).ok_or_else(|| {
            PyIndexError::new_err(format!(
                "KeyList index {index} out of range for length {}",
                buf.len()
            ))
        })
    }

    fn to_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let buf = self.read()?;
        PyList::new(
            py,
            buf.slices(0, buf.len())
                .into_iter()
                .map(|k| PyBytes::new(py, k)),
        )
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.to_list(py)?.try_iter()?.into_any())
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        let mine = self.read()?;
        if let Ok(other) = other.cast::<KeyList>() {
            let theirs = other.get();
            return Ok(std::ptr::eq(self, theirs) || *mine == *theirs.read()?);
        }
        Ok(copy_keys(other).is_ok_and(|theirs| *mine == theirs))
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
    fn view(slf: &Bound<'_, Self>, start: usize, end: usize) -> PyResult<KeyRange> {
        let len = slf.get().read()?.len();
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
        block_hashes: &Bound<'_, PyAny>,
        blocks_per_chunk: usize,
        group_idx: u32,
    ) -> PyResult<usize> {
        let mut buf = self.write()?;
        let owned = borrow_bytes(block_hashes, buf.len() * blocks_per_chunk, "block_hashes")?;
        let tail: Vec<&[u8]> = owned.iter().map(|b| b.as_bytes()).collect();
        buf.extend_chunk_keys(&tail, blocks_per_chunk, group_idx)
            .map_err(to_py)
    }
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
