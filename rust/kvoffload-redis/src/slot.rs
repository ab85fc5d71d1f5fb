//! Which Redis Cluster slot a key hashes to, and the hash tag that puts every key of a chunk
//! (each part of each rank's shard) in its chunk's one slot.

pub const SLOTS: usize = 16384;

/// CRC16-XMODEM, as Redis Cluster hashes keys.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slot of `key`: of its `{hash tag}` when it has a non-empty one, as Redis computes it.
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter()
            .position(|&b| b == b'}')
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS as u16
}

/// The hash tag of every Redis key of chunk `key`: 16 lowercase hex digits of its xxh3-64.
pub fn hash_tag(key: &[u8]) -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut tag = [0u8; 16];
    for (i, b) in xxhash_rust::xxh3::xxh3_64(key)
        .to_be_bytes()
        .iter()
        .enumerate()
    {
        tag[2 * i] = HEX[usize::from(b >> 4)];
        tag[2 * i + 1] = HEX[usize::from(b & 15)];
    }
    tag
}

/// The Redis Cluster slot of every key of chunk `key`.
pub fn chunk_slot(key: &[u8]) -> u16 {
    slot(&hash_tag(key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_as_redis_computes_them() {
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        // An empty tag, or none closed, hashes the whole key.
        assert_eq!(slot(b"{}foo"), crc16(b"{}foo") % 16384);
        assert_eq!(slot(b"{foo"), crc16(b"{foo") % 16384);
        // Only the first '{' opens the tag.
        assert_eq!(slot(b"a{b}{c}"), slot(b"b"));
    }
}
