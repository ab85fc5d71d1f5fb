//! What an I/O thread of the disk tier does: takes the next probe or item (probes, then loads,
//! then stores), runs its I/O under the breaker, and settles it in its job and in the index.

use crate::chunks::{Loaded, Stored};
use crate::error::DiskError;
use crate::gate::Shut;
use crate::index::Index;
use crate::probes::ProbeKeys;
use crate::queue::{Item, Shared};
use crate::stats::Counters;
use crate::upkeep::evict;
use kvoffload_tier::breaker::Admit;
use kvoffload_tier::completion::Completion;
use kvoffload_tier::status::{CORRUPT, DROPPED, EXISTS, FAILED, MISSING, OK};
use std::sync::atomic::Ordering;
use std::time::Instant;

pub(crate) fn worker(sh: &Shared) {
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
            let c = Completion {
                job_id: job,
                statuses,
            };
            sh.jobs.complete(q, c);
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
