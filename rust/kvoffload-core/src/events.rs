use crate::keybuf::KeyBuf;

/// What happened to a batch of keys, for vLLM's KV-cache events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// The keys became ready (a store completed).
    Stored,
    /// The keys left the store (evicted or reset); always recorded before the stores that
    /// caused them.
    Removed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    pub keys: KeyBuf,
}
