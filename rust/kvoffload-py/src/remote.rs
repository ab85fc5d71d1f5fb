//! `RemoteTier`: the Redis / Valkey tier of `kvoffload-redis` (its jobs driven as `tier_glue.rs`
//! says).

use crate::errors::RemoteError;
use crate::keys::{new_bytes, KeyArg};
use crate::lent::Loan;
use crate::tier_glue::{seconds, Lending, TierHandle};
use kvoffload_redis::{
    self as remote, CanaryOutcome, Completion, Config, LookupTable, RawBuf, RawBufMut, Tier,
    TlsConfig,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

fn to_py(err: remote::RemoteError) -> PyErr {
    match err {
        remote::RemoteError::Config(_) => PyValueError::new_err(err.to_string()),
        _ => RemoteError::new_err(err.to_string()),
    }
}

impl TierHandle for Tier {
    type Error = remote::RemoteError;

    fn chunk_bytes(&self) -> usize {
        Tier::chunk_bytes(self)
    }
    fn submit_store(&self, items: Vec<(Vec<u8>, RawBuf)>) -> remote::Result<u64> {
        Tier::submit_store(self, items)
    }
    fn submit_load(&self, items: Vec<(Vec<u8>, RawBufMut)>) -> remote::Result<u64> {
        Tier::submit_load(self, items)
    }
    fn poll(&self) -> Vec<Completion> {
        Tier::poll(self)
    }
    fn wait(&self, timeout: Duration) -> Vec<Completion> {
        Tier::wait(self, timeout)
    }
    fn drain(&self, timeout: Duration) -> Vec<Completion> {
        Tier::drain(self, timeout)
    }
    fn close(&self) {
        Tier::close(self)
    }
    fn to_py(err: remote::RemoteError) -> PyErr {
        to_py(err)
    }
}

/// A Redis / Valkey tier for chunks of `chunk_bytes`; every call that waits or does I/O releases
/// the GIL.
#[pyclass(frozen, module = "kvoffload._rust")]
pub struct RemoteTier {
    io: Lending<Tier>,
}

/// Chunks per node of a cluster of `nodes` primaries (the simulator's shared tier).
#[pyfunction]
fn cluster_node_counts(
    py: Python<'_>,
    keys: &Bound<'_, PyAny>,
    nodes: usize,
) -> PyResult<Vec<u64>> {
    if !(1..=MAX_NODES).contains(&nodes) {
        return Err(PyValueError::new_err(format!(
            "nodes={nodes} is out of range; allowed: 1 to {MAX_NODES}"
        )));
    }
    KeyArg::extract(keys)?.run(py, |k| Ok(remote::cluster::node_counts(k, nodes)))
}

/// Redis Cluster's own limit on primaries is about 1000.
const MAX_NODES: usize = 1000;

/// The URL with its password hidden, as the tier's own messages show it.
#[pyfunction]
fn mask_remote_url(url: &str) -> String {
    remote::url::mask(url)
}

impl RemoteTier {
    fn tier(&self) -> &Tier {
        &self.io.handle
    }

    fn keys(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u8>>> {
        KeyArg::extract(keys)?.run(py, |k| Ok(k.iter().map(|k| k.to_vec()).collect()))
    }
}

#[pymethods]
impl RemoteTier {
    #[new]
    #[pyo3(signature = (
        url, namespace, chunk_bytes, *, connect_timeout_s = 1.0, job_timeout_s = 2.0,
        min_bandwidth_mb_s = 100.0, connections = 2, breaker_failures = 3,
        breaker_cooldown_s = 2.0, ttl_s = None, max_store_bytes_in_flight = 1_073_741_824,
        touch_on_hit = true, tls_ca_file = None, tls_cert_file = None, tls_key_file = None,
        tls_server_name = None, lookup_namespaces = None, cluster = None, password_file = None,
        password_env = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: &str,
        namespace: &[u8],
        chunk_bytes: usize,
        connect_timeout_s: f64,
        job_timeout_s: f64,
        min_bandwidth_mb_s: f64,
        connections: usize,
        breaker_failures: u32,
        breaker_cooldown_s: f64,
        ttl_s: Option<f64>,
        max_store_bytes_in_flight: u64,
        touch_on_hit: bool,
        tls_ca_file: Option<PathBuf>,
        tls_cert_file: Option<PathBuf>,
        tls_key_file: Option<PathBuf>,
        tls_server_name: Option<String>,
        lookup_namespaces: Option<Vec<Vec<u8>>>,
        cluster: Option<bool>,
        password_file: Option<PathBuf>,
        password_env: Option<String>,
    ) -> PyResult<Self> {
        use remote::config::{MIN_BANDWIDTH_RANGE, TIMEOUT_MAX, TIMEOUT_MIN, TTL_MAX};
        let digest = |name: &str, bytes: &[u8]| -> PyResult<[u8; 16]> {
            bytes.try_into().map_err(|_| {
                PyValueError::new_err(format!(
                    "{name} has {} bytes; allowed: exactly 16 (a digest)",
                    bytes.len()
                ))
            })
        };
        let ns = digest("namespace", namespace)?;
        let lookup_ns = match lookup_namespaces {
            None => vec![ns],
            Some(list) => list
                .iter()
                .map(|d| digest("a lookup namespace", d))
                .collect::<PyResult<_>>()?,
        };
        let (lo, hi) = MIN_BANDWIDTH_RANGE;
        let (lo, hi) = (lo as f64 / 1e6, hi as f64 / 1e6);
        if !min_bandwidth_mb_s.is_finite() || min_bandwidth_mb_s < lo || min_bandwidth_mb_s > hi {
            return Err(PyValueError::new_err(format!(
                "min_bandwidth_mb_s={min_bandwidth_mb_s} is out of range; allowed: {lo} to {hi}"
            )));
        }
        let mut cfg = Config::new(url, chunk_bytes);
        cfg.password_file = password_file;
        cfg.password_env = password_env;
        cfg.connect_timeout = seconds(
            "connect_timeout_s",
            connect_timeout_s,
            TIMEOUT_MIN,
            TIMEOUT_MAX,
        )?;
        cfg.job_timeout = seconds("job_timeout_s", job_timeout_s, TIMEOUT_MIN, TIMEOUT_MAX)?;
        cfg.min_bandwidth = (min_bandwidth_mb_s * 1e6) as u64;
        cfg.connections = connections;
        cfg.breaker_failures = breaker_failures;
        cfg.breaker_cooldown = seconds(
            "breaker_cooldown_s",
            breaker_cooldown_s,
            TIMEOUT_MIN,
            TIMEOUT_MAX,
        )?;
        cfg.ttl = ttl_s
            .map(|t| seconds("ttl_s", t, TIMEOUT_MIN, TTL_MAX))
            .transpose()?;
        cfg.max_store_bytes_in_flight = max_store_bytes_in_flight;
        cfg.touch_on_hit = touch_on_hit;
        cfg.cluster = cluster;
        cfg.tls = TlsConfig {
            ca_file: tls_ca_file,
            cert_file: tls_cert_file,
            key_file: tls_key_file,
            server_name: tls_server_name,
        };
        let tier = py
            .detach(|| Tier::connect_shards(cfg, ns, lookup_ns))
            .map_err(to_py)?;
        Ok(RemoteTier {
            io: Lending::new(tier),
        })
    }

    #[getter]
    fn startup_error(&self) -> Option<String> {
        self.tier().startup_error().map(str::to_string)
    }

    /// Why the last failure happened (a job's error, a server's error reply, a corrupt value),
    /// or None.
    #[getter]
    fn last_error(&self) -> Option<String> {
        self.tier().last_error()
    }

    #[getter]
    fn state(&self) -> &'static str {
        self.tier().state().name()
    }

    #[getter]
    fn chunk_bytes(&self) -> usize {
        self.tier().chunk_bytes()
    }

    /// `("written" | "matched" | "down", None)` or `("differs", existing_identity)`; never
    /// raises for the server's sake: why it is down is in `last_error`.
    #[pyo3(signature = (name, identity, timeout_s = 1.0))]
    fn canary<'py>(
        &self,
        py: Python<'py>,
        name: &[u8],
        identity: &[u8],
        timeout_s: f64,
    ) -> PyResult<(&'static str, Option<Bound<'py, PyBytes>>)> {
        use remote::config::{TIMEOUT_MAX, TIMEOUT_MIN};
        let timeout = seconds("timeout_s", timeout_s, TIMEOUT_MIN, TIMEOUT_MAX)?;
        let (name, identity) = (name.to_vec(), identity.to_vec());
        let outcome = py.detach(|| self.tier().canary(&name, &identity, timeout));
        Ok(match outcome {
            CanaryOutcome::Written => ("written", None),
            CanaryOutcome::Matched => ("matched", None),
            CanaryOutcome::Differs(v) => ("differs", Some(new_bytes(py, &v)?)),
            CanaryOutcome::Down(_) => ("down", None),
        })
    }

    fn submit_lookup(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<u64> {
        let keys = self.keys(py, keys)?;
        py.detach(|| self.tier().submit_lookup(keys)).map_err(to_py)
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

    fn wait<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Bound<'py, PyList>> {
        self.io.wait(py, timeout_s)
    }

    fn drain<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Bound<'py, PyList>> {
        self.io.drain(py, timeout_s)
    }

    fn in_flight(&self, py: Python<'_>) -> usize {
        py.detach(|| self.tier().in_flight())
    }

    /// Counters and gauges; `breaker_state` is 0 up, 1 down, 2 half-open.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = py.detach(|| self.tier().stats());
        let d = PyDict::new(py);
        for (name, v) in stats.to_pairs() {
            d.set_item(name, v)?;
        }
        Ok(d)
    }

    /// Per node (`host:port`, or the unix socket's path): `bytes_written`, `bytes_read`,
    /// `failures` and `resting` (1 while it is left alone after a failure).
    fn node_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let nodes = py.detach(|| self.tier().node_stats());
        let d = PyDict::new(py);
        for (name, s) in nodes {
            let n = PyDict::new(py);
            n.set_item("bytes_written", s.bytes_written)?;
            n.set_item("bytes_read", s.bytes_read)?;
            n.set_item("failures", s.failures)?;
            n.set_item("resting", u64::from(s.resting))?;
            d.set_item(name, n)?;
        }
        Ok(d)
    }

    /// Joins the workers, then drops every owner: no worker touches a buffer any more, and the
    /// completions not taken yet stay for `poll` / `drain`.
    fn close(&self, py: Python<'_>) {
        self.io.close(py);
    }
}

/// A Redis tier's existence verdicts (`LookupTable`) over a `RemoteTier` of their own: it
/// takes every completion that tier has. Answers that arrived are applied at the first lookup
/// after a flush and at the next flush.
#[pyclass(frozen, module = "kvoffload._rust")]
pub struct RemoteLookups {
    tier: Py<RemoteTier>,
    table: Mutex<(LookupTable, bool)>,
}

impl RemoteLookups {
    fn table(&self) -> MutexGuard<'_, (LookupTable, bool)> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn poll(&self, table: &mut LookupTable) {
        for c in self.tier.get().tier().poll() {
            table.apply(c.job_id, &c.statuses);
        }
    }

    fn locked<T>(&self, f: impl FnOnce(&mut LookupTable) -> T) -> T {
        let mut guard = self.table();
        let (table, need_poll) = &mut *guard;
        if std::mem::take(need_poll) {
            self.poll(table);
        }
        f(table)
    }
}

#[pymethods]
impl RemoteLookups {
    #[new]
    fn new(tier: Py<RemoteTier>) -> Self {
        RemoteLookups {
            tier,
            table: Mutex::new((LookupTable::new(), false)),
        }
    }

    fn lookup(&self, key: &[u8], request: &str) -> Option<bool> {
        self.locked(|t| t.lookup(key, request))
    }

    fn lookup_prefix(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        request: &str,
    ) -> PyResult<(usize, bool)> {
        KeyArg::extract(keys)?.run(py, |k| Ok(self.locked(|t| t.prefix(k, request))))
    }

    fn flush(&self, py: Python<'_>) {
        py.detach(|| {
            let mut guard = self.table();
            let (table, need_poll) = &mut *guard;
            self.poll(table);
            *need_poll = true;
            table.flush(|keys| self.tier.get().tier().submit_lookup(keys));
        })
    }

    fn mark_miss(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        KeyArg::extract(keys)?.run(py, |k| {
            self.locked(|t| t.mark_miss(k));
            Ok(())
        })
    }

    fn cleanup(&self, py: Python<'_>, request: &str) {
        py.detach(|| self.locked(|t| t.cleanup(request)))
    }

    fn in_flight(&self) -> usize {
        self.table().0.in_flight()
    }

    fn __len__(&self) -> usize {
        self.table().0.len()
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<RemoteTier>()?;
    m.add_class::<RemoteLookups>()?;
    m.add_function(wrap_pyfunction!(mask_remote_url, m)?)?;
    m.add_function(wrap_pyfunction!(cluster_node_counts, m)?)?;
    m.add("RemoteError", py.get_type::<RemoteError>())?;
    for (name, v) in [
        ("REMOTE_OK", remote::status::OK),
        ("REMOTE_MISSING", remote::status::MISSING),
        ("REMOTE_CORRUPT", remote::status::CORRUPT),
        ("REMOTE_FAILED", remote::status::FAILED),
        ("REMOTE_DROPPED", remote::status::DROPPED),
        ("REMOTE_EXISTS", remote::status::EXISTS),
    ] {
        m.add(name, v)?;
    }
    Ok(())
}
