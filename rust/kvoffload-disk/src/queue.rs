//! The state the disk tier's handle shares with its I/O threads: the job queues (probes, then
//! loads, then stores), each open job's statuses and the completions not taken yet, and what
//! every item's I/O reads (the chunk files, the index, the breaker, the write gate, the probes).

use crate::chunks::ChunkFiles;
use crate::gate::Gate;
use crate::index::Index;
use crate::probes::{ProbeKeys, Probes};
use kvoffload_tier::breaker::Breaker;
use kvoffload_tier::buf::{RawBuf, RawBufMut};
use kvoffload_tier::completion::{Completion, CompletionQueue, JobState};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

pub(crate) enum Item {
    Store(Vec<u8>, RawBuf),
    Load(Vec<u8>, RawBufMut),
}

pub(crate) struct Queue {
    /// Probes go first, then loads: a request waits on them, while stores only fill the tier.
    pub probes: VecDeque<ProbeKeys>,
    pub loads: VecDeque<(u64, usize, Item)>,
    pub stores: VecDeque<(u64, usize, Item)>,
    /// Per job: its statuses so far, and how many items are left.
    pub open: HashMap<u64, (Vec<u8>, usize)>,
    pub done: Vec<Completion>,
    pub next_id: u64,
    pub closing: bool,
    /// Bytes of store items queued or being written.
    pub store_bytes: u64,
}

impl JobState for Queue {
    fn done(&mut self) -> &mut Vec<Completion> {
        &mut self.done
    }

    fn idle(&self) -> bool {
        self.open.is_empty()
    }
}

pub(crate) struct Shared {
    pub tier: ChunkFiles,
    pub capacity_files: usize,
    pub jobs: CompletionQueue<Queue>,
    pub index: Mutex<Index>,
    pub work_cv: Condvar,
    /// Notified at close: the rescan thread waits on it between scans.
    pub closed_cv: Condvar,
    pub scanned: AtomicBool,
    pub evicted: AtomicU64,
    /// Store jobs past `max_store_bytes` are dropped whole (their items DROPPED), never queued:
    /// a disk slower than the engine stores must not grow the queue without bound.
    pub max_store_bytes: u64,
    pub dropped: AtomicU64,
    pub last_error: Mutex<Option<String>>,
    /// Trips on I/O failures in a row: a failing disk then costs no I/O (and no thread's wait)
    /// per item until a probe finds it working again.
    pub breaker: Breaker,
    /// Items failed at once, with no I/O, while the breaker was open.
    pub denied: AtomicU64,
    pub evict_files: bool,
    /// The keys whose files eviction removed since the last `take_evicted` (None: not kept).
    pub evicted_keys: Option<Mutex<Vec<Vec<u8>>>>,
    pub read_only: bool,
    /// Whether stores are written now (a full or read-only filesystem drops them without I/O).
    pub gate: Gate,
    pub probes: Mutex<Probes>,
    /// How long a chunk whose load failed stays a miss (a rescan's interval: vLLM's livelock
    /// guard, a failed read retried at most once a rescan).
    pub failed_hold: Duration,
    /// 0: the index answers alone (no lock of the probes taken).
    pub probes_per_step: usize,
}

impl Shared {
    pub(crate) fn note(&self, why: String) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Queue> {
        self.jobs.lock()
    }

    pub(crate) fn index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn probes(&self) -> MutexGuard<'_, Probes> {
        self.probes.lock().unwrap_or_else(|p| p.into_inner())
    }
}
