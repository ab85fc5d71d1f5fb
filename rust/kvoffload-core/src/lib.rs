//! kvoffload-core: the CPU-tier block store of kvoffload and its chunk arithmetic, in plain Rust
//! (and the simulator's model of a shared tier's sampled-LRU eviction).
//!
//! The Python package reaches this crate through the thin `kvoffload-py` binding; nothing here
//! knows about Python.

mod blockset;
mod chunk;
mod error;
mod events;
mod groups;
mod heap;
mod hybrid_load;
mod hybrid_lookup;
mod hybrid_store;
mod index;
mod key;
mod keybuf;
mod list;
mod policy;
mod sampled;
mod store;
#[doc(hidden)]
pub mod testing;
mod window;

pub use blockset::BlockSet;
pub use chunk::{
    load_window, loadable_tokens, storable_chunks, LoadWindow, StoreBounds, GROUP_SUFFIX_LEN,
};
pub use error::{Error, Result};
pub use events::{Event, EventKind};
pub use groups::{
    load_parts, offer_batch, range_batch, store_blocks, used_keys, GroupBatch, GroupOffer,
    LoadPart, StoreBlocks,
};
pub use hybrid_load::{group_load, GroupLoad, GroupLoadAsk, LoadedGroup};
pub use hybrid_lookup::{lookup_groups, window_hits, GroupKind, GroupRule, LookupAsk, LookupGroup};
pub use hybrid_store::{GroupStoreOffer, GroupStoreOutcome, GroupStorePlan};
pub use key::{validate_keys, MAX_KEY_LEN, OLD_PUBLIC_SEED};
pub use keybuf::KeyBuf;
pub use policy::{PolicyKind, Rank, POLICY_NAMES};
pub use sampled::SampledLru;
pub use store::{KeyStatus, Positions, RankedBatch, Stats, Store, StorePlan, MAX_SLOTS};
pub use window::{offered_chunks, reachable_blocks, WindowReach, NULL_BLOCK};
