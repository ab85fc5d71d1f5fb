//! The tier against a local Redis Cluster (3 primaries, 3 replicas): keys spread over the
//! primaries, the slot map learnt from one seed, `MOVED` after slots move, a half-done migration
//! (`ASK`), and a primary killed and replaced by its replica.

mod common;

use common::cluster::Cluster;
use common::tier::{config, keys, load, lookup, store, NS};
use common::{pattern, Reply};
use kvoffload_redis::slot::chunk_slot;
use kvoffload_redis::status::*;
use kvoffload_redis::{RemoteError, Tier};
use std::time::{Duration, Instant};

const KB: usize = 1024;

fn data(n: usize, chunk: usize, seed: u64) -> Vec<Vec<u8>> {
    (0..n).map(|i| pattern(seed + i as u64, chunk)).collect()
}

fn dbsize(s: &common::Server) -> i64 {
    s.raw().int(&[b"DBSIZE"])
}

#[test]
fn chunks_spread_over_the_primaries_and_come_back_whole() {
    let Some(c) = Cluster::start() else { return };
    // One seed is enough, and cluster mode is found out ("auto").
    let t = Tier::connect(config(&c.seed_url(), 64 * KB), NS).unwrap();
    assert_eq!(t.startup_error(), None);
    let ks = keys("spread", 60);
    let d = data(60, 64 * KB, 1);
    assert_eq!(store(&t, &ks, &d), vec![OK; 60]);
    // 64 KiB chunks are split: 120 keys, on every primary.
    let per_node: Vec<i64> = c.primaries().iter().map(|n| dbsize(n)).collect();
    assert_eq!(per_node.len(), 3);
    assert_eq!(per_node.iter().sum::<i64>(), 120, "{per_node:?}");
    assert!(per_node.iter().all(|&n| n > 0), "{per_node:?}");
    assert_eq!(lookup(&t, &ks), vec![OK; 60]);
    let (st, bufs) = load(&t, &ks);
    assert_eq!(st, vec![OK; 60]);
    assert!(bufs == d, "payload differs");
    assert_eq!(store(&t, &ks, &d), vec![EXISTS; 60]);
    // A second tier whose first seed is dead finds the cluster through the next one.
    let dead = common::free_port();
    let url = format!("redis://127.0.0.1:{dead},127.0.0.1:{}", c.nodes[1].port);
    let t2 = Tier::connect(config(&url, 64 * KB), NS).unwrap();
    assert_eq!(t2.startup_error(), None);
    assert_eq!(lookup(&t2, &ks), vec![OK; 60]);
    let st = t.stats();
    assert_eq!(
        (st.stored_chunks, st.loaded_chunks, st.corrupt),
        (60, 60, 0)
    );
    // Per node: the three primaries, each having moved its share, none failed.
    let nodes = t.node_stats();
    let names: Vec<String> = c
        .primaries()
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let mut listed: Vec<String> = nodes.iter().map(|(n, _)| n.clone()).collect();
    listed.sort();
    let mut want = names.clone();
    want.sort();
    assert_eq!(listed, want);
    let total = (60 * 64 * KB) as u64;
    assert_eq!(
        nodes.iter().map(|(_, s)| s.bytes_written).sum::<u64>(),
        total
    );
    assert_eq!(nodes.iter().map(|(_, s)| s.bytes_read).sum::<u64>(), total);
    assert!(
        nodes
            .iter()
            .all(|(_, s)| s.bytes_written > 0 && s.failures == 0 && !s.resting),
        "{nodes:?}"
    );
}

#[test]
fn every_ranks_shard_is_looked_up_in_one_slot() {
    let Some(c) = Cluster::start() else { return };
    let ranks = [*b"rank-0-namespace", *b"rank-1-namespace"];
    let ks = keys("ranks", 20);
    for (r, ns) in ranks.iter().enumerate() {
        let t = Tier::connect(config(&c.seed_url(), 16 * KB), *ns).unwrap();
        let mine: Vec<Vec<u8>> = ks
            .iter()
            .enumerate()
            .filter(|&(i, _)| r == 0 || i != 7)
            .map(|(_, k)| k.clone())
            .collect();
        assert_eq!(
            store(&t, &mine, &data(mine.len(), 16 * KB, 9)),
            vec![OK; mine.len()]
        );
    }
    let t = Tier::connect_shards(config(&c.seed_url(), 16 * KB), ranks[0], ranks.to_vec()).unwrap();
    let mut want = vec![OK; 20];
    want[7] = MISSING;
    assert_eq!(lookup(&t, &ks), want);
    assert_eq!(t.stats().server_errors, 0); // no CROSSSLOT: every shard of a chunk in one slot
}

#[test]
fn slots_moved_between_store_and_load_still_hit() {
    let Some(c) = Cluster::start() else { return };
    let t = Tier::connect(config(&c.seed_url(), 32 * KB), NS).unwrap();
    let ks = keys("moved", 12);
    let d = data(12, 32 * KB, 3);
    assert_eq!(store(&t, &ks, &d), vec![OK; 12]);
    // Every chunk's slot goes to another primary behind the tier's back.
    let mut slots: Vec<u16> = ks.iter().map(|k| chunk_slot(k)).collect();
    slots.sort_unstable();
    slots.dedup();
    for &s in &slots {
        c.move_slot(s, true, 0);
    }
    let before = t.stats();
    let (st, bufs) = load(&t, &ks);
    assert_eq!(
        st,
        vec![OK; 12],
        "a full hit after MOVED: {:?}",
        t.last_error()
    );
    assert!(bufs == d);
    for &s in &slots {
        c.move_slot(s, true, 0); // and on again, for the lookup
    }
    assert_eq!(lookup(&t, &ks), vec![OK; 12]);
    // Counted once each, though each went out twice (MOVED, then to the new owner).
    let after = t.stats();
    assert_eq!(after.loaded_chunks - before.loaded_chunks, 12);
    assert_eq!(after.load_failures - before.load_failures, 0);
    assert_eq!(after.lookup_keys - before.lookup_keys, 12);
    assert_eq!(after.lookup_hits - before.lookup_hits, 12);
    assert_eq!(
        store(&t, &keys("after-move", 4), &data(4, 32 * KB, 5)),
        vec![OK; 4]
    );
}

#[test]
fn a_half_done_migration_gives_a_hit_or_a_clean_miss() {
    let Some(c) = Cluster::start() else { return };
    let t = Tier::connect(config(&c.seed_url(), 32 * KB), NS).unwrap();
    let ks = keys("ask", 8);
    let d = data(8, 32 * KB, 11);
    assert_eq!(store(&t, &ks, &d), vec![OK; 8]);
    // Chunk 0's slot is half migrated: one of its two keys is on the target, one not.
    c.move_slot(chunk_slot(&ks[0]), false, 1);
    let (st, bufs) = load(&t, &ks);
    // The source answers ASK for the part that left; on the target (after ASKING) the other
    // part is not there yet: a clean miss, not a failure and never corrupt.
    assert_eq!(st, [vec![MISSING], vec![OK; 7]].concat());
    assert!(bufs[1..] == d[1..], "payload differs");
    assert_eq!(t.stats().load_failures, 0);
    // EXISTS of both parts, one of them gone: TRYAGAIN (Redis refuses a multi-key command
    // while a slot's keys are split), a miss for this lookup.
    let found = lookup(&t, &ks);
    assert_eq!(found, [vec![FAILED], vec![OK; 7]].concat());
    assert_eq!(t.stats().corrupt, 0);
}

#[test]
fn a_migrating_slot_is_followed_where_ask_sends_it() {
    let Some(c) = Cluster::start() else { return };
    let t = Tier::connect(config(&c.seed_url(), 32 * KB), NS).unwrap();
    let ks = keys("asking", 8);
    let d = data(8, 32 * KB, 51);
    assert_eq!(store(&t, &ks, &d), vec![OK; 8]);
    // Chunk 0's slot is being migrated and every key of it has gone: the source answers ASK
    // until the slot is handed over, and the target serves it only after ASKING.
    let slot = chunk_slot(&ks[0]);
    let (_, to) = c.move_slot(slot, false, usize::MAX);
    let (st, bufs) = load(&t, &ks);
    assert_eq!(st, vec![OK; 8]);
    assert!(bufs == d, "payload differs");
    assert_eq!(lookup(&t, &ks), vec![OK; 8]);
    // A chunk new to the migrating slot: Redis takes no multi-key write there (TRYAGAIN), so a
    // split chunk (MSETNX of its two parts) is dropped, a clean failure; a one-key chunk is
    // written where the slot's keys are going.
    let fresh = (0..)
        .map(|i| format!("asking-new-{i}").into_bytes())
        .find(|k| chunk_slot(k) == slot)
        .unwrap();
    let fresh = std::slice::from_ref(&fresh);
    assert_eq!(store(&t, fresh, &data(1, 32 * KB, 61)), vec![FAILED]);
    assert_eq!(t.stats().store_failures, 1);
    let small = Tier::connect(config(&c.seed_url(), 4 * KB), NS).unwrap();
    let fd = data(1, 4 * KB, 62);
    assert_eq!(store(&small, fresh, &fd), vec![OK]);
    let mut on_target = c.nodes.iter().find(|n| n.port == to).unwrap().raw();
    assert_eq!(on_target.cmd(&[b"ASKING"]), Reply::Simple("OK".into()));
    let header = common::redis_key(&NS, &fresh[0], "h");
    assert_eq!(on_target.int(&[b"EXISTS", &header]), 1);
    assert_eq!(load(&small, fresh), (vec![OK], fd));
    assert_eq!(small.stats().store_failures, 0);
    // The ASK answers were followed, not counted as failures.
    let s = t.stats();
    assert_eq!((s.load_failures, s.corrupt), (0, 0), "{s:?}");
}

#[test]
fn a_killed_primary_is_replaced_and_the_tier_recovers_without_a_restart() {
    let Some(mut c) = Cluster::start() else {
        return;
    };
    let mut cfg = config(&c.seed_url(), 32 * KB);
    cfg.job_timeout = Duration::from_millis(500);
    cfg.breaker_cooldown = Duration::from_millis(300);
    let t = Tier::connect(cfg, NS).unwrap();
    let ks = keys("failover", 24);
    let d = data(24, 32 * KB, 21);
    assert_eq!(store(&t, &ks, &d), vec![OK; 24]);
    // Replicated before the kill (replication is asynchronous).
    c.wait_replicated(Duration::from_secs(60));
    let victim = c.primary_of(chunk_slot(&ks[0])).port;
    let idx = c.nodes.iter().position(|n| n.port == victim).unwrap();
    c.nodes[idx].kill();
    let killed_at = Instant::now();
    let mut slowest = Duration::ZERO;
    let recovered = loop {
        let start = Instant::now();
        let (st, bufs) = load(&t, &ks);
        slowest = slowest.max(start.elapsed());
        for (i, s) in st.iter().enumerate() {
            if *s == OK {
                assert!(bufs[i] == d[i], "chunk {i} served wrong bytes");
            }
        }
        if st == vec![OK; 24] {
            break killed_at.elapsed();
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(30),
            "never recovered: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // A job fails by its deadline (0.5 s + bytes) while the primary is gone, never hangs.
    assert!(slowest < Duration::from_secs(3), "a load took {slowest:?}");
    // The dead node failed and rested; the others only refused jobs with CLUSTERDOWN while
    // the cluster was down (error replies: counted, no rest).
    let nodes = t.node_stats();
    let dead = format!("127.0.0.1:{victim}");
    for (name, s) in &nodes {
        if *name == dead {
            assert!(s.failures >= 1, "{nodes:?}");
        } else {
            assert!(!s.resting, "{nodes:?}");
        }
    }
    assert!(nodes.iter().any(|(n, _)| *n == dead), "{nodes:?}");
    eprintln!(
        "failover: every chunk loaded again {recovered:?} after the kill; slowest load {slowest:?}"
    );
    c.wait_ok(Duration::from_secs(30));
    assert_eq!(
        store(&t, &keys("after", 6), &data(6, 32 * KB, 40)),
        vec![OK; 6]
    );
}

#[test]
fn cluster_settings_that_cannot_work_are_refused() {
    let Some(c) = Cluster::start() else { return };
    let err = |url: String, cluster: Option<bool>| {
        let mut cfg = config(&url, 4096);
        cfg.cluster = cluster;
        match Tier::connect(cfg, NS) {
            // Auto mode meets the cluster's refusal of SELECT first, with its own words.
            Err(e @ (RemoteError::Config(_) | RemoteError::Auth(_))) => e.to_string(),
            other => panic!("expected a start-up error, got {:?}", other.err()),
        }
    };
    let port = c.nodes[0].port;
    assert!(err(format!("redis://127.0.0.1:{port}/2"), None).contains("database 2"));
    assert!(err(format!("redis://127.0.0.1:{port}/2"), Some(true)).contains("database 2"));
    let two = format!("redis://127.0.0.1:{port},127.0.0.1:{}", c.nodes[1].port);
    assert!(err(two, Some(false)).contains("cluster=false"));
}

#[test]
fn a_frozen_primary_costs_only_its_own_chunks_and_the_tier_recovers() {
    let Some(c) = Cluster::start() else { return };
    let mut cfg = config(&c.seed_url(), 32 * KB);
    cfg.job_timeout = Duration::from_millis(500);
    cfg.breaker_cooldown = Duration::from_millis(300);
    let t = Tier::connect(cfg, NS).unwrap();
    let ks = keys("frozen", 24);
    let d = data(24, 32 * KB, 31);
    assert_eq!(store(&t, &ks, &d), vec![OK; 24]);
    c.wait_replicated(Duration::from_secs(60));
    let victim = c.primary_of(chunk_slot(&ks[0])).port;
    let on_victim: Vec<bool> = ks
        .iter()
        .map(|k| c.primary_of(chunk_slot(k)).port == victim)
        .collect();
    let idx = c.nodes.iter().position(|n| n.port == victim).unwrap();
    // Hung, not dead: connections hang instead of being refused.
    c.nodes[idx].signal("-STOP");
    let frozen_at = Instant::now();
    let mut attempts = 0;
    loop {
        attempts += 1;
        let (st, bufs) = load(&t, &ks);
        for (i, s) in st.iter().enumerate() {
            if *s == OK {
                assert!(bufs[i] == d[i], "chunk {i} served wrong bytes");
            }
        }
        if st == vec![OK; 24] {
            break;
        }
        // Every node's part runs at once: even the first job that meets the frozen node, and
        // waits its deadline out there, loads the other primaries' chunks. (Later, until the
        // replica takes over, the whole cluster answers CLUSTERDOWN: full coverage is required.)
        let others_ok = st.iter().zip(&on_victim).all(|(s, v)| *v || *s == OK);
        assert!(
            others_ok || attempts > 1,
            "the first job lost the other primaries' chunks: {st:?}"
        );
        assert!(
            frozen_at.elapsed() < Duration::from_secs(30),
            "never recovered: {st:?}, {:?}",
            t.last_error()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "frozen primary: every chunk loaded again {:?} after the freeze",
        frozen_at.elapsed()
    );
    assert!(attempts > 1, "the frozen node's chunks loaded at once");
    c.nodes[idx].signal("-CONT");
}

#[test]
fn a_unix_url_cannot_be_a_cluster() {
    let mut cfg = config("unix:///nonexistent/redis.sock", 4096);
    cfg.cluster = Some(true);
    match Tier::connect(cfg, NS) {
        Err(RemoteError::Config(m)) => assert!(m.contains("unix://"), "{m}"),
        other => panic!("expected a config error, got {:?}", other.err()),
    }
}
