//! A Redis 7.0 / Valkey 8 tier for KV-cache chunks.
//!
//! A small hand-written RESP2 client: payloads go out from the caller's memory with
//! `write_vectored` and come back with `read_exact` straight into the caller's memory, so a chunk
//! is never copied on the way. Each chunk is stored as a checked header plus payload (see
//! [`format`]); anything that fails a check is reported CORRUPT and deleted, never returned.

mod breaker;
pub mod cluster;
pub mod config;
mod conn;
mod credentials;
mod error;
pub mod format;
mod jobs;
mod lookups;
mod probe;
mod queue;
pub mod resp;
mod routing;
pub mod slot;
mod stats;
mod tier;
mod tls;
pub mod url;
mod worker;

pub use breaker::BreakerState;
pub use config::{Config, TlsConfig};
pub use error::{RemoteError, Result};
pub use jobs::CanaryOutcome;
pub use kvoffload_tier::buf::{self, RawBuf, RawBufMut};
pub use kvoffload_tier::completion::Completion;
pub use kvoffload_tier::status;
pub use lookups::LookupTable;
pub use stats::{NodeStats, Stats};
pub use tier::Tier;
