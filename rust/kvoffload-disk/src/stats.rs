//! The tier's counters.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub(crate) struct Counters {
    pub stored_chunks: AtomicU64,
    pub store_exists: AtomicU64,
    pub store_failures: AtomicU64,
    pub stores_full: AtomicU64,
    pub stores_read_only: AtomicU64,
    pub probed: AtomicU64,
    pub probe_hits: AtomicU64,
    pub symlinks: AtomicU64,
    pub loaded_chunks: AtomicU64,
    pub load_missing: AtomicU64,
    pub load_failures: AtomicU64,
    pub corrupt: AtomicU64,
    pub bytes_written: AtomicU64,
    pub bytes_read: AtomicU64,
}

/// A snapshot of the counters (monotonic).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub stored_chunks: u64,
    /// Stores that found the chunk's file there already (another writer's, or an earlier one).
    pub store_exists: u64,
    /// Stores tried that failed for any reason (a full or read-only filesystem among them).
    pub store_failures: u64,
    /// Stores not written because the filesystem was full (`ENOSPC`, `EDQUOT`): the one that
    /// found it full, and those dropped after it without I/O until it had room again.
    pub stores_full: u64,
    /// Stores not written because the directory refuses writes (`EROFS`, `EACCES`, `EPERM`, or
    /// `read_only`): tried at most once every 30 s, the rest dropped without I/O.
    pub stores_read_only: u64,
    /// Files looked for by lookups the index could not answer (chunks other engines wrote since
    /// the last scan), and chunks found that way.
    pub probed: u64,
    pub probe_hits: u64,
    /// Symlinks met in the tier's directory (a file or a subdirectory): never followed, never
    /// read, written or removed through; the chunk is a miss.
    pub symlinks: u64,
    pub loaded_chunks: u64,
    pub load_missing: u64,
    /// Loads the filesystem failed (not a missing or damaged file).
    pub load_failures: u64,
    /// Files that failed a check (length, header, CRC32C): removed, never served.
    pub corrupt: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Stats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            stored_chunks: g(&self.stored_chunks),
            store_exists: g(&self.store_exists),
            store_failures: g(&self.store_failures),
            stores_full: g(&self.stores_full),
            stores_read_only: g(&self.stores_read_only),
            probed: g(&self.probed),
            probe_hits: g(&self.probe_hits),
            symlinks: g(&self.symlinks),
            loaded_chunks: g(&self.loaded_chunks),
            load_missing: g(&self.load_missing),
            load_failures: g(&self.load_failures),
            corrupt: g(&self.corrupt),
            bytes_written: g(&self.bytes_written),
            bytes_read: g(&self.bytes_read),
        }
    }
}
