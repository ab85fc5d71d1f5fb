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
            return Err(Error::InvalidKeyLength {
                index,
                len,
                max: MAX_KEY_LEN,
            });
        }
    }
    Ok(())
}

/// The process's hasher: random seeds (the per-hasher seed and the shared ones foldhash mixes
/// the key with), so keys crafted offline to collide (users' prompts shape the block hashes keys
/// are made of) collide no more than random keys. Every store of the process shares it, so a key
/// hashes alike everywhere (ARC's ghost fingerprints are hashes).
fn hasher() -> &'static foldhash::fast::SeedableRandomState {
    static HASHER: OnceLock<foldhash::fast::SeedableRandomState> = OnceLock::new();
    HASHER.get_or_init(foldhash::fast::SeedableRandomState::random)
}

pub(crate) fn hash_key(key: &[u8]) -> u64 {
    hasher().hash_one(key)
}

/// `hash_key` under a given seed: what an attacker who knew the seed would compute. The seed of
/// earlier versions (fixed, public) was `OLD_PUBLIC_SEED`.
pub const OLD_PUBLIC_SEED: u64 = 0x6b76_6f66_666c_6f61;

pub(crate) fn hash_key_with_seed(key: &[u8], seed: u64) -> u64 {
    foldhash::fast::FixedState::with_seed(seed).hash_one(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys built to zero foldhash's folded multiply against its public shared seeds: under a
    /// per-hasher seed alone (what `FixedState::with_seed` randomises) they all hash alike,
    /// whatever that seed is. The process hasher randomises the shared seeds too.
    #[test]
    fn seed_independent_collisions_do_not_collide() {
        let magic = 0xc0ac_29b7_c97c_50dd_u64.to_le_bytes();
        let keys: Vec<[u8; 36]> = (0u32..200)
            .map(|i| {
                let mut k = [0u8; 36];
                k[..4].copy_from_slice(&i.to_le_bytes());
                k[20..28].copy_from_slice(&magic);
                k[28..36].copy_from_slice(&magic);
                k
            })
            .collect();
        let distinct = |hash: &dyn Fn(&[u8]) -> u64| {
            let mut h: Vec<u64> = keys.iter().map(|k| hash(k)).collect();
            h.sort_unstable();
            h.dedup();
            h.len()
        };
        assert_eq!(
            distinct(&|k| hash_key_with_seed(k, 12345)),
            1,
            "the crafted keys"
        );
        assert_eq!(distinct(&hash_key), keys.len());
    }
}
