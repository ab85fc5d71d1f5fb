//! A hybrid model's calls on the store, one per request across its KV-cache groups: the lookup
//! (as vLLM 0.33 decides a hit across full-attention and window groups), the store and the load.

mod load;
mod lookup;
mod store;

pub use load::{group_load, GroupLoad, GroupLoadAsk, LoadedGroup};
pub use lookup::{lookup_groups, window_hits, GroupKind, GroupRule, LookupAsk, LookupGroup};
pub use store::{GroupStoreOffer, GroupStoreOutcome, GroupStorePlan};
