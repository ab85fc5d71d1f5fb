//! The kit every tier crate of kvoffload shares: the caller's memory lent to a job ([`buf`]), the
//! status of each item of a job ([`status`]), the circuit breaker ([`breaker`]), the queue its
//! caller takes completions from ([`completion`]), and the value format every tier writes: a
//! 64-byte header (magic, format version, lengths, the namespace digest, a digest of the chunk's
//! key, a CRC32C of the payload and one of the header) before the chunk's bytes, so a truncated,
//! overwritten, flipped or foreign value is never served. A tier may keep a chunk in one piece
//! ([`Layout::whole`]: a file) or keep its last [`TAIL_LEN`] bytes beside the header and the rest
//! apart ([`Layout::new`]: Redis, where a value of exactly a power of two costs 25% more).

pub mod breaker;
pub mod buf;
pub mod completion;
pub mod status;

pub const HEADER_LEN: usize = 64;
pub const MAGIC: [u8; 4] = *b"KVOF";
pub const VERSION: u16 = 1;
/// Bytes of payload carried with the header when the chunk is split.
pub const TAIL_LEN: usize = 4096;
pub const FLAG_SPLIT: u32 = 1;

/// Where each part of a chunk of `chunk_bytes` goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub chunk_bytes: usize,
    pub split: bool,
    /// Payload bytes stored right after the header: the whole chunk, or (split) its last
    /// [`TAIL_LEN`] bytes (Redis's `:h`).
    pub tail: usize,
}

impl Layout {
    pub fn new(chunk_bytes: usize) -> Layout {
        let split = chunk_bytes > 2 * TAIL_LEN;
        Layout {
            chunk_bytes,
            split,
            tail: if split { TAIL_LEN } else { chunk_bytes },
        }
    }

    /// A chunk kept in one piece after its header (a file).
    pub fn whole(chunk_bytes: usize) -> Layout {
        Layout {
            chunk_bytes,
            split: false,
            tail: chunk_bytes,
        }
    }

    /// Payload bytes stored apart from the header (`:b` in Redis; 0 when unsplit).
    pub fn body(&self) -> usize {
        self.chunk_bytes - self.tail
    }
}

pub fn key_digest(key: &[u8]) -> [u8; 16] {
    xxhash_rust::xxh3::xxh3_128(key).to_le_bytes()
}

pub fn crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub payload_len: u64,
    pub tail_len: u32,
    pub flags: u32,
    pub namespace: [u8; 16],
    pub key_digest: [u8; 16],
    pub payload_crc: u32,
}

impl Header {
    pub fn for_chunk(layout: &Layout, ns: &[u8; 16], key: &[u8], payload: &[u8]) -> Header {
        Header {
            payload_len: payload.len() as u64,
            tail_len: layout.tail as u32,
            flags: if layout.split { FLAG_SPLIT } else { 0 },
            namespace: *ns,
            key_digest: key_digest(key),
            payload_crc: crc(payload),
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        b[8..16].copy_from_slice(&self.payload_len.to_le_bytes());
        b[16..20].copy_from_slice(&self.tail_len.to_le_bytes());
        b[20..24].copy_from_slice(&self.flags.to_le_bytes());
        b[24..40].copy_from_slice(&self.namespace);
        b[40..56].copy_from_slice(&self.key_digest);
        b[56..60].copy_from_slice(&self.payload_crc.to_le_bytes());
        let hcrc = crc(&b[..60]);
        b[60..64].copy_from_slice(&hcrc.to_le_bytes());
        b
    }

    /// Decodes and checks a header against what this tier expects for `key`, before any payload
    /// byte is read. The error names the first mismatch (for tests and debugging).
    pub fn decode_checked(
        b: &[u8; HEADER_LEN],
        layout: &Layout,
        ns: &[u8; 16],
        key: &[u8],
    ) -> Result<Header, &'static str> {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        if b[0..4] != MAGIC {
            return Err("bad magic");
        }
        if u16_at(4) != VERSION {
            return Err("unknown format version");
        }
        if u16_at(6) as usize != HEADER_LEN {
            return Err("bad header length");
        }
        if u32_at(60) != crc(&b[..60]) {
            return Err("header checksum mismatch");
        }
        let h = Header {
            payload_len: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            tail_len: u32_at(16),
            flags: u32_at(20),
            namespace: b[24..40].try_into().expect("16 bytes"),
            key_digest: b[40..56].try_into().expect("16 bytes"),
            payload_crc: u32_at(56),
        };
        if h.payload_len != layout.chunk_bytes as u64 || h.tail_len as usize != layout.tail {
            return Err("payload or tail length differs from this tier's layout");
        }
        if (h.flags & FLAG_SPLIT != 0) != layout.split || h.flags & !FLAG_SPLIT != 0 {
            return Err("flags differ from this tier's layout");
        }
        if h.namespace != *ns {
            return Err("namespace differs");
        }
        if h.key_digest != key_digest(key) {
            return Err("key digest differs");
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        assert_eq!(
            Layout::new(8192),
            Layout {
                chunk_bytes: 8192,
                split: false,
                tail: 8192
            }
        );
        let l = Layout::new(2 << 20);
        assert!(l.split);
        assert_eq!((l.tail, l.body()), (4096, (2 << 20) - 4096));
    }

    #[test]
    fn header_round_trip_and_checks() {
        let layout = Layout::new(3 * TAIL_LEN);
        let ns = [9u8; 16];
        let payload = vec![5u8; layout.chunk_bytes];
        let h = Header::for_chunk(&layout, &ns, b"key", &payload);
        let raw = h.encode();
        assert_eq!(&raw[..4], b"KVOF");
        assert_eq!(Header::decode_checked(&raw, &layout, &ns, b"key"), Ok(h));
        assert_eq!(
            Header::decode_checked(&raw, &layout, &[0; 16], b"key"),
            Err("namespace differs")
        );
        assert_eq!(
            Header::decode_checked(&raw, &layout, &ns, b"other"),
            Err("key digest differs")
        );
        assert!(Header::decode_checked(&raw, &Layout::new(4 * TAIL_LEN), &ns, b"key").is_err());
        for i in 0..HEADER_LEN {
            let mut bad = raw;
            bad[i] ^= 0x40;
            assert!(
                Header::decode_checked(&bad, &layout, &ns, b"key").is_err(),
                "byte {i}"
            );
        }
    }
}
