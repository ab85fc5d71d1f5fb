//! Counters shared by the workers, and their snapshot.

use crate::breaker::BreakerState;
use std::sync::atomic::{AtomicU64, Ordering};

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
