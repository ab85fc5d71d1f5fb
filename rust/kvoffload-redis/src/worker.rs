//! A worker thread: one connection, jobs taken from the tier's queues in order (lookups and
//! loads first), each run within its budget and its completion handed to the tier.

use crate::breaker::{Admit, Backoff};
use crate::conn::Conn;
use crate::error::{RemoteError, Result};
use crate::jobs;
use crate::queue::{Job, Shared, Work};
use crate::routing::NodeConns;
use crate::stats::Counters;
use kvoffload_tier::completion::Completion;
use kvoffload_tier::status::{FAILED, PENDING};
use std::sync::Arc;
use std::time::Instant;

/// One worker's connection state.
pub(crate) struct Worker {
    conn: Option<Conn>,
    /// In cluster mode, the connections to the primaries instead of `conn`.
    nodes: NodeConns,
    ever_connected: bool,
    backoff: Backoff,
    retry_at: Option<Instant>,
}

impl Worker {
    /// Starts with `first`, the tier's start-up connection, if any; `seed` spreads the
    /// workers' reconnect backoffs apart.
    pub(crate) fn new(first: Option<Conn>, seed: u64) -> Worker {
        Worker {
            ever_connected: first.is_some(),
            conn: first,
            nodes: NodeConns::default(),
            backoff: Backoff::new(seed),
            retry_at: None,
        }
    }

    /// A usable connection, or the error that fails the job.
    fn connection(&mut self, sh: &Shared, deadline: Instant) -> Result<&mut Conn> {
        if self.conn.is_none() {
            if let Some(at) = self.retry_at {
                let now = Instant::now();
                if at > now {
                    std::thread::sleep((at - now).min(deadline.saturating_duration_since(now)));
                }
            }
            let connect_by = deadline.min(Instant::now() + sh.cfg.connect_timeout);
            match Conn::connect(&sh.target, connect_by) {
                Ok(c) => {
                    if self.ever_connected {
                        Counters::add(&sh.stats.reconnects, 1);
                    }
                    self.ever_connected = true;
                    self.backoff.reset();
                    self.retry_at = None;
                    self.conn = Some(c);
                }
                Err(e) => {
                    Counters::add(&sh.stats.connect_failures, 1);
                    self.retry_at = Some(Instant::now() + self.backoff.next_delay());
                    return Err(e);
                }
            }
        }
        let conn = self.conn.as_mut().expect("connected above");
        conn.set_deadline(deadline);
        Ok(conn)
    }

    fn attempt(
        &mut self,
        sh: &Shared,
        job: &mut Job,
        st: &mut [u8],
        deadline: Instant,
    ) -> Result<()> {
        if let Some(cl) = &sh.cluster {
            return self.nodes.attempt(sh, cl, job, st, deadline);
        }
        let ctx = sh.ctx();
        let conn = self.connection(sh, deadline)?;
        let res = match &mut job.work {
            Work::Lookup(keys) => jobs::lookup(conn, &ctx, keys, st),
            Work::Store(items) => jobs::store(conn, &ctx, items, st),
            Work::Load(items) => jobs::load(conn, &ctx, items, st),
        };
        sh.nodes.failed(&sh.server_name(), ctx.refused.get());
        res
    }

    fn run(&mut self, sh: &Shared, job: &mut Job) -> Vec<u8> {
        let budget = sh.cfg.job_budget(job.bytes(sh.layout.chunk_bytes));
        let waited = job.queued_at.elapsed();
        if waited > budget {
            // Lookups and loads go first, so a store can wait without bound while the engine
            // keeps its CPU slots pinned. Past its budget it is settled unrun; the server never
            // saw it, so the breaker does not count it.
            Counters::add(&sh.stats.expired_in_queue, 1);
            sh.note(format!(
                "a job of {} items waited {waited:?} in the queue, past its budget of \
                 {budget:?}; settled without I/O",
                job.len()
            ));
            let st = job.not_run(false);
            sh.count_not_run(job, &st);
            return st;
        }
        let admit = sh.breaker.admit();
        if admit == Admit::Deny {
            let st = job.not_run(false);
            sh.count_not_run(job, &st);
            return st;
        }
        let deadline = Instant::now() + budget;
        let mut st = vec![PENDING; job.len()];
        let reused = self.conn.is_some();
        let mut result = self.attempt(sh, job, &mut st, deadline);
        // A pooled connection may have died while idle (server restart): one retry on a fresh
        // one, if nothing was settled. Replays are harmless: SET NX, GET, EXISTS, TOUCH.
        if reused && matches!(result, Err(RemoteError::Io(_))) && st.iter().all(|&s| s == PENDING) {
            self.conn = None;
            self.retry_at = None;
            result = self.attempt(sh, job, &mut st, deadline);
        }
        if sh.cluster.is_none() {
            // A cluster's nodes are counted by the routing, node by node.
            let store = matches!(job.work, Work::Store(_));
            if !matches!(job.work, Work::Lookup(_)) {
                sh.nodes
                    .moved(&sh.server_name(), store, &st, sh.layout.chunk_bytes);
            }
            if result.is_err() {
                sh.nodes.failed(&sh.server_name(), 1);
            }
        }
        match result {
            Ok(()) => sh.breaker.success(),
            Err(e) => {
                sh.note(e.to_string());
                match &e {
                    RemoteError::Timeout(_) => Counters::add(&sh.stats.timeouts, 1),
                    RemoteError::Protocol(_) => Counters::add(&sh.stats.protocol_errors, 1),
                    _ => {}
                }
                if e.breaks_connection() || self.conn.is_none() {
                    self.conn = None;
                }
                if sh.breaker.failure(admit == Admit::Probe) {
                    Counters::add(&sh.stats.breaker_opens, 1);
                }
                let failed = st.iter().filter(|&&s| s == PENDING).count() as u64;
                match job.work {
                    Work::Store(_) => Counters::add(&sh.stats.store_failures, failed),
                    Work::Load(_) => Counters::add(&sh.stats.load_failures, failed),
                    Work::Lookup(_) => {}
                }
                for s in st.iter_mut().filter(|s| **s == PENDING) {
                    *s = FAILED;
                }
            }
        }
        st
    }
}

pub(crate) fn worker_loop(sh: Arc<Shared>, mut w: Worker) {
    loop {
        let mut job = {
            let mut q = sh.lock();
            loop {
                if let Some(j) = q.fast.pop_front().or_else(|| q.stores.pop_front()) {
                    q.running += 1;
                    break j;
                }
                if q.closing {
                    return;
                }
                q = sh.work_cv.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        let statuses = w.run(&sh, &mut job);
        let mut q = sh.lock();
        q.running -= 1;
        if let Work::Store(_) = job.work {
            q.store_bytes -= job.bytes(sh.layout.chunk_bytes);
        }
        q.done.push(Completion {
            job_id: job.id,
            statuses,
        });
        drop(q);
        // Dropped after the completion is out: the caller may reuse the memory from then on.
        drop(job);
        sh.jobs.notify();
    }
}
