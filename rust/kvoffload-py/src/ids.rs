//! GPU block id arguments: the scheduler is handed thousands of block ids per engine step (block
//! tables, blocks handed out again), as Python ints in a list or a set.

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyFrozenSet, PyList, PySet, PyTuple};

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

/// Whether `values` is a list, tuple, set or frozenset of ints in `0..2**63` (no `bool`): the
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
    if let Ok(set) = values.cast::<PySet>() {
        return set.iter().all(|item| unsafe { is_block_id(item.as_ptr()) });
    }
    if let Ok(set) = values.cast::<PyFrozenSet>() {
        return set.iter().all(|item| unsafe { is_block_id(item.as_ptr()) });
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
