//! The disk tier's data path: one file per chunk under a directory of its namespace, each file the
//! chunk's 64-byte header (kvoffload-tier) in a 4 KiB block, then its bytes. A file becomes
//! visible whole (written under a temporary name, then renamed), so a reader never sees half of
//! one, also with several engines writing one chunk at once; and a truncated, flipped, foreign or
//! stale file is never served (it is removed and counted). Reads and writes go straight between
//! the caller's memory and the disk with `O_DIRECT` where the filesystem takes it (probed at
//! open), and otherwise through the page cache, which is told to drop the tier's pages.
//!
//! No PyO3 here: the binding translates.

mod aligned;
mod chunks;
mod config;
mod error;
mod files;
mod gate;
mod index;
mod jobs;
mod probes;
mod queue;
mod stats;
mod tier;
mod upkeep;

pub use chunks::{ChunkFiles, Loaded, Stored};
pub use config::{DirectIo, DiskConfig};
pub use error::{DiskError, Result};
pub use gate::Writes;
pub use kvoffload_tier::breaker::BreakerState;
pub use kvoffload_tier::completion::Completion;
pub use stats::Stats;
pub use tier::Tier;
