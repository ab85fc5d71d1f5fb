//! The exception types of `kvoffload._rust` and the mapping of core errors onto them.

use kvoffload_core::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PyValueError};
use pyo3::PyErr;

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

create_exception!(
    _rust,
    RemoteError,
    KVOffloadError,
    "The remote (Redis / Valkey) tier refused the configuration: credentials, database, or it is closed."
);

pub(crate) fn to_py(err: Error) -> PyErr {
    match err {
        Error::InvalidKeyLength { .. }
        | Error::InvalidArgument { .. }
        | Error::UnknownPolicy { .. } => PyValueError::new_err(err.to_string()),
        Error::InvalidState { .. } => InvalidStateError::new_err(err.to_string()),
        Error::OutOfMemory { .. } => PyMemoryError::new_err(err.to_string()),
        Error::BrokenInvariant(_) => KVOffloadError::new_err(err.to_string()),
    }
}
