//! The state a tier shares with its workers: the job queues (lookups and loads ahead of
//! stores), the completions waiting for the caller, and what every job reads (configuration,
//! breaker, counters).

use crate::breaker::Breaker;
use crate::config::Config;
use crate::conn::Target;
use crate::format::Layout;
use crate::jobs::{self, Ctx};
use crate::stats::{Counters, PerNode};
use kvoffload_tier::buf::{RawBuf, RawBufMut};
use kvoffload_tier::completion::{Completion, CompletionQueue, JobState};
use kvoffload_tier::status::{DROPPED, FAILED, MISSING};
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

pub(crate) enum Work {
    Lookup(Vec<Vec<u8>>),
    Store(Vec<(Vec<u8>, RawBuf)>),
    Load(Vec<(Vec<u8>, RawBufMut)>),
}

pub(crate) struct Job {
    pub(crate) id: u64,
    pub(crate) work: Work,
    /// When it was submitted: a worker taking it a whole budget later settles it unrun.
    pub(crate) queued_at: Instant,
}

impl Job {
    pub(crate) fn len(&self) -> usize {
        match &self.work {
            Work::Lookup(k) => k.len(),
            Work::Store(i) => i.len(),
            Work::Load(i) => i.len(),
        }
    }

    /// The chunk key of item `i`.
    pub(crate) fn key(&self, i: usize) -> &[u8] {
        match &self.work {
            Work::Lookup(k) => &k[i],
            Work::Store(items) => &items[i].0,
            Work::Load(items) => &items[i].0,
        }
    }

    /// Payload bytes moved by the job.
    pub(crate) fn bytes(&self, chunk: usize) -> u64 {
        match &self.work {
            Work::Lookup(_) => 0,
            _ => (self.len() * chunk) as u64,
        }
    }

    /// Statuses of a job that is not run: the tier is down, or the caller gave up on it.
    pub(crate) fn not_run(&self, closing: bool) -> Vec<u8> {
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
pub(crate) struct Queues {
    pub(crate) fast: VecDeque<Job>,
    pub(crate) stores: VecDeque<Job>,
    pub(crate) done: Vec<Completion>,
    pub(crate) running: usize,
    pub(crate) store_bytes: u64,
    pub(crate) closing: bool,
}

impl Queues {
    pub(crate) fn busy(&self) -> usize {
        self.fast.len() + self.stores.len() + self.running
    }
}

impl JobState for Queues {
    fn done(&mut self) -> &mut Vec<Completion> {
        &mut self.done
    }

    fn idle(&self) -> bool {
        self.busy() == 0
    }
}

pub(crate) struct Shared {
    pub(crate) cfg: Config,
    pub(crate) target: Target,
    /// The slot map, in cluster mode.
    pub(crate) cluster: Option<crate::cluster::ClusterState>,
    pub(crate) ns: [u8; 16],
    /// The namespaces a lookup needs every shard of (each rank's), `ns` among them.
    pub(crate) lookup_ns: Vec<[u8; 16]>,
    pub(crate) layout: Layout,
    pub(crate) jobs: CompletionQueue<Queues>,
    pub(crate) work_cv: Condvar,
    pub(crate) breaker: Breaker,
    pub(crate) stats: Counters,
    pub(crate) nodes: PerNode,
    pub(crate) last_error: Mutex<Option<String>>,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Queues> {
        self.jobs.lock()
    }

    pub(crate) fn ctx(&self) -> Ctx<'_> {
        Ctx {
            layout: self.layout,
            ns: &self.ns,
            lookup_ns: &self.lookup_ns,
            ttl_ms: self.cfg.ttl.map(|t| t.as_millis().max(1) as u64),
            touch_on_hit: self.cfg.touch_on_hit,
            cluster: self.cluster.is_some(),
            refused: std::cell::Cell::new(0),
            asked: std::cell::RefCell::new(Vec::new()),
            moved: std::cell::RefCell::new(Vec::new()),
            stats: &self.stats,
            last_error: &self.last_error,
        }
    }

    /// The one server's name in the per-node stats (a cluster's nodes are named by the map).
    pub(crate) fn server_name(&self) -> String {
        self.target.url.endpoint.to_string()
    }

    pub(crate) fn note(&self, why: String) {
        jobs::note(&self.last_error, why)
    }

    /// Counts items a job settles without running, for the stats.
    pub(crate) fn count_not_run(&self, job: &Job, statuses: &[u8]) {
        let n = statuses.len() as u64;
        match (&job.work, statuses.first()) {
            (Work::Store(_), Some(&DROPPED)) => Counters::add(&self.stats.stores_dropped, n),
            (Work::Store(_), _) => Counters::add(&self.stats.store_failures, n),
            (Work::Load(_), _) => Counters::add(&self.stats.load_failures, n),
            (Work::Lookup(_), _) => {}
        }
    }
}
