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
mod hybrid;
mod index;
mod key;
mod keybuf;
mod list;
mod policy;
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
pub use hybrid::{
    group_load, lookup_groups, window_hits, GroupKind, GroupLoad, GroupLoadAsk, GroupRule,
    GroupStoreOffer, GroupStoreOutcome, GroupStorePlan, LoadedGroup, LookupAsk, LookupGroup,
};
pub use key::{validate_keys, MAX_KEY_LEN, OLD_PUBLIC_SEED};
pub use keybuf::KeyBuf;
pub use policy::{PolicyKind, Rank, SampledLru, POLICY_NAMES};
pub use store::{KeyStatus, Positions, RankedBatch, Stats, Store, StorePlan, MAX_SLOTS};
pub use window::{offered_chunks, reachable_blocks, WindowReach, NULL_BLOCK};
