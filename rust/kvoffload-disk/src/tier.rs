//! `Tier`: the disk tier's store and load jobs, each job's chunks spread over the tier's I/O
//! threads (so many files are read or written at once), with an index of the chunks it holds
//! that answers lookups without I/O and holds `capacity_bytes` by evicting the least recently
//! used. The caller only submits and polls; the index is rebuilt from the directory on a thread
//! of its own at open, which then takes in, every `rescan`, what other engines sharing the
//! directory wrote.

use crate::chunks::ChunkFiles;
use crate::config::DiskConfig;
use crate::error::{DiskError, Result};
use crate::files;
use crate::gate::{Gate, Writes};
use crate::index::Index;
use crate::jobs::worker;
use crate::probes::{Probes, Verdict};
use crate::queue::{Item, Queue, Shared};
use crate::stats::Counters;
use crate::upkeep::{evict, rebuild};
use kvoffload_tier::breaker::{Breaker, BreakerState};
use kvoffload_tier::buf::{first_overlap, RawBuf, RawBufMut};
use kvoffload_tier::completion::{Completion, CompletionQueue};
use kvoffload_tier::status::{DROPPED, FAILED, PENDING};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub struct Tier {
    sh: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Tier {
    /// Opens the tier with `threads` I/O threads and room for `capacity_bytes` of files.
    pub fn open(
        cfg: DiskConfig,
        ns: [u8; 16],
        capacity_bytes: u64,
        threads: usize,
    ) -> Result<Self> {
        if !(1..=256).contains(&threads) {
            return Err(DiskError::Config(format!(
                "io_threads={threads} is out of range; allowed: 1 to 256"
            )));
        }
        cfg.check()?;
        let per_file = files::file_len(cfg.chunk_bytes);
        if capacity_bytes < per_file {
            return Err(DiskError::Config(format!(
                "capacity_bytes={capacity_bytes} holds no chunk; one takes {per_file} bytes"
            )));
        }
        let rescan = cfg.rescan;
        let max_store_bytes = cfg.max_store_bytes_in_flight;
        let breaker = Breaker::new(cfg.breaker_failures, cfg.breaker_cooldown);
        // A directory that may not be written keeps its files: past the capacity it forgets.
        let evict_files = cfg.evict_files && !cfg.read_only;
        let read_only = cfg.read_only;
        let evicted_keys = (evict_files && cfg.report_evictions).then(|| Mutex::new(Vec::new()));
        let probes_per_step = cfg.probes_per_step;
        let probes = Probes::new(probes_per_step, cfg.probe_miss_ttl);
        let failed_hold = rescan
            .unwrap_or(Duration::from_secs(10))
            .max(cfg.probe_miss_ttl);
        let tier = ChunkFiles::open(cfg, ns)?;
        let gate = Gate::new(tier.dir().to_path_buf(), per_file, read_only);
        let sh = Arc::new(Shared {
            tier,
            capacity_files: (capacity_bytes / per_file) as usize,
            jobs: CompletionQueue::new(Queue {
                probes: VecDeque::new(),
                loads: VecDeque::new(),
                stores: VecDeque::new(),
                open: HashMap::new(),
                done: Vec::new(),
                next_id: 1,
                closing: false,
                store_bytes: 0,
            }),
            index: Mutex::new(Index::default()),
            work_cv: Condvar::new(),
            closed_cv: Condvar::new(),
            scanned: AtomicBool::new(false),
            evicted: AtomicU64::new(0),
            max_store_bytes,
            dropped: AtomicU64::new(0),
            last_error: Mutex::new(None),
            breaker,
            denied: AtomicU64::new(0),
            evict_files,
            evicted_keys,
            read_only,
            gate,
            probes: Mutex::new(probes),
            failed_hold,
            probes_per_step,
        });
        let jobs = Tier {
            sh: sh.clone(),
            threads: Mutex::new(Vec::with_capacity(threads + 1)),
        };
        let spawn = |f: Box<dyn FnOnce() + Send>| {
            let handle = std::thread::Builder::new()
                .name("kvoffload-disk".into())
                .spawn(f)
                .map_err(|e| DiskError::io("starting the tier's I/O threads", e))?;
            jobs.threads
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(handle);
            Ok::<(), DiskError>(())
        };
        // A thread the system refuses stops open; those started are stopped by the drop.
        for _ in 0..threads {
            let sh = sh.clone();
            spawn(Box::new(move || worker(&sh)))?;
        }
        spawn(Box::new(move || rebuild(&sh, rescan)))?;
        Ok(jobs)
    }

    pub fn files(&self) -> &ChunkFiles {
        &self.sh.tier
    }

    /// Whether the index has taken in what the directory held at open (and evicted what did not
    /// fit the capacity).
    pub fn scanned(&self) -> bool {
        self.sh.scanned.load(Ordering::Acquire)
    }

    /// Why the last item failed (with the file's path), or None.
    pub fn last_error(&self) -> Option<String> {
        self.sh
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Store items dropped because `max_store_bytes_in_flight` was reached.
    pub fn stores_dropped(&self) -> u64 {
        self.sh.dropped.load(Ordering::Relaxed)
    }

    /// The breaker: "down" while a failing disk is left alone (every item fails at once).
    pub fn state(&self) -> BreakerState {
        self.sh.breaker.state()
    }

    /// Items failed at once, with no I/O, while the breaker was open.
    pub fn denied(&self) -> u64 {
        self.sh.denied.load(Ordering::Relaxed)
    }

    /// Chunks the index holds, and chunks evicted to hold the capacity.
    pub fn counts(&self) -> (usize, u64) {
        (
            self.sh.index().len(),
            self.sh.evicted.load(Ordering::Relaxed),
        )
    }

    /// How many of `keys`, from the first, the index holds (no I/O); none while the breaker is
    /// open (a load would fail).
    pub fn lookup_prefix(&self, keys: &[&[u8]]) -> usize {
        if self.sh.breaker.state() == BreakerState::Down {
            return 0;
        }
        let ix = self.sh.index();
        keys.iter().take_while(|k| ix.contains(k)).count()
    }

    /// `lookup_prefix`, and whether to ask again next step: where the index lacks a key, this
    /// step's probes (sent at `flush`) look for the files from there on, on the I/O threads, and
    /// until one has answered the lookup waits. `request` names who asks (a request's later keys
    /// join its probe). No I/O here.
    pub fn lookup(&self, keys: &[&[u8]], request: &str) -> (usize, bool) {
        let found = self.lookup_prefix(keys);
        if found == keys.len()
            || self.sh.probes_per_step == 0
            || self.sh.breaker.state() == BreakerState::Down
        {
            return (found, false);
        }
        let verdict = self
            .sh
            .probes()
            .ask(&keys[found..], request, false, Instant::now());
        (found, verdict == Verdict::Wait)
    }

    /// `lookup` of one key, for a caller that asks a prompt key by key (vLLM's tiering): a key
    /// that waits on a probe ends the step's lookups of a prompt with no hit before it (they
    /// are misses: the one file is looked for), and a prompt with hits has its later keys join
    /// its probe.
    pub fn lookup_key(&self, key: &[u8], request: &str) -> (bool, bool) {
        let found = self.lookup_prefix(&[key]) == 1;
        if self.sh.probes_per_step == 0 || self.sh.breaker.state() == BreakerState::Down {
            return (found, false);
        }
        let mut probes = self.sh.probes();
        if found {
            probes.hit(request);
            return (true, false);
        }
        let verdict = probes.ask(&[key], request, true, Instant::now());
        (false, verdict == Verdict::Wait)
    }

    /// Hands this step's probes to the I/O threads (once a step, after its lookups).
    pub fn flush(&self) {
        let sent = self.sh.probes().flush(Instant::now());
        if sent.is_empty() {
            return;
        }
        let mut q = self.sh.lock();
        if q.closing {
            // No thread is left to run them: they end finding nothing.
            drop(q);
            let mut probes = self.sh.probes();
            for keys in &sent {
                probes.done(keys, None, Instant::now());
            }
            return;
        }
        q.probes.extend(sent);
        drop(q);
        self.sh.work_cv.notify_all();
    }

    /// Probes sent or still to send.
    pub fn probes_in_flight(&self) -> usize {
        self.sh.probes().in_flight()
    }

    /// Whether stores are written now, or dropped (a full or read-only filesystem).
    pub fn writes(&self) -> Writes {
        self.sh.gate.writes()
    }

    /// The keys whose files eviction removed since the last call, oldest first (empty unless
    /// `report_evictions`): what an engine publishing KV events withdraws.
    pub fn take_evicted(&self) -> Vec<Vec<u8>> {
        match &self.sh.evicted_keys {
            Some(keys) => std::mem::take(&mut *keys.lock().unwrap_or_else(|p| p.into_inner())),
            None => Vec::new(),
        }
    }

    /// Takes `keys` into the index as just used, without I/O: chunks written through another
    /// handle on this directory, known here before the next scan lists them.
    pub fn note_present(&self, keys: &[&[u8]]) {
        {
            let mut ix = self.sh.index();
            for key in keys {
                ix.touch(key);
            }
        }
        // A probe's verdict from before they were written is stale now.
        self.sh.probes().clear_verdicts(keys);
        evict(&self.sh);
    }

    /// Drops `keys` from the index, without I/O and with no hold: chunks another handle on this
    /// directory evicted (their files are gone; stored again, they are found again).
    pub fn forget(&self, keys: &[&[u8]]) {
        let mut ix = self.sh.index();
        for key in keys {
            ix.remove(key);
        }
    }

    /// Drops `keys` from the index, without I/O: chunks a load through another handle found
    /// absent or damaged. They are misses until a later scan lists a file of one again, and
    /// for a rescan's interval at least (no probe finds them again meanwhile).
    pub fn note_missing(&self, keys: &[&[u8]]) {
        // Held first, then out of the index: a probe ending between the two sees the hold.
        {
            let until = Instant::now() + self.sh.failed_hold;
            let mut probes = self.sh.probes();
            for key in keys {
                probes.miss(key, until);
            }
        }
        let mut ix = self.sh.index();
        for key in keys {
            ix.remove(key);
        }
    }

    pub fn submit_store(&self, items: Vec<(Vec<u8>, RawBuf)>) -> Result<u64> {
        self.check(items.iter().map(|(k, b)| (k.len(), b.len())))?;
        Ok(self.submit(items.into_iter().map(|(k, b)| Item::Store(k, b)).collect()))
    }

    pub fn submit_load(&self, items: Vec<(Vec<u8>, RawBufMut)>) -> Result<u64> {
        self.check(items.iter().map(|(k, b)| (k.len(), b.len())))?;
        if let Some((a, b)) = first_overlap(&items) {
            return Err(DiskError::Config(format!(
                "load items {a} and {b} overlap in memory; each needs a chunk of its own"
            )));
        }
        Ok(self.submit(items.into_iter().map(|(k, b)| Item::Load(k, b)).collect()))
    }

    fn check(&self, items: impl Iterator<Item = (usize, usize)>) -> Result<()> {
        let chunk = self.sh.tier.chunk_bytes();
        for (i, (key, len)) in items.enumerate() {
            if len != chunk {
                return Err(DiskError::Config(format!(
                    "item {i} has {len} bytes; this tier's chunks are {chunk}"
                )));
            }
            if !(1..=files::MAX_KEY_BYTES).contains(&key) {
                return Err(DiskError::Config(format!(
                    "item {i} has a key of {key} bytes; allowed: 1 to {}",
                    files::MAX_KEY_BYTES
                )));
            }
        }
        Ok(())
    }

    fn submit(&self, items: Vec<Item>) -> u64 {
        let mut q = self.sh.lock();
        let id = q.next_id;
        q.next_id += 1;
        let chunk = self.sh.tier.chunk_bytes() as u64;
        let store_bytes = items
            .iter()
            .filter(|i| matches!(i, Item::Store(..)))
            .count() as u64
            * chunk;
        let full = store_bytes > 0 && q.store_bytes + store_bytes > self.sh.max_store_bytes;
        let read_only = store_bytes > 0 && self.sh.read_only;
        if items.is_empty() || q.closing || full || read_only {
            let status = if (full || read_only) && !q.closing {
                DROPPED
            } else {
                FAILED
            };
            if status == DROPPED {
                let n = items.len() as u64;
                if read_only {
                    Counters::add(&self.sh.tier.counters().stores_read_only, n);
                } else {
                    self.sh.dropped.fetch_add(n, Ordering::Relaxed);
                }
            }
            let statuses = vec![status; items.len()];
            let c = Completion {
                job_id: id,
                statuses,
            };
            self.sh.jobs.complete(q, c);
            return id;
        }
        q.store_bytes += store_bytes;
        q.open.insert(id, (vec![PENDING; items.len()], items.len()));
        for (i, item) in items.into_iter().enumerate() {
            match item {
                Item::Load(..) => q.loads.push_back((id, i, item)),
                Item::Store(..) => q.stores.push_back((id, i, item)),
            }
        }
        drop(q);
        self.sh.work_cv.notify_all();
        id
    }

    /// The jobs that completed since the last call.
    pub fn poll(&self) -> Vec<Completion> {
        self.sh.jobs.poll()
    }

    /// Waits up to `timeout` for a completion; returns every one there is.
    pub fn wait(&self, timeout: Duration) -> Vec<Completion> {
        self.sh.jobs.wait(timeout)
    }

    /// Waits until no job is in flight, or `timeout`; returns every completion there is.
    pub fn drain(&self, timeout: Duration) -> Vec<Completion> {
        self.sh.jobs.drain(timeout)
    }

    /// Jobs submitted and not yet complete.
    pub fn in_flight(&self) -> usize {
        self.sh.lock().open.len()
    }

    /// Finishes the jobs in flight (each item's I/O is bounded by the filesystem), then stops
    /// the threads; completions not taken stay for `poll`.
    pub fn close(&self) {
        self.sh.lock().closing = true;
        self.sh.work_cv.notify_all();
        self.sh.closed_cv.notify_all();
        // Joined under the lock: a second caller returns only once every thread has stopped
        // (the binding frees the lent buffers when close returns).
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        for h in threads.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Tier {
    fn drop(&mut self) {
        self.close();
    }
}
