//! Inputs for tests and benchmarks, not for serving.

use crate::key::hash_key_with_seed;
use crate::keybuf::KeyBuf;

/// `n` distinct 36-byte keys whose hashes under `seed` share their top `bits` bits: what an
/// attacker who knew the seed would send to pile them into one run of index buckets. The store
/// hashes with its own random seed, so to it they are as good as random keys.
pub fn colliding_keys(n: usize, seed: u64, bits: u32) -> KeyBuf {
    let mut out = KeyBuf::with_capacity(n, 36);
    let mut key = [0u8; 36];
    let want = 0x6b7_u64 & ((1 << bits) - 1);
    for i in 0u64.. {
        if out.len() == n {
            break;
        }
        key[..8].copy_from_slice(&i.to_le_bytes());
        if hash_key_with_seed(&key, seed) >> (64 - bits) == want {
            out.push_unchecked(&key);
        }
    }
    out
}
