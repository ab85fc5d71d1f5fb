//! GPU block id arguments: the scheduler is handed thousands of block ids per engine step (block
//! tables, blocks handed out again), as Python ints in lists.

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

/// `item`'s value if it is an `int` (not a `bool` or other subclass) in `0..2**63`.
///
/// # Safety
/// The GIL must be held and `item` must point to a live object.
unsafe fn block_id(item: *mut ffi::PyObject) -> Option<u64> {
    // SAFETY: per the contract; the overflow flag is a local, and PyLong_AsLongLongAndOverflow
    // cannot fail on an exact int.
    unsafe {
        if ffi::PyLong_CheckExact(item) == 0 {
            return None;
        }
        let mut overflow: std::ffi::c_int = 0;
        let v = ffi::PyLong_AsLongLongAndOverflow(item, &mut overflow);
        (overflow == 0 && v >= 0).then_some(v as u64)
    }
}

/// Whether `item` is a block id (`block_id`).
///
/// # Safety
/// As for `block_id`.
unsafe fn is_block_id(item: *mut ffi::PyObject) -> bool {
    // SAFETY: per the contract.
    unsafe { block_id(item).is_some() }
}

/// Whether `values` is a list or tuple of ints in `0..2**63` (no `bool`): the
/// shape an engine hands block ids in. `False` for anything else, which the caller then checks
/// (and explains) itself.
#[pyfunction]
pub fn are_block_ids(values: &Bound<'_, PyAny>) -> bool {
    if let Ok(list) = values.cast::<PyList>() {
        // Read through the C API: a table is thousands of items, and a handle per item (with its
        // reference counting) would cost more than the check.
        return (0..list.len()).all(|i| {
            // SAFETY: the GIL is held and `i < len`; the borrowed item stays alive while the
            // list does, and no Python code runs here that could change the list.
            unsafe {
                let item = ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t);
                !item.is_null() && is_block_id(item)
            }
        });
    }
    // SAFETY (each below): the GIL is held and the item handle keeps the object alive.
    if let Ok(tuple) = values.cast::<PyTuple>() {
        return tuple
            .iter()
            .all(|item| unsafe { is_block_id(item.as_ptr()) });
    }
    false
}

/// The ids of a list of ints in `0..2**63`; `what` names the argument in errors.
pub(crate) fn block_vec(list: &Bound<'_, PyList>, what: &str) -> PyResult<Vec<u64>> {
    block_slice(list, 0, list.len(), what)
}

/// `block_vec` of items `start..end` of `list` (past its end: none).
pub(crate) fn block_slice(
    list: &Bound<'_, PyList>,
    start: usize,
    end: usize,
    what: &str,
) -> PyResult<Vec<u64>> {
    let end = end.min(list.len());
    let mut ids = Vec::with_capacity(end.saturating_sub(start));
    for i in start..end {
        // SAFETY: as in `are_block_ids`; the value is read before any Python code can run.
        let id = unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t);
            if item.is_null() {
                return Err(PyErr::fetch(list.py()));
            }
            block_id(item)
        };
        let Some(id) = id else {
            return Err(PyValueError::new_err(format!(
                "{what}[{i}] is invalid: expected an int >= 0 (a GPU block id)"
            )));
        };
        ids.push(id);
    }
    Ok(ids)
}

/// The ids of `values` (a list, or any iterable of ints in `0..2**63`); `what` names the
/// argument in errors.
fn any_block_vec(values: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    if let Ok(list) = values.cast::<PyList>() {
        return block_vec(list, what);
    }
    let items = values.try_iter()?.collect::<PyResult<Vec<_>>>()?;
    block_vec(&PyList::new(values.py(), items)?, what)
}

/// GPU blocks handed out in one schedule (`kvoffload_core::BlockSet`): filled by the engine
/// adapter as it sees the block tables, asked for membership by the scheduler.
#[pyclass(module = "kvoffload._rust")]
#[derive(Default)]
pub struct BlockSet {
    inner: kvoffload_core::BlockSet,
}

#[pymethods]
impl BlockSet {
    #[new]
    fn new() -> Self {
        BlockSet::default()
    }

    /// Adds every id of `ids` (Python ints, as engines hand them out); a ValueError naming
    /// `name` (and adding nothing) when one is not an int in `0..2**63`.
    #[pyo3(signature = (ids, name = "block_ids"))]
    fn add(&mut self, ids: &Bound<'_, PyAny>, name: &str) -> PyResult<()> {
        let ids = any_block_vec(ids, name)?;
        self.inner.extend(&ids);
        Ok(())
    }

    /// Removes `id` if it is in the set (anything that is not a block id never is).
    fn discard(&mut self, id: &Bound<'_, PyAny>) {
        // SAFETY: the GIL is held and `id` keeps the object alive.
        if let Some(id) = unsafe { block_id(id.as_ptr()) } {
            self.inner.remove(id);
        }
    }

    fn __contains__(&self, id: &Bound<'_, PyAny>) -> bool {
        // SAFETY: the GIL is held and `id` keeps the object alive.
        unsafe { block_id(id.as_ptr()) }.is_some_and(|id| self.inner.contains(id))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!("BlockSet({} blocks)", self.inner.len())
    }

    /// The ids, ascending.
    fn to_list(&self) -> Vec<u64> {
        self.inner.sorted()
    }

    /// Whether any id of `ids` (an iterable of block ids) is in the set.
    fn intersects(&self, ids: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(any_block_vec(ids, "ids")?
            .into_iter()
            .any(|id| self.inner.contains(id)))
    }

    /// Replaces every block of `table` (a list of block ids) from index `start` on that is in
    /// the set by the null block (0), in place; returns how many it replaced.
    fn null_members(&self, table: &Bound<'_, PyList>, start: usize) -> PyResult<usize> {
        if self.inner.is_empty() || start >= table.len() {
            return Ok(0);
        }
        let mut blocks = block_slice(table, start, table.len(), "table")?;
        let replaced = self.inner.null_members(&mut blocks);
        if replaced > 0 {
            for (i, &block) in blocks.iter().enumerate() {
                if block == kvoffload_core::NULL_BLOCK {
                    table.set_item(start + i, 0)?;
                }
            }
        }
        Ok(replaced)
    }
}

/// Copies of `values` when it is `n` block tables of one length: a list or tuple of `n` lists
/// or tuples of block ids (`are_block_ids`). `None` for anything else, which the caller then
/// checks (and explains) itself.
#[pyfunction]
pub fn block_tables<'py>(
    values: &Bound<'py, PyAny>,
    n: usize,
) -> PyResult<Option<Vec<Bound<'py, PyList>>>> {
    let items: Vec<Bound<'py, PyAny>> = if let Ok(list) = values.cast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = values.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Ok(None);
    };
    if items.len() != n {
        return Ok(None);
    }
    let mut tables = Vec::with_capacity(n);
    for item in &items {
        let table = if let Ok(list) = item.cast::<PyList>() {
            // A C-level slice copy: the items are the engine's own int objects.
            list.get_slice(0, list.len())
        } else if let Ok(tuple) = item.cast::<PyTuple>() {
            tuple.to_list()
        } else {
            return Ok(None);
        };
        if tables
            .first()
            .is_some_and(|t: &Bound<'_, PyList>| t.len() != table.len())
            || !are_block_ids(table.as_any())
        {
            return Ok(None);
        }
        tables.push(table);
    }
    Ok(Some(tables))
}
