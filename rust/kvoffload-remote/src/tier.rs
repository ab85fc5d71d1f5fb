//! `Tier`: the engine. Jobs go into two queues (lookups and loads ahead of stores), worker threads
//! with one connection each run them, and completions wait in a list until the caller takes them.

use crate::breaker::{Admit, Backoff, Breaker, BreakerState};
use crate::config::Config;
use crate::conn::Conn;
use crate::error::{RemoteError, Result};
use crate::format::{Layout, KEY_PREFIX};
use crate::jobs::{self, CanaryOutcome, Ctx, RawBuf, RawBufMut};
use crate::stats::{Counters, Stats};
use crate::status::{DROPPED, FAILED, MISSING, PENDING};
use crate::url::{self, ServerUrl};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The outcome of one job: one status byte per item, in submission order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub job_id: u64,
    pub statuses: Vec<u8>,
}

enum Work {
    Lookup(Vec<Vec<u8>>),
    Store(Vec<(Vec<u8>, RawBuf)>),
    Load(Vec<(Vec<u8>, RawBufMut)>),
}

struct Job {
    id: u64,
    work: Work,
}

impl Job {
    fn len(&self) -> usize {
        match &self.work {
            Work::Lookup(k) => k.len(),
            Work::Store(i) => i.len(),
            Work::Load(i) => i.len(),
        }
    }

    /// Payload bytes moved by the job.
    fn bytes(&self, chunk: usize) -> u64 {
        match &self.work {
            Work::Lookup(_) => 0,
            _ => (self.len() * chunk) as u64,
        }
    }

    /// Statuses of a job that is not run: the tier is down, or the caller gave up on it.
    fn not_run(&self, closing: bool) -> Vec<u8> {
        let s = match (&self.work, closing) {
            (_, true) => FAILED,
            (Work::Lookup(_), false) => MISSING,
            (Work::Store(_), false) => DROPPED,
            (Work::Load(_), false) => FAILED,
        };
        vec![s; self.len()]
    }
}

#[derive(Default)]
struct Queues {
    fast: VecDeque<Job>,
    stores: VecDeque<Job>,
    done: Vec<Completion>,
    running: usize,
    store_bytes: u64,
    closing: bool,
}

impl Queues {
    fn busy(&self) -> usize {
        self.fast.len() + self.stores.len() + self.running
    }
}

struct Shared {
    cfg: Config,
    url: ServerUrl,
    ns: [u8; 16],
    layout: Layout,
    q: Mutex<Queues>,
    work_cv: Condvar,
    done_cv: Condvar,
    breaker: Breaker,
    stats: Counters,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        // Workers never panic while holding the lock with the queues half-updated.
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            layout: self.layout,
            ns: &self.ns,
            ttl_ms: self.cfg.ttl.map(|t| t.as_millis().max(1) as u64),
            touch_on_hit: self.cfg.touch_on_hit,
            stats: &self.stats,
        }
    }

    /// Counts items a job settles without running, for the stats.
    fn count_not_run(&self, job: &Job, statuses: &[u8]) {
        let n = statuses.len() as u64;
        match (&job.work, statuses.first()) {
            (Work::Store(_), Some(&DROPPED)) => Counters::add(&self.stats.stores_dropped, n),
            (Work::Store(_), _) => Counters::add(&self.stats.store_failures, n),
            (Work::Load(_), _) => Counters::add(&self.stats.load_failures, n),
            (Work::Lookup(_), _) => {}
        }
    }
}

/// One worker's connection state.
struct Worker {
    conn: Option<Conn>,
    ever_connected: bool,
    backoff: Backoff,
    retry_at: Option<Instant>,
}

impl Worker {
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
            match Conn::connect(&sh.url, connect_by) {
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
        let ctx = sh.ctx();
        let conn = self.connection(sh, deadline)?;
        match &mut job.work {
            Work::Lookup(keys) => jobs::lookup(conn, &ctx, keys, st),
            Work::Store(items) => jobs::store(conn, &ctx, items, st),
            Work::Load(items) => jobs::load(conn, &ctx, items, st),
        }
    }

    fn run(&mut self, sh: &Shared, job: &mut Job) -> Vec<u8> {
        let admit = sh.breaker.admit();
        if admit == Admit::Deny {
            let st = job.not_run(false);
            sh.count_not_run(job, &st);
            return st;
        }
        let deadline = Instant::now() + sh.cfg.job_budget(job.bytes(sh.layout.chunk_bytes));
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
        match result {
            Ok(()) => sh.breaker.success(),
            Err(e) => {
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

fn worker_loop(sh: Arc<Shared>, mut w: Worker) {
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
        sh.done_cv.notify_all();
    }
}

/// A Redis / Valkey tier: asynchronous lookups, stores and loads of fixed-size chunks.
pub struct Tier {
    sh: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    next_id: AtomicU64,
    startup_error: Option<String>,
}

impl Tier {
    /// Parses and checks the configuration, tries one connection within `connect_timeout` and
    /// starts the workers. Refused credentials or database are an error; an unreachable server
    /// is not: the tier starts down and [`Tier::startup_error`] says why.
    pub fn connect(cfg: Config, namespace: [u8; 16]) -> Result<Tier> {
        cfg.validate()?;
        let url = url::parse(&cfg.url)?;
        let sh = Arc::new(Shared {
            layout: Layout::new(cfg.chunk_bytes),
            breaker: Breaker::new(cfg.breaker_failures, cfg.breaker_cooldown),
            url,
            ns: namespace,
            q: Mutex::new(Queues::default()),
            work_cv: Condvar::new(),
            done_cv: Condvar::new(),
            stats: Counters::default(),
            cfg,
        });
        let mut first = None;
        let mut startup_error = None;
        match Conn::connect(&sh.url, Instant::now() + sh.cfg.connect_timeout) {
            Ok(c) => first = Some(c),
            Err(e @ (RemoteError::Auth(_) | RemoteError::Config(_))) => return Err(e),
            Err(e) => {
                Counters::add(&sh.stats.connect_failures, 1);
                sh.breaker.trip();
                Counters::add(&sh.stats.breaker_opens, 1);
                startup_error = Some(format!("{} unreachable: {e}", url::mask(&sh.cfg.url)));
            }
        }
        let mut workers = Vec::with_capacity(sh.cfg.connections);
        for i in 0..sh.cfg.connections {
            let w = Worker {
                ever_connected: first.is_some(),
                conn: first.take(),
                backoff: Backoff::new(i as u64 + 1),
                retry_at: None,
            };
            let sh2 = Arc::clone(&sh);
            let spawned = std::thread::Builder::new()
                .name(format!("kvo-remote-{i}"))
                .spawn(move || worker_loop(sh2, w));
            match spawned {
                Ok(h) => workers.push(h),
                Err(e) => {
                    let tier = Tier {
                        sh,
                        workers: Mutex::new(workers),
                        next_id: AtomicU64::new(1),
                        startup_error,
                    };
                    tier.close();
                    return Err(RemoteError::Io(format!("starting worker thread: {e}")));
                }
            }
        }
        Ok(Tier {
            sh,
            workers: Mutex::new(workers),
            next_id: AtomicU64::new(1),
            startup_error,
        })
    }

    pub fn chunk_bytes(&self) -> usize {
        self.sh.layout.chunk_bytes
    }

    /// Why the server was unreachable at start-up, if it was.
    pub fn startup_error(&self) -> Option<&str> {
        self.startup_error.as_deref()
    }

    pub fn state(&self) -> BreakerState {
        self.sh.breaker.state()
    }

    fn check_len(&self, i: usize, len: usize) -> Result<()> {
        if len != self.sh.layout.chunk_bytes {
            return Err(RemoteError::Config(format!(
                "item {i} has {len} bytes; allowed: exactly chunk_bytes={}",
                self.sh.layout.chunk_bytes
            )));
        }
        Ok(())
    }

    fn submit(&self, work: Work) -> Result<u64> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let job = Job { id, work };
        let bytes = job.bytes(self.sh.layout.chunk_bytes);
        let mut q = self.sh.lock();
        if q.closing {
            return Err(RemoteError::Closed);
        }
        let is_store = matches!(job.work, Work::Store(_));
        let over = is_store && q.store_bytes + bytes > self.sh.cfg.max_store_bytes_in_flight;
        // Fail fast while down or over the store budget: no queueing, no I/O, never blocking.
        if over || self.sh.breaker.state() == BreakerState::Down || job.len() == 0 {
            let statuses = if over {
                vec![DROPPED; job.len()]
            } else {
                job.not_run(false)
            };
            self.sh.count_not_run(&job, &statuses);
            q.done.push(Completion {
                job_id: id,
                statuses,
            });
            drop(q);
            self.sh.done_cv.notify_all();
            return Ok(id);
        }
        if is_store {
            q.store_bytes += bytes;
            q.stores.push_back(job);
        } else {
            q.fast.push_back(job);
        }
        drop(q);
        self.sh.work_cv.notify_one();
        Ok(id)
    }

    /// Which keys the server holds (OK) or not (MISSING); refreshes the hits' LRU clocks.
    pub fn submit_lookup(&self, keys: Vec<Vec<u8>>) -> Result<u64> {
        self.submit(Work::Lookup(keys))
    }

    /// Stores each payload under its key, unless the key is already stored (EXISTS).
    pub fn submit_store(&self, items: Vec<(Vec<u8>, RawBuf)>) -> Result<u64> {
        for (i, (_, b)) in items.iter().enumerate() {
            self.check_len(i, b.len())?;
        }
        self.submit(Work::Store(items))
    }

    /// Loads each key into its buffer; only items with status OK hold valid data afterwards.
    pub fn submit_load(&self, items: Vec<(Vec<u8>, RawBufMut)>) -> Result<u64> {
        for (i, (_, b)) in items.iter().enumerate() {
            self.check_len(i, b.len())?;
        }
        self.submit(Work::Load(items))
    }

    /// The completions ready now.
    pub fn poll(&self) -> Vec<Completion> {
        std::mem::take(&mut self.sh.lock().done)
    }

    /// Waits until at least one completion is ready, or `timeout`.
    pub fn wait(&self, timeout: Duration) -> Vec<Completion> {
        self.wait_until(timeout, |q| !q.done.is_empty())
    }

    /// Waits until no job is queued or running, or `timeout`; returns every completion ready.
    pub fn drain(&self, timeout: Duration) -> Vec<Completion> {
        self.wait_until(timeout, |q| q.busy() == 0)
    }

    fn wait_until(&self, timeout: Duration, ready: impl Fn(&Queues) -> bool) -> Vec<Completion> {
        let end = Instant::now().checked_add(timeout);
        let mut q = self.sh.lock();
        while !ready(&q) {
            let left = match end {
                Some(end) => end.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                break;
            }
            q = self
                .sh
                .done_cv
                .wait_timeout(q, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        std::mem::take(&mut q.done)
    }

    /// Jobs queued or running.
    pub fn in_flight(&self) -> usize {
        self.sh.lock().busy()
    }

    pub fn stats(&self) -> Stats {
        let (jobs, bytes) = {
            let q = self.sh.lock();
            (q.busy() as u64, q.store_bytes)
        };
        self.sh.stats.snapshot(jobs, bytes, self.sh.breaker.state())
    }

    /// Stores `identity` under a canary key of this namespace unless one is there, and compares.
    /// Runs on the calling thread with its own connection, bounded by `timeout`.
    pub fn canary(&self, name: &[u8], identity: &[u8], timeout: Duration) -> Result<CanaryOutcome> {
        if self.sh.breaker.state() == BreakerState::Down {
            let why = self
                .startup_error
                .as_deref()
                .unwrap_or("the circuit breaker is open");
            return Ok(CanaryOutcome::Down(why.to_string()));
        }
        let mut key = KEY_PREFIX.to_vec();
        key.extend_from_slice(&self.sh.ns);
        key.extend_from_slice(b":canary:");
        key.extend_from_slice(name);
        let deadline = Instant::now() + timeout;
        let res = Conn::connect(&self.sh.url, deadline)
            .and_then(|mut c| jobs::canary(&mut c, &key, identity, self.sh.ctx().ttl_ms));
        match res {
            Ok(o) => Ok(o),
            Err(e @ (RemoteError::Io(_) | RemoteError::Timeout(_))) => {
                Ok(CanaryOutcome::Down(e.to_string()))
            }
            Err(e) => Err(e),
        }
    }

    /// Stops taking jobs, fails the queued ones (their completions stay for `poll` / `drain`),
    /// lets running ones finish within their deadlines and joins the workers. Idempotent.
    pub fn close(&self) {
        let queued: Vec<Job> = {
            let mut q = self.sh.lock();
            q.closing = true;
            let mut jobs: Vec<Job> = q.fast.drain(..).collect();
            jobs.extend(q.stores.drain(..));
            for j in &jobs {
                let st = j.not_run(true);
                self.sh.count_not_run(j, &st);
                if let Work::Store(_) = j.work {
                    q.store_bytes -= j.bytes(self.sh.layout.chunk_bytes);
                }
                q.done.push(Completion {
                    job_id: j.id,
                    statuses: st,
                });
            }
            jobs
        };
        drop(queued);
        self.sh.work_cv.notify_all();
        self.sh.done_cv.notify_all();
        let handles = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for h in handles {
            let _ = h.join();
        }
    }
}

impl Drop for Tier {
    fn drop(&mut self) {
        self.close();
    }
}
