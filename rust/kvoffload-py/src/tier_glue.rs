//! What the disk and the Redis tier classes do alike: store and load jobs over memory the caller
//! lends (as `lent.rs` says), and their completions handed out; every call that waits or does I/O
//! releases the GIL.

use crate::lent::{Lent, Loan};
use kvoffload_tier::buf::{RawBuf, RawBufMut};
use kvoffload_tier::completion::Completion;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;
use std::time::Duration;

/// The longest `wait` or `drain` a caller may ask for: a day.
const MAX_WAIT: Duration = Duration::from_secs(86400);

/// `[(job_id, statuses)]`, as Python takes completions.
type Completions<'py> = PyResult<Bound<'py, PyList>>;

/// A tier's job handle, as both tier classes drive it.
pub(crate) trait TierHandle: Sync {
    type Error: Send;

    fn chunk_bytes(&self) -> usize;
    fn submit_store(&self, items: Vec<(Vec<u8>, RawBuf)>) -> Result<u64, Self::Error>;
    fn submit_load(&self, items: Vec<(Vec<u8>, RawBufMut)>) -> Result<u64, Self::Error>;
    fn poll(&self) -> Vec<Completion>;
    fn wait(&self, timeout: Duration) -> Vec<Completion>;
    fn drain(&self, timeout: Duration) -> Vec<Completion>;
    /// Returns once no thread of the tier touches a lent buffer any more.
    fn close(&self);
    fn to_py(err: Self::Error) -> PyErr;
}

/// A tier's handle and the buffers lent to its jobs.
pub(crate) struct Lending<H> {
    // Declared first so it drops first: its drop joins the tier's threads, and only then may the
    // owners in `lent` release the memory those threads were reading or writing.
    pub(crate) handle: H,
    lent: Lent,
}

impl<H: TierHandle> Lending<H> {
    pub(crate) fn new(handle: H) -> Self {
        Lending {
            handle,
            lent: Lent::default(),
        }
    }

    pub(crate) fn submit_store(&self, py: Python<'_>, loan: Loan<'_, '_>) -> PyResult<u64> {
        // SAFETY: a `Loan` holds what one Python call gave (the client passes `buffer` with the
        // `base`/`capacity` of its memory), and `lend` keeps `buffer` alive until this job's
        // completion.
        let items = unsafe { loan.store_items(py, self.handle.chunk_bytes())? };
        self.lend(py, loan.buffer, |h| h.submit_store(items))
    }

    pub(crate) fn submit_load(&self, py: Python<'_>, loan: Loan<'_, '_>) -> PyResult<u64> {
        // SAFETY: as in `submit_store`.
        let items = unsafe { loan.load_items(py, self.handle.chunk_bytes())? };
        self.lend(py, loan.buffer, |h| h.submit_load(items))
    }

    pub(crate) fn poll<'py>(&self, py: Python<'py>) -> Completions<'py> {
        let done = py.detach(|| self.handle.poll());
        self.handed_out(py, done)
    }

    pub(crate) fn wait<'py>(&self, py: Python<'py>, timeout_s: f64) -> Completions<'py> {
        self.waited(py, timeout_s, H::wait)
    }

    pub(crate) fn drain<'py>(&self, py: Python<'py>, timeout_s: f64) -> Completions<'py> {
        self.waited(py, timeout_s, H::drain)
    }

    /// Closes the tier, then drops every owner: no thread touches a buffer any more, and the
    /// completions not taken yet stay for `poll` / `drain`.
    pub(crate) fn close(&self, py: Python<'_>) {
        py.detach(|| self.handle.close());
        self.lent.clear();
    }

    fn lend(
        &self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        submit: impl FnOnce(&H) -> Result<u64, H::Error> + Send,
    ) -> PyResult<u64> {
        self.lent
            .submit(py, buffer, || submit(&self.handle))
            .map_err(H::to_py)
    }

    /// What `wait_for` returns within `timeout_s`, waited for with the GIL released.
    fn waited<'py>(
        &self,
        py: Python<'py>,
        timeout_s: f64,
        wait_for: impl FnOnce(&H, Duration) -> Vec<Completion> + Send,
    ) -> Completions<'py> {
        let t = seconds("timeout_s", timeout_s, Duration::ZERO, MAX_WAIT)?;
        let done = py.detach(|| wait_for(&self.handle, t));
        self.handed_out(py, done)
    }

    fn handed_out<'py>(&self, py: Python<'py>, done: Vec<Completion>) -> Completions<'py> {
        let done = done.into_iter().map(|c| (c.job_id, c.statuses)).collect();
        self.lent.handed_out(py, done)
    }
}

/// Seconds as a `Duration`, or a ValueError naming the parameter and the allowed range.
pub(crate) fn seconds(name: &str, v: f64, lo: Duration, hi: Duration) -> PyResult<Duration> {
    if !v.is_finite() || v < lo.as_secs_f64() || v > hi.as_secs_f64() {
        return Err(PyValueError::new_err(format!(
            "{name}={v} is out of range; allowed: {} to {} seconds",
            lo.as_secs_f64(),
            hi.as_secs_f64()
        )));
    }
    Ok(Duration::from_secs_f64(v))
}
