use crate::error::{Error, Result};
use core::hash::BuildHasher;
use std::sync::OnceLock;

/// Longest key the store accepts. vLLM's keys are a 32-byte block hash plus a 4-byte group index.
pub const MAX_KEY_LEN: usize = 64;

/// A key copied inline, so an index entry needs no separate allocation. Zero-padded, so two keys
/// compare as two fixed-size arrays (a few vector compares, no call).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct InlineKey {
    bytes: [u8; MAX_KEY_LEN],
    len: u8,
}

impl InlineKey {
    pub(crate) const EMPTY: InlineKey = InlineKey {
        bytes: [0; MAX_KEY_LEN],
        len: 0,
    };

    #[inline]
    pub(crate) fn new(key: &[u8]) -> Self {
        let mut bytes = [0; MAX_KEY_LEN];
        bytes[..key.len()].copy_from_slice(key);
        InlineKey {
            bytes,
            len: key.len() as u8,
        }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

/// Checks every key before a call touches any state, so a bad key never leaves a half-done call.
pub fn validate_keys<K: AsRef<[u8]>>(keys: &[K]) -> Result<()> {
    for (index, key) in keys.iter().enumerate() {
        let len = key.as_ref().len();
        if len == 0 || len > MAX_KEY_LEN {
            return Err(Error::InvalidKeyLength { index, len });
        }
    }
    Ok(())
}

/// The process's hash seed: random, so keys crafted offline to collide (users' prompts shape the
/// block hashes keys are made of) collide no more than random keys. Every store of the process
/// shares it, so a key hashes alike everywhere (ARC's ghost fingerprints are hashes).
fn seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0x6b76_u64))
}

pub(crate) fn hash_key(key: &[u8]) -> u64 {
    hash_key_with_seed(key, seed())
}

/// `hash_key` under a given seed: what an attacker who knew the seed would compute. The seed of
/// earlier versions (fixed, public) was `OLD_PUBLIC_SEED`.
pub const OLD_PUBLIC_SEED: u64 = 0x6b76_6f66_666c_6f61;

pub(crate) fn hash_key_with_seed(key: &[u8], seed: u64) -> u64 {
    foldhash::fast::FixedState::with_seed(seed).hash_one(key)
}
