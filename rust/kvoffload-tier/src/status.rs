//! Per-item status bytes of a tier's completion (the same for every tier).

/// Lookup: present. Store: stored. Load: loaded and verified.
pub const OK: u8 = 0;
/// Lookup: absent (also while the tier is down). Load: not in the tier.
pub const MISSING: u8 = 1;
/// Load: the stored value failed a check; it was deleted.
pub const CORRUPT: u8 = 2;
/// The job failed (I/O, timeout, protocol or server error, closed tier); nothing is known.
pub const FAILED: u8 = 3;
/// Store: not attempted (tier down or too many store bytes in flight).
pub const DROPPED: u8 = 4;
/// Store: another writer stored this key first.
pub const EXISTS: u8 = 5;
/// Not settled yet; never seen by callers.
pub const PENDING: u8 = 255;
