//! The disk tier's settings.

use crate::error::{DiskError, Result};
use std::path::PathBuf;

/// Whether reads and writes bypass the page cache (`O_DIRECT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectIo {
    /// Where the filesystem takes it (probed at open); otherwise buffered.
    Auto,
    /// Always: a filesystem that refuses it stops open.
    On,
    /// Never (through the page cache, which is told to drop the tier's pages).
    Off,
}

#[derive(Clone, Debug)]
pub struct DiskConfig {
    /// The tier's directory (created if absent); several engines may share it.
    pub path: PathBuf,
    /// Bytes of one chunk (the payload of one file).
    pub chunk_bytes: usize,
    pub direct: DirectIo,
    /// How often the index takes in the files other engines sharing the directory wrote (None:
    /// only at open).
    pub rescan: Option<std::time::Duration>,
    /// Bytes of stores queued or being written past which a store job is dropped (DROPPED).
    pub max_store_bytes_in_flight: u64,
    /// I/O failures in a row (not a full filesystem) that mark the tier down.
    pub breaker_failures: u32,
    /// How long it stays down (every item fails at once, with no I/O) before one probes it.
    pub breaker_cooldown: std::time::Duration,
    /// Whether eviction removes the chunk's file (false: a handle that only answers lookups for
    /// writers that hold the capacity themselves forgets the chunk, and its index stays within
    /// the capacity).
    pub evict_files: bool,
    /// Whether the files eviction removes are kept for `Tier::take_evicted` (a handle whose
    /// engine publishes KV events withdraws them; off, nobody drains them).
    pub report_evictions: bool,
    /// Never write (a directory shipped read-only): stores are dropped at once, nothing is
    /// created, removed or touched; lookups and loads serve what the directory holds.
    pub read_only: bool,
    /// Lookups per step (between two `flush`es) that may look for the files of chunks the index
    /// lacks (written by other engines since the last scan); 0: the index answers alone.
    pub probes_per_step: usize,
    /// How long a file a probe found absent is a miss without looking again.
    pub probe_miss_ttl: std::time::Duration,
    /// The mode of every chunk file (0o600: the engine's user only; 0o640 or 0o660: shared with
    /// its group); directories get it with search added where read is given.
    pub file_mode: u32,
}

/// At most 1 GiB per chunk: larger is a mistake in the caller's arithmetic.
pub const MAX_CHUNK_BYTES: usize = 1 << 30;

impl DiskConfig {
    pub fn new(path: impl Into<PathBuf>, chunk_bytes: usize) -> DiskConfig {
        DiskConfig {
            path: path.into(),
            chunk_bytes,
            direct: DirectIo::Auto,
            rescan: Some(std::time::Duration::from_secs(10)),
            max_store_bytes_in_flight: 1 << 30,
            breaker_failures: 3,
            breaker_cooldown: std::time::Duration::from_secs(10),
            evict_files: true,
            report_evictions: false,
            read_only: false,
            probes_per_step: 64,
            probe_miss_ttl: std::time::Duration::from_secs(1),
            file_mode: 0o600,
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        if !(1..=MAX_CHUNK_BYTES).contains(&self.chunk_bytes) {
            return Err(DiskError::Config(format!(
                "chunk_bytes={} is out of range; allowed: 1 to {MAX_CHUNK_BYTES}",
                self.chunk_bytes
            )));
        }
        if self.breaker_failures == 0 {
            return Err(DiskError::Config(
                "breaker_failures=0 is out of range; allowed: 1 or more".into(),
            ));
        }
        if ![0o600, 0o640, 0o660].contains(&self.file_mode) {
            return Err(DiskError::Config(format!(
                "file_mode={:04o} is not allowed; allowed: 0600 (the engine's user only), 0640 or \
                 0660 (shared with its group): never other users, never executable",
                self.file_mode
            )));
        }
        if self.path.as_os_str().is_empty() {
            return Err(DiskError::Config(
                "path='' is empty; give the tier's directory".into(),
            ));
        }
        Ok(())
    }
}
