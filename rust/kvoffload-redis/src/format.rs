//! How a chunk is laid out in Redis: its keys, and its value (kvoffload-tier's header and
//! the body/tail split).
//!
//! A value of exactly a power of two costs 25% more in Redis (jemalloc's next size class is 1.25x,
//! and the string carries a few bytes of header), so a large chunk is split: `:b` holds all but its
//! last 4 KiB raw, `:h` holds the header and those last 4 KiB. The body then fits its size class.

use crate::slot::hash_tag;
pub use kvoffload_tier::{
    crc, key_digest, Header, Layout, FLAG_SPLIT, HEADER_LEN, MAGIC, TAIL_LEN, VERSION,
};

/// `kvo2`: keys carry a hash tag (v1 had none).
pub const KEY_PREFIX: &[u8] = b"kvo2:";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Header,
    Body,
}

/// The Redis key of one part: `kvo2:` + `{` hash tag `}` + namespace digest + `:` + offload key +
/// `:h` / `:b`. The tag (16 hex digits of the offload key's digest, so it holds no brace) comes
/// before any byte of the binary digest, and it is the same for every part of every rank's
/// shard of a chunk: in a Redis Cluster they all live in one slot, so `MSETNX` of a chunk's
/// parts stays atomic and one `EXISTS` answers for the whole chunk.
pub fn redis_key(out: &mut Vec<u8>, ns: &[u8; 16], key: &[u8], part: Part) {
    out.clear();
    out.extend_from_slice(KEY_PREFIX);
    out.push(b'{');
    out.extend_from_slice(&hash_tag(key));
    out.push(b'}');
    out.extend_from_slice(ns);
    out.push(b':');
    out.extend_from_slice(key);
    out.extend_from_slice(match part {
        Part::Header => b":h",
        Part::Body => b":b",
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slot::slot;

    #[test]
    fn keys() {
        let mut k = Vec::new();
        redis_key(&mut k, &[1; 16], b"abc", Part::Body);
        // A golden value: keys change only with KEY_PREFIX (the tag is xxh3-64 of "abc").
        let mut want = b"kvo2:{78af5f94892f3950}".to_vec();
        want.extend_from_slice(&[1; 16]);
        want.extend_from_slice(b":abc:b");
        assert_eq!(k, want);
    }

    #[test]
    fn every_part_of_every_shard_of_a_chunk_is_in_one_slot() {
        let mut k = Vec::new();
        let mut slots = Vec::new();
        // Namespace digests holding braces do not move the tag.
        for ns in [[b'{'; 16], [b'}'; 16], *b"rank-0-namespace"] {
            for part in [Part::Header, Part::Body] {
                redis_key(&mut k, &ns, b"block-hash-and-group", part);
                slots.push(slot(&k));
            }
        }
        assert!(slots.iter().all(|&s| s == slots[0]), "{slots:?}");
        redis_key(&mut k, b"rank-0-namespace", b"another-chunk", Part::Header);
        assert_ne!(slot(&k), slots[0]);
        assert!(k.starts_with(b"kvo2:{"), "{k:?}");
        assert_eq!(k[22], b'}');
    }
}
