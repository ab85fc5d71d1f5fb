//! `Tier`: the engine. Jobs go into two queues (lookups and loads ahead of stores), worker threads
//! with one connection each run them, and completions wait in a list until the caller takes them.

use crate::breaker::{Breaker, BreakerState};
use crate::cluster::{self, ClusterState, SlotMap};
use crate::config::Config;
use crate::conn::{Conn, Target};
use crate::credentials::Credentials;
use crate::error::{RemoteError, Result};
use crate::format::{Layout, KEY_PREFIX};
use crate::jobs::{self, CanaryOutcome};
use crate::probe;
use crate::queue::{Job, Queues, Shared, Work};
use crate::stats::{Counters, NodeStats, PerNode, Stats};
use crate::tls;
use crate::url;
use crate::url::Endpoint;
use crate::worker::{worker_loop, Worker};
use kvoffload_tier::buf::{self, RawBuf, RawBufMut};
use kvoffload_tier::completion::{Completion, CompletionQueue};
use kvoffload_tier::status::DROPPED;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Connects to the first seed that answers and learns whether it is a cluster (and its slot
/// map): the start-up connection (given to a worker when not a cluster), the cluster's state,
/// and why no seed answered, if none did. Refused credentials, TLS failures, a url whose
/// scheme does not fit the port (found out by a probe, only after a failed connect) and a
/// configuration that does not fit the server are errors.
fn first_contact(
    cfg: &Config,
    target: &Target,
) -> Result<(Option<Conn>, Option<ClusterState>, Option<RemoteError>)> {
    let url = &target.url;
    let seeds = &url.seeds;
    if seeds.len() > 1 && cfg.cluster == Some(false) {
        return Err(RemoteError::Config(format!(
            "the url names {} hosts with cluster=false; allowed: one host, or several seed \
             nodes of a cluster (cluster=true or \"auto\")",
            seeds.len()
        )));
    }
    if cfg.cluster == Some(true) && seeds.is_empty() {
        return Err(RemoteError::Config(
            "cluster=true with a unix:// url; allowed: redis:// or rediss:// seed nodes".into(),
        ));
    }
    let db_in_cluster = || {
        RemoteError::Config(format!(
            "database {} in the url of a cluster; allowed: 0 (Redis Cluster has only database 0)",
            url.db
        ))
    };
    if cfg.cluster == Some(true) && url.db != 0 {
        return Err(db_in_cluster());
    }
    let endpoints: Vec<Endpoint> = if seeds.is_empty() {
        vec![url.endpoint.clone()]
    } else {
        seeds
            .iter()
            .map(|(host, port)| Endpoint::Tcp {
                host: host.clone(),
                port: *port,
            })
            .collect()
    };
    let mut unreachable = None;
    let mut saw_cluster = false;
    for endpoint in &endpoints {
        let by = Instant::now() + cfg.connect_timeout;
        let mut conn = match Conn::connect_to(target, endpoint, by) {
            Ok(c) => c,
            Err(e @ (RemoteError::Auth(_) | RemoteError::Config(_) | RemoteError::Tls(_))) => {
                return Err(e)
            }
            Err(e) => {
                if let Some(wrong) = wrong_scheme(target, endpoint) {
                    return Err(wrong);
                }
                unreachable = Some(e);
                continue;
            }
        };
        let is_cluster = match cfg.cluster {
            Some(c) => c,
            // A server that refuses INFO (an ACL) is taken as one server, as before clusters.
            None => match cluster::enabled(&mut conn) {
                Ok(c) => c,
                Err(RemoteError::Server(_)) => false,
                Err(e) => {
                    unreachable = Some(e);
                    continue;
                }
            },
        };
        if !is_cluster {
            if seeds.len() > 1 {
                return Err(RemoteError::Config(format!(
                    "the url names {} hosts, but {endpoint} is not in cluster mode; allowed: \
                     one host for a single server",
                    seeds.len()
                )));
            }
            return Ok((Some(conn), None, None));
        }
        saw_cluster = true;
        if url.db != 0 {
            return Err(db_in_cluster());
        }
        let Endpoint::Tcp { host, .. } = endpoint else {
            unreachable!("cluster=true with a unix:// url is refused above")
        };
        match cluster::fetch(&mut conn, host) {
            Ok(map) => return Ok((None, Some(ClusterState::new(map, seeds.clone())), None)),
            Err(RemoteError::Server(m)) => {
                return Err(RemoteError::Config(format!(
                    "cluster=true, but {endpoint} refused CLUSTER SLOTS: {m}"
                )))
            }
            Err(RemoteError::Protocol(m)) => {
                return Err(RemoteError::Config(format!(
                    "{endpoint} answered CLUSTER SLOTS with what we cannot route by: {m}"
                )))
            }
            Err(e) => unreachable = Some(e),
        }
    }
    // Nobody answered: the tier starts down, as a cluster if the configuration or a seed says so.
    let is_cluster = cfg.cluster.unwrap_or(saw_cluster || seeds.len() > 1);
    let state = is_cluster.then(|| ClusterState::new(SlotMap::empty(), seeds.clone()));
    Ok((None, state, unreachable))
}

/// After a failed start-up connect: the error to stop start-up with when the port speaks the
/// other protocol than the url's scheme (probed), or `None`.
fn wrong_scheme(target: &Target, endpoint: &Endpoint) -> Option<RemoteError> {
    if !matches!(endpoint, Endpoint::Tcp { .. }) {
        return None;
    }
    if target.tls.is_some() {
        probe::answers_resp(endpoint).then(|| {
            RemoteError::Tls(format!(
                "{endpoint} answers plaintext RESP: it is a plain port (use redis:// there, \
                 rediss:// only against a tls-port)"
            ))
        })
    } else {
        probe::speaks_tls(endpoint).then(|| {
            RemoteError::Tls(format!(
                "{endpoint} speaks TLS: it is a TLS port (use rediss://, with tls_ca_file, there)"
            ))
        })
    }
}

/// The most shards one chunk may have (ranks of one engine): bounds a lookup's EXISTS.
pub const MAX_SHARDS: usize = 1024;

/// A Redis / Valkey tier: asynchronous lookups, stores and loads of fixed-size chunks.
pub struct Tier {
    sh: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    next_id: AtomicU64,
    startup_error: Option<String>,
}

impl Tier {
    /// Parses and checks the configuration, tries one connection within `connect_timeout` and
    /// starts the workers. Refused credentials or database, and a TLS failure (a certificate
    /// that does not verify, TLS against a plain port or the reverse) are an error; an
    /// unreachable server is not: the tier starts down and [`Tier::startup_error`] says why.
    pub fn connect(cfg: Config, namespace: [u8; 16]) -> Result<Tier> {
        Tier::connect_shards(cfg, namespace, vec![namespace])
    }

    /// [`Tier::connect`] for a tier whose chunks are stored as shards, one per namespace of
    /// `lookup_namespaces` (each worker's rank writes its own): a lookup finds a chunk only when
    /// every shard is there. Stores and loads use `namespace` alone.
    pub fn connect_shards(
        cfg: Config,
        namespace: [u8; 16],
        lookup_namespaces: Vec<[u8; 16]>,
    ) -> Result<Tier> {
        cfg.validate()?;
        if lookup_namespaces.is_empty() || lookup_namespaces.len() > MAX_SHARDS {
            return Err(RemoteError::Config(format!(
                "{} lookup namespaces; allowed: 1 to {MAX_SHARDS}",
                lookup_namespaces.len()
            )));
        }
        if !lookup_namespaces.contains(&namespace) {
            return Err(RemoteError::Config(
                "the lookup namespaces lack the tier's own namespace; allowed: every rank's, \
                 this one's among them"
                    .into(),
            ));
        }
        let url = url::parse(&cfg.url)?;
        let tls = tls::client(&url, &cfg.tls)?;
        let creds = Credentials::new(&url, &cfg)?;
        let target = Target { url, tls, creds };
        let (mut first, cluster, unreachable) = first_contact(&cfg, &target)?;
        let sh = Arc::new(Shared {
            layout: Layout::new(cfg.chunk_bytes),
            breaker: Breaker::new(cfg.breaker_failures, cfg.breaker_cooldown),
            target,
            cluster,
            ns: namespace,
            lookup_ns: lookup_namespaces,
            jobs: CompletionQueue::new(Queues::default()),
            work_cv: Condvar::new(),
            stats: Counters::default(),
            nodes: PerNode::default(),
            last_error: Mutex::new(None),
            cfg,
        });
        let mut startup_error = None;
        if let Some(e) = unreachable {
            Counters::add(&sh.stats.connect_failures, 1);
            if sh.cluster.is_none() {
                sh.nodes.failed(&sh.server_name(), 1);
            }
            sh.breaker.trip();
            Counters::add(&sh.stats.breaker_opens, 1);
            startup_error = Some(format!("{} unreachable: {e}", url::mask(&sh.cfg.url)));
        }
        let mut workers = Vec::with_capacity(sh.cfg.connections);
        for i in 0..sh.cfg.connections {
            let w = Worker::new(first.take(), i as u64 + 1);
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

    /// Why the last thing that failed did: a job's error, a server's error reply, a corrupt
    /// value, a split or expired store, a canary that found the server down.
    pub fn last_error(&self) -> Option<String> {
        self.sh
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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
        let job = Job {
            id,
            work,
            queued_at: Instant::now(),
        };
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
            let c = Completion {
                job_id: id,
                statuses,
            };
            self.sh.jobs.complete(q, c);
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
    /// Refuses items whose buffers overlap.
    pub fn submit_load(&self, items: Vec<(Vec<u8>, RawBufMut)>) -> Result<u64> {
        for (i, (_, b)) in items.iter().enumerate() {
            self.check_len(i, b.len())?;
        }
        if let Some((a, b)) = buf::first_overlap(&items) {
            return Err(RemoteError::Config(format!(
                "items {a} and {b} of the load overlap in memory; allowed: disjoint buffers of \
                 chunk_bytes={} each",
                self.sh.layout.chunk_bytes
            )));
        }
        self.submit(Work::Load(items))
    }

    /// The completions ready now.
    pub fn poll(&self) -> Vec<Completion> {
        self.sh.jobs.poll()
    }

    /// Waits until at least one completion is ready, or `timeout`.
    pub fn wait(&self, timeout: Duration) -> Vec<Completion> {
        self.sh.jobs.wait(timeout)
    }

    /// Waits until no job is queued or running, or `timeout`; returns every completion ready.
    pub fn drain(&self, timeout: Duration) -> Vec<Completion> {
        self.sh.jobs.drain(timeout)
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

    /// Each node's stats by name (`host:port`): every primary of the current map and every
    /// node that ever moved a byte or failed, or the one server.
    pub fn node_stats(&self) -> Vec<(String, NodeStats)> {
        match &self.sh.cluster {
            Some(cl) => {
                let resting = cl.resting_names();
                let map = cl.map();
                self.sh
                    .nodes
                    .snapshot(map.nodes.iter().map(crate::cluster::node_name), |n| {
                        resting.iter().any(|r| r == n)
                    })
            }
            None => {
                let down = self.sh.breaker.state() == BreakerState::Down;
                self.sh.nodes.snapshot([self.sh.server_name()], |_| down)
            }
        }
    }

    /// Stores `identity` under a canary key of this namespace unless one is there, and compares.
    /// Runs on the calling thread with its own connection, bounded by `timeout`. Never fails:
    /// whatever goes wrong (down, OOM, READONLY, NOPERM, garbage) is `Down`, as the caller
    /// only warns.
    pub fn canary(&self, name: &[u8], identity: &[u8], timeout: Duration) -> CanaryOutcome {
        if self.sh.breaker.state() == BreakerState::Down {
            let why = self
                .startup_error
                .as_deref()
                .unwrap_or("the circuit breaker is open");
            return CanaryOutcome::Down(why.to_string());
        }
        let mut key = KEY_PREFIX.to_vec();
        key.extend_from_slice(&self.sh.ns);
        key.extend_from_slice(b":canary:");
        key.extend_from_slice(name);
        let deadline = Instant::now() + timeout;
        let endpoint = match &self.sh.cluster {
            None => Ok(self.sh.target.url.endpoint.clone()),
            // The node that owns the canary key's slot.
            Some(cl) => {
                let map = cl.map();
                map.node_of(&key)
                    .map(|n| Endpoint::Tcp {
                        host: map.nodes[n].0.clone(),
                        port: map.nodes[n].1,
                    })
                    .ok_or_else(|| RemoteError::Io("no node serves the canary's slot".into()))
            }
        };
        let res = endpoint
            .and_then(|ep| Conn::connect_to(&self.sh.target, &ep, deadline))
            .and_then(|mut c| jobs::canary(&mut c, &key, identity, self.sh.ctx().ttl_ms));
        res.unwrap_or_else(|e| {
            let why = format!("canary: {e}");
            self.sh.note(why.clone());
            CanaryOutcome::Down(why)
        })
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
        self.sh.jobs.notify();
        // Joined under the lock: a second caller returns only once every worker has stopped
        // (the binding frees the lent buffers when close returns).
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        for h in workers.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Tier {
    fn drop(&mut self) {
        self.close();
    }
}
