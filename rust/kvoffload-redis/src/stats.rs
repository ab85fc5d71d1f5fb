//! Counters shared by the workers (the tier's, and each node's), and their snapshot.

use crate::breaker::BreakerState;
use kvoffload_tier::status::OK;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        #[derive(Default)]
        pub(crate) struct Counters {
            $(pub(crate) $name: AtomicU64,)*
        }

        /// A snapshot of the tier's counters (monotonic) and gauges.
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct Stats {
            $(pub $name: u64,)*
            pub jobs_in_flight: u64,
            pub store_bytes_in_flight: u64,
            pub breaker_state: BreakerState,
        }

        impl Counters {
            pub(crate) fn snapshot(
                &self,
                jobs: u64,
                store_bytes: u64,
                state: BreakerState,
            ) -> Stats {
                Stats {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                    jobs_in_flight: jobs,
                    store_bytes_in_flight: store_bytes,
                    breaker_state: state,
                }
            }
        }

        impl Stats {
            /// Every field as (name, value); the breaker state as 0 up, 1 down, 2 half-open.
            pub fn to_pairs(&self) -> Vec<(&'static str, u64)> {
                vec![
                    $((stringify!($name), self.$name),)*
                    ("jobs_in_flight", self.jobs_in_flight),
                    ("store_bytes_in_flight", self.store_bytes_in_flight),
                    ("breaker_state", match self.breaker_state {
                        BreakerState::Up => 0,
                        BreakerState::Down => 1,
                        BreakerState::HalfOpen => 2,
                    }),
                ]
            }
        }
    };
}

counters!(
    lookup_keys,
    lookup_hits,
    stored_chunks,
    store_exists,
    stores_dropped,
    store_failures,
    loaded_chunks,
    load_missing,
    corrupt,
    load_failures,
    bytes_written,
    bytes_read,
    timeouts,
    reconnects,
    connect_failures,
    breaker_opens,
    deleted_corrupt,
    server_errors,
    protocol_errors,
    // Jobs settled unrun because they waited in the queue past their whole budget.
    expired_in_queue,
);

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        if n != 0 {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Takes back what an attempt counted for items that run again (a cluster's `MOVED`);
    /// never below zero.
    pub(crate) fn sub(c: &AtomicU64, n: u64) {
        if n != 0 {
            let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n))
            });
        }
    }
}

/// What one node (a cluster's primary, or the one server) moved, and how often it failed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    pub bytes_written: u64,
    pub bytes_read: u64,
    /// Failures on this node: a job (or its part here) whose connection failed (connect, I/O,
    /// timeout, protocol error), and each error reply (OOM, READONLY, CLUSTERDOWN, ...).
    pub failures: u64,
    /// Left alone now after a failure: a cluster's node resting for the breaker's cool-down, the
    /// one server while the tier's breaker is open.
    pub resting: bool,
}

/// More nodes than a cluster has (about 1,000 at most): past it a new name is not counted, so a
/// flapping topology cannot grow the metrics without bound.
const MAX_NODE_NAMES: usize = 2048;

/// [`NodeStats`] by node name (`host:port`), updated once per node per job.
#[derive(Default)]
pub(crate) struct PerNode(Mutex<BTreeMap<String, NodeStats>>);

impl PerNode {
    fn with(&self, node: &str, f: impl FnOnce(&mut NodeStats)) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = m.get_mut(node) {
            f(s);
        } else if m.len() < MAX_NODE_NAMES {
            f(m.entry(node.to_string()).or_default());
        }
    }

    /// A job's items that `node` settled with `statuses`: each `OK` moved one chunk.
    pub(crate) fn moved(&self, node: &str, store: bool, statuses: &[u8], chunk_bytes: usize) {
        let bytes = statuses.iter().filter(|&&s| s == OK).count() as u64 * chunk_bytes as u64;
        if bytes > 0 {
            self.with(node, |s| {
                if store {
                    s.bytes_written += bytes;
                } else {
                    s.bytes_read += bytes;
                }
            });
        }
    }

    /// `n` more failures on `node` (a failed connection or job, or error replies).
    pub(crate) fn failed(&self, node: &str, n: u64) {
        if n > 0 {
            self.with(node, |s| s.failures += n);
        }
    }

    /// Every node seen, and `also` (the nodes of the current map), with `resting` from `rests`.
    pub(crate) fn snapshot(
        &self,
        also: impl IntoIterator<Item = String>,
        rests: impl Fn(&str) -> bool,
    ) -> Vec<(String, NodeStats)> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for node in also {
            m.entry(node).or_default();
        }
        m.into_iter()
            .map(|(node, mut s)| {
                s.resting = rests(&node);
                (node, s)
            })
            .collect()
    }
}
