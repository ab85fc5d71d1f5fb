//! `DiskJobs`: the disk tier's store and load jobs, each job's chunks spread over the tier's I/O
//! threads (so many files are read or written at once), with an index of the chunks it holds
//! that answers lookups without I/O and holds `capacity_bytes` by evicting the least recently
//! used. The caller only submits and polls; the index is rebuilt from the directory on a thread
//! of its own at open, which then takes in, every `rescan`, what other engines sharing the
//! directory wrote.

use crate::config::DiskConfig;
use crate::error::{DiskError, Result};
use crate::files;
use crate::gate::{Gate, Shut, Writes};
use crate::index::Index;
use crate::probes::{ProbeKeys, Probes, Verdict};
use crate::stats::Counters;
use crate::tier::{DiskTier, Loaded, Stored};
use kvoffload_format::breaker::{Admit, Breaker, BreakerState};
use kvoffload_format::buf::{first_overlap, RawBuf, RawBufMut};
use kvoffload_format::status::{CORRUPT, DROPPED, EXISTS, FAILED, MISSING, OK, PENDING};
use std::collections::HashSet;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A job's id and each item's status (`kvoffload_format::status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub job_id: u64,
    pub statuses: Vec<u8>,
}

enum Item {
    Store(Vec<u8>, RawBuf),
    Load(Vec<u8>, RawBufMut),
}

struct Queue {
    /// Probes go first, then loads: a request waits on them, while stores only fill the tier.
    probes: VecDeque<ProbeKeys>,
    loads: VecDeque<(u64, usize, Item)>,
    stores: VecDeque<(u64, usize, Item)>,
    /// Per job: its statuses so far, and how many items are left.
    open: HashMap<u64, (Vec<u8>, usize)>,
    done: Vec<Completion>,
    next_id: u64,
    closing: bool,
    /// Bytes of store items queued or being written.
    store_bytes: u64,
}

struct Shared {
    tier: DiskTier,
    capacity_files: usize,
    q: Mutex<Queue>,
    index: Mutex<Index>,
    work_cv: Condvar,
    done_cv: Condvar,
    /// Notified at close: the rescan thread waits on it between scans.
    closed_cv: Condvar,
    scanned: AtomicBool,
    evicted: AtomicU64,
    /// Store jobs past `max_store_bytes` are dropped whole (their items DROPPED), never queued:
    /// a disk slower than the engine stores must not grow the queue without bound.
    max_store_bytes: u64,
    dropped: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// Trips on I/O failures in a row: a failing disk then costs no I/O (and no thread's wait)
    /// per item until a probe finds it working again.
    breaker: Breaker,
    /// Items failed at once, with no I/O, while the breaker was open.
    denied: AtomicU64,
    evict_files: bool,
    read_only: bool,
    /// Whether stores are written now (a full or read-only filesystem drops them without I/O).
    gate: Gate,
    probes: Mutex<Probes>,
    /// How long a chunk whose load failed stays a miss (a rescan's interval: vLLM's livelock
    /// guard, a failed read retried at most once a rescan).
    failed_hold: Duration,
    /// 0: the index answers alone (no lock of the probes taken).
    probes_per_step: usize,
}

impl Shared {
    fn note(&self, why: String) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn probes(&self) -> MutexGuard<'_, Probes> {
        self.probes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub struct DiskJobs {
    sh: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl DiskJobs {
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
        let probes_per_step = cfg.probes_per_step;
        let probes = Probes::new(probes_per_step, cfg.probe_miss_ttl);
        let failed_hold = rescan
            .unwrap_or(Duration::from_secs(10))
            .max(cfg.probe_miss_ttl);
        let tier = DiskTier::open(cfg, ns)?;
        let gate = Gate::new(tier.dir().to_path_buf(), per_file, read_only);
        let sh = Arc::new(Shared {
            tier,
            capacity_files: (capacity_bytes / per_file) as usize,
            q: Mutex::new(Queue {
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
            done_cv: Condvar::new(),
            closed_cv: Condvar::new(),
            scanned: AtomicBool::new(false),
            evicted: AtomicU64::new(0),
            max_store_bytes,
            dropped: AtomicU64::new(0),
            last_error: Mutex::new(None),
            breaker,
            denied: AtomicU64::new(0),
            evict_files,
            read_only,
            gate,
            probes: Mutex::new(probes),
            failed_hold,
            probes_per_step,
        });
        let jobs = DiskJobs {
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

    pub fn tier(&self) -> &DiskTier {
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

    /// Takes `keys` into the index as just used, without I/O: chunks written through another
    /// handle on this directory, known here before the next scan lists them.
    pub fn note_present(&self, keys: &[&[u8]]) {
        {
            let mut ix = self.sh.index();
            for key in keys {
                ix.touch(key);
            }
        }
        evict(&self.sh);
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
            q.done.push(Completion {
                job_id: id,
                statuses,
            });
            drop(q);
            self.sh.done_cv.notify_all();
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
        std::mem::take(&mut self.sh.lock().done)
    }

    /// Waits up to `timeout` for a completion; returns every one there is.
    pub fn wait(&self, timeout: Duration) -> Vec<Completion> {
        self.wait_until(timeout, |q| !q.done.is_empty())
    }

    /// Waits until no job is in flight, or `timeout`; returns every completion there is.
    pub fn drain(&self, timeout: Duration) -> Vec<Completion> {
        self.wait_until(timeout, |q| q.open.is_empty())
    }

    fn wait_until(&self, timeout: Duration, ready: impl Fn(&Queue) -> bool) -> Vec<Completion> {
        let deadline = Instant::now() + timeout;
        let mut q = self.sh.lock();
        while !ready(&q) {
            let left = deadline.saturating_duration_since(Instant::now());
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

impl Drop for DiskJobs {
    fn drop(&mut self) {
        self.close();
    }
}

fn worker(sh: &Shared) {
    loop {
        let (job, i, item) = {
            let mut q = sh.lock();
            loop {
                if let Some(keys) = q.probes.pop_front() {
                    drop(q);
                    probe(sh, &keys);
                    q = sh.lock();
                    continue;
                }
                if let Some(next) = q.loads.pop_front().or_else(|| q.stores.pop_front()) {
                    break next;
                }
                if q.closing {
                    return;
                }
                q = sh.work_cv.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        let store = matches!(item, Item::Store(..));
        let admit = sh.breaker.admit();
        let status = if admit == Admit::Deny {
            sh.denied.fetch_add(1, Ordering::Relaxed);
            FAILED
        } else {
            // A panic in one item's I/O fails that item (as a fault of the disk), never its
            // job's completion, nor the breaker's probe.
            let (status, fault) =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(sh, item)))
                    .unwrap_or((FAILED, true));
            judge(sh, admit, fault);
            status
        };
        let mut q = sh.lock();
        if store {
            q.store_bytes -= sh.tier.chunk_bytes() as u64;
        }
        let (statuses, left) = q.open.get_mut(&job).expect("an open job");
        statuses[i] = status;
        *left -= 1;
        if *left == 0 {
            let (statuses, _) = q.open.remove(&job).expect("an open job");
            q.done.push(Completion {
                job_id: job,
                statuses,
            });
            drop(q);
            sh.done_cv.notify_all();
        }
    }
}

/// Marks a key in flight (never evicted under its I/O) until released, or dropped by a panic.
struct Busy<'a> {
    sh: Option<&'a Shared>,
    key: Vec<u8>,
}

impl<'a> Busy<'a> {
    fn new(sh: &'a Shared, key: &[u8]) -> Busy<'a> {
        sh.index().busy(key, true);
        Busy {
            sh: Some(sh),
            key: key.to_vec(),
        }
    }

    /// Ends it under the caller's hold of the index (with what follows from the I/O, so that no
    /// eviction comes between).
    fn release(mut self, ix: &mut Index) {
        ix.busy(&self.key, false);
        self.sh = None;
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        if let Some(sh) = self.sh {
            sh.index().busy(&self.key, false);
        }
    }
}

/// One item's I/O: its status, and whether it failed by the disk's fault (an I/O error; not a
/// full filesystem, nor a missing or damaged file).
fn run(sh: &Shared, item: Item) -> (u8, bool) {
    let key = match &item {
        Item::Store(k, _) | Item::Load(k, _) => k.clone(),
    };
    let busy = Busy::new(sh, &key);
    let mut fault = false;
    let store = matches!(item, Item::Store(..));
    let mut failed = |e: DiskError| {
        // A full or read-only filesystem is no fault of the disk: reads go on. Only a store's
        // error shuts writes (a file another user's engine wrote may refuse our read).
        fault =
            matches!(e, DiskError::Io(..)) && !e.is_full() && !e.is_read_only() && !e.is_symlink();
        if store {
            if let Some(why) = e.shut() {
                sh.gate.shut(why, Instant::now());
            }
        }
        sh.note(e.to_string());
        FAILED
    };
    let status = match item {
        Item::Store(key, buf) => match sh.gate.admit(Instant::now()) {
            // There already (a directory shipped read-only, a chunk written before it filled).
            Err(_) if sh.tier.exists(&key) => EXISTS,
            Err(why) => {
                let c = sh.tier.counters();
                let counter = match why {
                    Shut::Full { .. } => &c.stores_full,
                    Shut::ReadOnly => &c.stores_read_only,
                };
                Counters::add(counter, 1);
                DROPPED
            }
            Ok(()) => match sh.tier.store(&key, buf.slice()) {
                Stored::Written => {
                    sh.gate.written();
                    OK
                }
                Stored::Exists => EXISTS,
                Stored::Failed(e) => failed(e),
            },
        },
        Item::Load(key, mut buf) => match sh.tier.load(&key, buf.slice_mut()) {
            Loaded::Ok => OK,
            Loaded::Missing => MISSING,
            Loaded::Corrupt(why) => {
                sh.note(format!("a damaged chunk file (removed): {why}"));
                CORRUPT
            }
            Loaded::Failed(e) => failed(e),
        },
    };
    {
        let mut ix = sh.index();
        busy.release(&mut ix);
        match status {
            OK | EXISTS => ix.touch(&key),
            MISSING | CORRUPT => {
                ix.remove(&key);
            }
            _ => {}
        }
    }
    if status == OK || status == EXISTS {
        evict(sh);
    }
    (status, fault)
}

/// Looks for the files of `keys` in order, up to the first that is absent: those found go into
/// the index (as just used), the absent one is a miss for a while.
/// A panic in it (a fault of the filesystem's) ends the probe as finding nothing.
fn probe(sh: &Shared, keys: &ProbeKeys) {
    let looked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        keys.iter().take_while(|k| sh.tier.has_file(k)).count()
    }));
    let found = looked.as_ref().map_or(0, |&n| n);
    let c = sh.tier.counters();
    Counters::add(&c.probed, (found + usize::from(found < keys.len())) as u64);
    let absent = (looked.is_ok() && found < keys.len()).then(|| keys.get(found));
    let taken = {
        // The index is taken under the probes' lock (the one place both are held, in this
        // order): a load that failed meanwhile holds its key as a miss first (note_missing), so
        // a probe that found its file never brings it back.
        let mut probes = sh.probes();
        let now = Instant::now();
        let taken = found.min(probes.unheld(keys, now));
        probes.done(keys, absent, now);
        if taken > 0 {
            let mut ix = sh.index();
            for key in keys.iter().take(taken) {
                ix.touch(key);
            }
        }
        taken
    };
    Counters::add(&c.probe_hits, taken as u64);
    if taken > 0 {
        evict(sh);
    }
}

/// Tells the breaker how an admitted item went.
fn judge(sh: &Shared, admit: Admit, fault: bool) {
    if !fault {
        sh.breaker.success();
    } else if sh.breaker.failure(admit == Admit::Probe) {
        let why = sh
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        sh.note(format!(
            "the disk tier is down after I/O failures in a row (every chunk fails at once until \
             a probe works): {}",
            why.unwrap_or_default()
        ));
    }
}

/// Removes the least recently used chunks until the index fits the capacity (their files too).
fn evict(sh: &Shared) {
    loop {
        let victim = {
            let mut ix = sh.index();
            if ix.len() <= sh.capacity_files {
                return;
            }
            ix.pop_oldest_idle()
        };
        let Some(key) = victim else { return };
        // A lookup-only handle forgets the chunk; its writers' handles remove the file.
        if !sh.evict_files || sh.tier.remove(&key).is_ok() {
            sh.evicted.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Takes what the directory holds into the index, oldest file first, then holds the capacity;
/// then, every `rescan` while the tier is open, takes in the files other engines sharing the
/// directory wrote since (and holds the capacity over them too).
fn rebuild(sh: &Shared, rescan: Option<Duration>) {
    scan_into_index(sh, false);
    evict(sh);
    sh.scanned.store(true, Ordering::Release);
    let Some(every) = rescan else { return };
    loop {
        {
            let q = sh.lock();
            let q = sh
                .closed_cv
                .wait_timeout_while(q, every, |q| !q.closing)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if q.closing {
                return;
            }
        }
        scan_into_index(sh, true);
        evict(sh);
    }
}

fn scan_into_index(sh: &Shared, recent: bool) {
    let since = sh.index().begin_scan();
    if let Ok((mut found, complete)) = sh.tier.scan() {
        found.sort_by_key(|(_, modified)| *modified);
        // In batches, so lookups and I/O threads never wait long for the index.
        for batch in found.chunks(4096) {
            if sh.lock().closing {
                break;
            }
            let mut ix = sh.index();
            for (key, _) in batch {
                ix.add_scanned(key.clone(), since, recent);
            }
        }
        // Files gone since (another engine evicted them) are misses here too, not loads that
        // fail; only after a listing that saw every subdirectory.
        if complete && !sh.lock().closing {
            let listed: HashSet<Vec<u8>> = found.into_iter().map(|(key, _)| key).collect();
            let mut from = Some(0);
            while let Some(at) = from {
                from = sh.index().prune(&listed, since, at, 4096);
            }
        }
    }
    sh.index().scan_done(since);
}
