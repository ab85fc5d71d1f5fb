//! Chunks stored as one shard per rank (each under its own namespace): a lookup finds a chunk only
//! when every shard is there, and a hit refreshes every shard's LRU clock.

mod common;

use common::tier::{config, keys, lookup, store};
use common::{pattern, redis_key, Reply};
use kvoffload_redis::status::*;
use kvoffload_redis::{RemoteError, Tier};
use std::time::Duration;

const RANKS: [[u8; 16]; 3] = [
    *b"rank-0-namespace",
    *b"rank-1-namespace",
    *b"rank-2-namespace",
];

fn store_every_shard(url: &str, chunk: usize, ks: &[Vec<u8>]) {
    for (r, ns) in RANKS.iter().enumerate() {
        let t = Tier::connect(config(url, chunk), *ns).unwrap();
        let data: Vec<Vec<u8>> = (0..ks.len())
            .map(|i| pattern((r * 100 + i) as u64, chunk))
            .collect();
        assert_eq!(store(&t, ks, &data), vec![OK; ks.len()]);
    }
}

#[test]
fn a_chunk_missing_one_ranks_shard_is_a_miss() {
    let Some(s) = server!() else { return };
    // 100 KiB chunks are split in two keys (body and header): 6 keys a chunk over 3 ranks.
    for chunk in [4096, 100 * 1024] {
        let ks = keys(&format!("sh{chunk}"), 5);
        store_every_shard(&s.url(), chunk, &ks);
        let t = Tier::connect_shards(config(&s.url(), chunk), RANKS[0], RANKS.to_vec()).unwrap();
        assert_eq!(lookup(&t, &ks), vec![OK; 5]);
        let mut raw = s.raw();
        // Rank 2's shard of chunk 1 evicted whole; rank 1's body of chunk 3 only.
        assert_eq!(raw.int(&[b"DEL", &redis_key(&RANKS[2], &ks[1], "h")]), 1);
        if chunk > 8192 {
            assert_eq!(raw.int(&[b"DEL", &redis_key(&RANKS[1], &ks[3], "b")]), 1);
        } else {
            assert_eq!(raw.int(&[b"DEL", &redis_key(&RANKS[1], &ks[3], "h")]), 1);
        }
        assert_eq!(lookup(&t, &ks), vec![OK, MISSING, OK, MISSING, OK]);
        // A tier of one rank still finds what that rank holds.
        let r0 = Tier::connect(config(&s.url(), chunk), RANKS[0]).unwrap();
        assert_eq!(lookup(&r0, &ks), vec![OK; 5]);
        let st = t.stats();
        assert_eq!((st.lookup_keys, st.lookup_hits), (10, 8));
    }
}

#[test]
fn a_hit_touches_every_shard() {
    let Some(s) = server!() else { return };
    let ks = keys("touch", 2);
    store_every_shard(&s.url(), 4096, &ks);
    // OBJECT IDLETIME counts whole seconds of a clock refreshed every 100 ms: a key touched just
    // before a tick reads 1, so touched is <= 1 and untouched (3 s) >= 2.
    std::thread::sleep(Duration::from_millis(3100));
    let t = Tier::connect_shards(config(&s.url(), 4096), RANKS[0], RANKS.to_vec()).unwrap();
    assert_eq!(lookup(&t, &ks[..1]), vec![OK]);
    let mut raw = s.raw();
    for ns in &RANKS {
        let idle = |raw: &mut common::Raw, k: &[u8]| match raw.cmd(&[b"OBJECT", b"IDLETIME", k]) {
            Reply::Int(n) => n,
            r => panic!("{r:?}"),
        };
        assert!(idle(&mut raw, &redis_key(ns, &ks[0], "h")) <= 1);
        assert!(idle(&mut raw, &redis_key(ns, &ks[1], "h")) >= 2);
    }
}

#[test]
fn lookup_namespaces_are_bounded() {
    let other = Tier::connect_shards(
        config("redis://127.0.0.1:1", 4096),
        RANKS[0],
        RANKS[1..].to_vec(),
    );
    assert!(matches!(other, Err(RemoteError::Config(m)) if m.contains("own namespace")));
    for n in [0, 1025] {
        let res = Tier::connect_shards(
            config("redis://127.0.0.1:1", 4096),
            RANKS[0],
            vec![RANKS[0]; n],
        );
        assert!(matches!(res, Err(RemoteError::Config(m)) if m.contains("allowed: 1 to 1024")));
    }
}
