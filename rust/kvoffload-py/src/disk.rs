//! `DiskTier`: the disk tier of `kvoffload-disk` (its jobs driven as `tier_glue.rs` says); every
//! call that waits or does I/O releases the GIL.

use crate::keys::KeyArg;
use crate::lent::Loan;
use crate::tier_glue::{Lending, TierHandle};
use kvoffload_disk::{BreakerState, Completion, DirectIo, DiskConfig, DiskError, Tier as Jobs};
use kvoffload_tier::buf::{RawBuf, RawBufMut};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::path::PathBuf;
use std::time::Duration;

fn to_py(err: DiskError) -> PyErr {
    match err {
        DiskError::Config(_) => PyValueError::new_err(err.to_string()),
        DiskError::Io(..) => PyOSError::new_err(err.to_string()),
    }
}

impl TierHandle for Jobs {
    type Error = DiskError;

    fn chunk_bytes(&self) -> usize {
        self.files().chunk_bytes()
    }
    fn submit_store(&self, items: Vec<(Vec<u8>, RawBuf)>) -> Result<u64, DiskError> {
        Jobs::submit_store(self, items)
    }
    fn submit_load(&self, items: Vec<(Vec<u8>, RawBufMut)>) -> Result<u64, DiskError> {
        Jobs::submit_load(self, items)
    }
    fn poll(&self) -> Vec<Completion> {
        Jobs::poll(self)
    }
    fn wait(&self, timeout: Duration) -> Vec<Completion> {
        Jobs::wait(self, timeout)
    }
    fn drain(&self, timeout: Duration) -> Vec<Completion> {
        Jobs::drain(self, timeout)
    }
    fn close(&self) {
        Jobs::close(self)
    }
    fn to_py(err: DiskError) -> PyErr {
        to_py(err)
    }
}

#[pyclass(frozen, module = "kvoffload._rust")]
pub struct DiskTier {
    io: Lending<Jobs>,
}

impl DiskTier {
    fn jobs(&self) -> &Jobs {
        &self.io.handle
    }
}

#[pymethods]
impl DiskTier {
    #[new]
    #[pyo3(signature = (
        path, namespace, chunk_bytes, capacity_bytes, *, direct_io = "auto", io_threads = 8,
        rescan_interval_s = 10.0, max_store_bytes_in_flight = 1_073_741_824,
        breaker_failures = 3, breaker_cooldown_s = 10.0, evict_files = true, read_only = false,
        probes_per_step = 64, probe_miss_ttl_s = 1.0, file_mode = 0o600, report_evictions = false,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        namespace: &[u8],
        chunk_bytes: usize,
        capacity_bytes: u64,
        direct_io: &str,
        io_threads: usize,
        rescan_interval_s: f64,
        max_store_bytes_in_flight: u64,
        breaker_failures: u32,
        breaker_cooldown_s: f64,
        evict_files: bool,
        read_only: bool,
        probes_per_step: i64,
        probe_miss_ttl_s: f64,
        file_mode: u32,
        report_evictions: bool,
    ) -> PyResult<Self> {
        if !breaker_cooldown_s.is_finite() || !(0.01..=3600.0).contains(&breaker_cooldown_s) {
            return Err(PyValueError::new_err(format!(
                "breaker_cooldown_s={breaker_cooldown_s} is out of range; allowed: 0.01 to 3600 \
                 seconds"
            )));
        }
        if !rescan_interval_s.is_finite() || !(0.0..=86400.0).contains(&rescan_interval_s) {
            return Err(PyValueError::new_err(format!(
                "rescan_interval_s={rescan_interval_s} is out of range; allowed: 0 (only at \
                 start-up) to 86400 seconds"
            )));
        }
        if !probe_miss_ttl_s.is_finite() || !(0.0..=3600.0).contains(&probe_miss_ttl_s) {
            return Err(PyValueError::new_err(format!(
                "probe_miss_ttl_s={probe_miss_ttl_s} is out of range; allowed: 0 to 3600 seconds"
            )));
        }
        if !(0..=100_000).contains(&probes_per_step) {
            return Err(PyValueError::new_err(format!(
                "probes_per_step={probes_per_step} is out of range; allowed: 0 (none) to 100000"
            )));
        }
        let ns: [u8; 16] = namespace.try_into().map_err(|_| {
            PyValueError::new_err(format!(
                "namespace has {} bytes; allowed: exactly 16 (a digest)",
                namespace.len()
            ))
        })?;
        let direct = match direct_io {
            "auto" => DirectIo::Auto,
            "on" => DirectIo::On,
            "off" => DirectIo::Off,
            other => {
                return Err(PyValueError::new_err(format!(
                    "direct_io={other:?} is invalid; allowed: \"auto\", \"on\", \"off\""
                )))
            }
        };
        let mut cfg = DiskConfig::new(path, chunk_bytes);
        cfg.direct = direct;
        cfg.rescan = (rescan_interval_s > 0.0).then(|| Duration::from_secs_f64(rescan_interval_s));
        cfg.max_store_bytes_in_flight = max_store_bytes_in_flight;
        cfg.breaker_failures = breaker_failures;
        cfg.breaker_cooldown = Duration::from_secs_f64(breaker_cooldown_s);
        cfg.evict_files = evict_files;
        cfg.report_evictions = report_evictions;
        cfg.read_only = read_only;
        cfg.probes_per_step = probes_per_step as usize;
        cfg.probe_miss_ttl = Duration::from_secs_f64(probe_miss_ttl_s);
        cfg.file_mode = file_mode;
        let jobs = py
            .detach(|| Jobs::open(cfg, ns, capacity_bytes, io_threads))
            .map_err(to_py)?;
        Ok(DiskTier {
            io: Lending::new(jobs),
        })
    }

    #[getter]
    fn chunk_bytes(&self) -> usize {
        self.jobs().files().chunk_bytes()
    }

    /// Whether reads and writes bypass the page cache (`O_DIRECT`).
    #[getter]
    fn direct(&self) -> bool {
        self.jobs().files().direct()
    }

    /// Whether the index has taken in what the directory held at open.
    #[getter]
    fn scanned(&self) -> bool {
        self.jobs().scanned()
    }

    /// Why the last item failed (with the file's path), or None.
    #[getter]
    fn last_error(&self) -> Option<String> {
        self.jobs().last_error()
    }

    /// The breaker: "up", "down" (a failing disk: every item fails at once) or "half-open".
    #[getter]
    fn state(&self) -> &'static str {
        self.jobs().state().name()
    }

    /// How many of `keys`, from the first, the tier holds (its index: no I/O).
    fn lookup_prefix(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        KeyArg::extract(keys)?.run(py, |k| Ok(self.jobs().lookup_prefix(k)))
    }

    /// `lookup_prefix`, and whether to ask again next step: where the index lacks a key, this
    /// step's probes look for the files on the I/O threads (sent at `flush`). No I/O here.
    fn lookup(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        request: &str,
    ) -> PyResult<(usize, bool)> {
        KeyArg::extract(keys)?.run(py, |k| Ok(self.jobs().lookup(k, request)))
    }

    /// `lookup` of one key (a caller that asks key by key, as vLLM's tiering): whether the
    /// index holds it, and whether to ask again next step.
    fn lookup_key(&self, py: Python<'_>, key: &[u8], request: &str) -> (bool, bool) {
        py.detach(|| self.jobs().lookup_key(key, request))
    }

    /// Hands this step's probes to the I/O threads (once a step, after its lookups).
    fn flush(&self) {
        self.jobs().flush();
    }

    /// Probes sent or still to send.
    fn probes_in_flight(&self) -> usize {
        self.jobs().probes_in_flight()
    }

    /// Whether stores are written: "ok", "full" or "read-only" (dropped, reads go on).
    #[getter]
    fn writes(&self) -> &'static str {
        self.jobs().writes().name()
    }

    /// What open found worth saying once (a directory it could not create, O_DIRECT unknown).
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.jobs().files().notes().to_vec()
    }

    /// Takes `keys` into the index as just used, without I/O (written through another handle).
    fn note_present(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        KeyArg::extract(keys)?.run(py, |k| {
            self.jobs().note_present(k);
            Ok(())
        })
    }

    /// The keys whose files eviction removed since the last call (with `report_evictions`).
    fn take_evicted<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        let keys = self.jobs().take_evicted();
        keys.iter().map(|k| PyBytes::new(py, k)).collect()
    }

    /// Drops `keys` from the index with no hold (another handle evicted them).
    fn forget(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        KeyArg::extract(keys)?.run(py, |k| {
            self.jobs().forget(k);
            Ok(())
        })
    }

    /// Drops `keys` from the index, without I/O (a load through another handle missed them).
    fn note_missing(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        KeyArg::extract(keys)?.run(py, |k| {
            self.jobs().note_missing(k);
            Ok(())
        })
    }

    fn submit_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffer: &Bound<'_, PyAny>,
        base: u64,
        capacity: i64,
        offsets: Vec<i64>,
    ) -> PyResult<u64> {
        self.io
            .submit_store(py, Loan::new(keys, buffer, base, capacity, offsets))
    }

    fn submit_load(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffer: &Bound<'_, PyAny>,
        base: u64,
        capacity: i64,
        offsets: Vec<i64>,
    ) -> PyResult<u64> {
        self.io
            .submit_load(py, Loan::new(keys, buffer, base, capacity, offsets))
    }

    fn poll<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.io.poll(py)
    }

    /// Waits until every job in flight has completed, or `timeout_s`; returns the completions.
    fn drain<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Bound<'py, PyList>> {
        self.io.drain(py, timeout_s)
    }

    fn in_flight(&self) -> usize {
        self.jobs().in_flight()
    }

    /// The tier's counters, and `chunks` (what its index holds) and `evicted`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.jobs().files().stats();
        let (chunks, evicted) = self.jobs().counts();
        let d = PyDict::new(py);
        for (name, v) in [
            ("stored_chunks", s.stored_chunks),
            ("store_exists", s.store_exists),
            ("store_failures", s.store_failures),
            ("stores_full", s.stores_full),
            ("stores_read_only", s.stores_read_only),
            ("probed", s.probed),
            ("probe_hits", s.probe_hits),
            ("symlinks", s.symlinks),
            ("loaded_chunks", s.loaded_chunks),
            ("load_missing", s.load_missing),
            ("load_failures", s.load_failures),
            ("corrupt", s.corrupt),
            ("bytes_written", s.bytes_written),
            ("bytes_read", s.bytes_read),
            ("stores_dropped", self.jobs().stores_dropped()),
            ("denied", self.jobs().denied()),
            ("breaker_state", breaker_state(self.jobs().state())),
            ("chunks", chunks as u64),
            ("evicted", evicted),
        ] {
            d.set_item(name, v)?;
        }
        Ok(d)
    }

    /// Finishes the jobs in flight and stops the I/O threads, then drops every owner.
    fn close(&self, py: Python<'_>) {
        self.io.close(py);
    }
}

/// As the Redis tier reports it: 0 up, 1 down, 2 half-open.
fn breaker_state(state: BreakerState) -> u64 {
    match state {
        BreakerState::Up => 0,
        BreakerState::Down => 1,
        BreakerState::HalfOpen => 2,
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DiskTier>()
}
