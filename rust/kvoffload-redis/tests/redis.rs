//! Against a real redis-server started by each test.

mod common;

use common::tier::{config, keys, load, lookup, store, submit_load, submit_store, wait_job, NS};
use common::{pattern, redis_key, Reply};
use kvoffload_redis::format::{Header, Layout};
use kvoffload_redis::status::*;
use kvoffload_redis::{BreakerState, CanaryOutcome, NodeStats, RemoteError, Tier};
use std::time::{Duration, Instant};

const KB: usize = 1024;
const MB: usize = 1024 * 1024;

fn data_for(keys: &[Vec<u8>], len: usize) -> Vec<Vec<u8>> {
    (0..keys.len())
        .map(|i| pattern(i as u64 + 1, len))
        .collect()
}

fn round_trip(url: &str, chunk: usize, n: usize) {
    let t = Tier::connect(config(url, chunk), NS).unwrap();
    assert_eq!(t.startup_error(), None);
    let ks = keys(&format!("rt{chunk}"), n);
    let data = data_for(&ks, chunk);
    assert_eq!(store(&t, &ks, &data), vec![OK; n]);
    assert_eq!(lookup(&t, &ks), vec![OK; n]);
    let (st, bufs) = load(&t, &ks);
    assert_eq!(st, vec![OK; n]);
    for (b, d) in bufs.iter().zip(&data) {
        assert!(b == d, "payload differs");
    }
    let s = t.stats();
    assert_eq!(
        (s.stored_chunks, s.loaded_chunks, s.corrupt),
        (n as u64, n as u64, 0)
    );
    assert_eq!(s.bytes_read, (n * chunk) as u64);
    assert_eq!(store(&t, &ks, &data), vec![EXISTS; n]);
    // The one server is the one node; a chunk already there moved nothing.
    let moved = (n * chunk) as u64;
    let want = NodeStats {
        bytes_written: moved,
        bytes_read: moved,
        failures: 0,
        resting: false,
    };
    let [(_, node)] = &t.node_stats()[..] else {
        panic!("one server, one node")
    };
    assert_eq!(node, &want);
}

#[test]
fn round_trip_many_chunks() {
    let Some(s) = server!() else { return };
    round_trip(&s.url(), 256 * KB, 64);
    round_trip(&s.url(), 2 * MB, 6);
    // Named in the per-node stats as `host:port`, whatever else the url holds.
    let t = Tier::connect(config(&s.url(), 2 * MB), NS).unwrap();
    assert_eq!(t.node_stats()[0].0, format!("127.0.0.1:{}", s.port));
}

#[test]
fn unsplit_small_chunks() {
    let Some(s) = server!() else { return };
    for chunk in [1, 100, 8192] {
        round_trip(&s.url(), chunk, 5);
        let k = format!("rt{chunk}-0").into_bytes();
        let mut raw = s.raw();
        assert_eq!(raw.int(&[b"EXISTS", &redis_key(&NS, &k, "h")]), 1);
        assert_eq!(raw.int(&[b"EXISTS", &redis_key(&NS, &k, "b")]), 0);
    }
    round_trip(&s.url(), 8193, 3);
    let mut raw = s.raw();
    assert_eq!(raw.int(&[b"EXISTS", &redis_key(&NS, b"rt8193-0", "b")]), 1);
}

#[test]
fn unix_socket_and_select_isolation() {
    let Some(s) = server!() else { return };
    let sock = s.sock();
    round_trip(&format!("unix://{}", sock.display()), 64 * KB, 4);
    let t3 = Tier::connect(
        config(&format!("unix://{}?db=3", sock.display()), 64 * KB),
        NS,
    )
    .unwrap();
    let t0 = Tier::connect(
        config(&format!("redis://127.0.0.1:{}/0", s.port), 64 * KB),
        NS,
    )
    .unwrap();
    let ks = keys("db", 3);
    assert_eq!(store(&t3, &ks, &data_for(&ks, 64 * KB)), vec![OK; 3]);
    assert_eq!(lookup(&t3, &ks), vec![OK; 3]);
    assert_eq!(lookup(&t0, &ks), vec![MISSING; 3]);
    assert_eq!(load(&t0, &ks).0, vec![MISSING; 3]);
    let bad = Tier::connect(
        config(&format!("redis://127.0.0.1:{}/99", s.port), 64 * KB),
        NS,
    );
    assert!(
        matches!(bad, Err(RemoteError::Auth(ref m)) if m.contains("99")),
        "{:?}",
        bad.err()
    );
}

#[test]
fn namespace_isolation() {
    let Some(s) = server!() else { return };
    let a = Tier::connect(config(&s.url(), 64 * KB), NS).unwrap();
    let b = Tier::connect(config(&s.url(), 64 * KB), *b"other-namespace!").unwrap();
    let ks = keys("ns", 4);
    assert_eq!(store(&a, &ks, &data_for(&ks, 64 * KB)), vec![OK; 4]);
    assert_eq!(lookup(&b, &ks), vec![MISSING; 4]);
    assert_eq!(load(&b, &ks).0, vec![MISSING; 4]);
    assert_eq!(load(&a, &ks).0, vec![OK; 4]);
}

#[test]
fn concurrent_stores_of_one_key() {
    let Some(s) = server!() else { return };
    let chunk = 512 * KB;
    let a = Tier::connect(config(&s.url(), chunk), NS).unwrap();
    let b = Tier::connect(config(&s.url(), chunk), NS).unwrap();
    for round in 0..20 {
        let ks = vec![format!("same-{round}").into_bytes()];
        let data = vec![pattern(round, chunk)];
        let (ia, ib) = (submit_store(&a, &ks, &data), submit_store(&b, &ks, &data));
        let (sa, sb) = (wait_job(&a, ia), wait_job(&b, ib));
        let mut got = [sa[0], sb[0]];
        got.sort();
        // MSETNX writes both parts or neither: one writer wins, whole.
        assert_eq!(got, [OK, EXISTS], "round {round}");
        let (st, bufs) = load(&a, &ks);
        assert_eq!(st, vec![OK], "round {round}");
        assert!(bufs[0] == data[0], "round {round}");
    }
    // Different payloads under one key (replicas whose KV differs in its last bits): the
    // stored chunk is exactly one writer's.
    for round in 0..20 {
        let ks = vec![format!("mixed-{round}").into_bytes()];
        let da = vec![pattern(1000 + round, chunk)];
        let db = vec![pattern(2000 + round, chunk)];
        let (ia, ib) = (submit_store(&a, &ks, &da), submit_store(&b, &ks, &db));
        let mut got = [wait_job(&a, ia)[0], wait_job(&b, ib)[0]];
        got.sort();
        assert_eq!(got, [OK, EXISTS], "round {round}");
        let (st, bufs) = load(&a, &ks);
        assert_eq!(st, vec![OK], "round {round}");
        assert!(bufs[0] == da[0] || bufs[0] == db[0], "round {round}");
    }
}

#[test]
fn lookup_pattern_and_touch() {
    let Some(s) = server!() else { return };
    let chunk = 16 * KB;
    let t = Tier::connect(config(&s.url(), chunk), NS).unwrap();
    let ks = keys("lk", 10);
    let even: Vec<_> = ks.iter().step_by(2).cloned().collect();
    assert_eq!(store(&t, &even, &data_for(&even, chunk)), vec![OK; 5]);
    let want: Vec<u8> = (0..10)
        .map(|i| if i % 2 == 0 { OK } else { MISSING })
        .collect();
    // The LRU clock ticks in whole seconds and the server refreshes it every 100 ms, so a key
    // touched just before a tick reads 1 right after: untouched must read >= 2, touched <= 1.
    std::thread::sleep(Duration::from_millis(3100));
    let mut raw = s.raw();
    let idle = |raw: &mut common::Raw, part| {
        raw.int(&[b"OBJECT", b"IDLETIME", &redis_key(&NS, &ks[0], part)])
    };
    assert!(idle(&mut raw, "h") >= 2);
    assert_eq!(lookup(&t, &ks), want);
    for part in ["h", "b"] {
        assert!(idle(&mut raw, part) <= 1, "{part} not touched");
    }
    let st = t.stats();
    assert_eq!((st.lookup_keys, st.lookup_hits), (10, 5));
    // A body without its header is not a hit.
    raw.cmd(&[b"DEL", &redis_key(&NS, &ks[2], "h")]);
    assert_eq!(lookup(&t, &ks[2..3]), vec![MISSING]);
}

#[test]
fn ttl_is_set_on_both_parts() {
    let Some(s) = server!() else { return };
    let mut c = config(&s.url(), 64 * KB);
    c.ttl = Some(Duration::from_secs(100));
    let t = Tier::connect(c, NS).unwrap();
    let ks = keys("ttl", 1);
    assert_eq!(store(&t, &ks, &data_for(&ks, 64 * KB)), vec![OK]);
    let mut raw = s.raw();
    for part in ["h", "b"] {
        let pttl = raw.int(&[b"PTTL", &redis_key(&NS, &ks[0], part)]);
        assert!(pttl > 90_000 && pttl <= 100_000, "{part}: {pttl}");
    }
}

#[test]
fn corrupt_values_are_reported_and_deleted() {
    let Some(s) = server!() else { return };
    let chunk = 64 * KB;
    let lay = Layout::new(chunk);
    let t = Tier::connect(config(&s.url(), chunk), NS).unwrap();
    let names = [
        "good0", "random", "short", "flipped", "foreign", "nobody", "listtype", "wrongkey", "good1",
    ];
    let ks: Vec<Vec<u8>> = names.iter().map(|n| n.as_bytes().to_vec()).collect();
    let data = data_for(&ks, chunk);
    assert_eq!(store(&t, &ks, &data), vec![OK; ks.len()]);
    let mut raw = s.raw();
    let h = |k: &str| redis_key(&NS, k.as_bytes(), "h");
    let b = |k: &str| redis_key(&NS, k.as_bytes(), "b");
    raw.cmd(&[b"SET", &h("random"), &pattern(99, 64 + 4096)]);
    let Reply::Bulk(full) = raw.cmd(&[b"GET", &h("short")]) else {
        panic!()
    };
    raw.cmd(&[b"SET", &h("short"), &full[..100]]);
    raw.cmd(&[b"SETRANGE", &b("flipped"), b"1000", b"\xff"]);
    let Reply::Bulk(mut foreign) = raw.cmd(&[b"GET", &h("foreign")]) else {
        panic!()
    };
    let other = Header::for_chunk(&lay, b"other-namespace!", b"foreign", &data[4]).encode();
    foreign[..64].copy_from_slice(&other);
    raw.cmd(&[b"SET", &h("foreign"), &foreign]);
    raw.cmd(&[b"DEL", &b("nobody")]);
    raw.cmd(&[b"DEL", &h("listtype")]);
    raw.cmd(&[b"RPUSH", &h("listtype"), b"x"]);
    let Reply::Bulk(good1) = raw.cmd(&[b"GET", &h("good1")]) else {
        panic!()
    };
    raw.cmd(&[b"SET", &h("wrongkey"), &good1]);
    let (st, bufs) = load(&t, &ks);
    assert_eq!(
        st,
        [OK, CORRUPT, CORRUPT, CORRUPT, CORRUPT, CORRUPT, CORRUPT, CORRUPT, OK]
    );
    assert!(bufs[0] == data[0] && bufs[8] == data[8]);
    for name in &names[1..8] {
        assert_eq!(
            raw.int(&[b"EXISTS", &h(name), &b(name)]),
            0,
            "{name} not deleted"
        );
    }
    let s = t.stats();
    assert_eq!((s.corrupt, s.deleted_corrupt, s.loaded_chunks), (7, 7, 2));
    assert_eq!(t.state(), BreakerState::Up);
    assert_eq!(load(&t, &ks[1..3]).0, vec![MISSING; 2]);
}

#[test]
fn passwords() {
    let Some(s) = server!("--requirepass", "s3cret") else {
        return;
    };
    round_trip(&s.url(), 16 * KB, 2);
    for url in [
        format!("redis://:wrong@127.0.0.1:{}", s.port),
        format!("redis://127.0.0.1:{}", s.port),
        format!("redis://bob:s3cret@127.0.0.1:{}", s.port),
    ] {
        match Tier::connect(config(&url, 16 * KB), NS) {
            Err(RemoteError::Auth(m)) => assert!(!m.contains("wrong"), "{m}"),
            other => panic!("{url}: {:?}", other.err()),
        }
    }
    let sock = format!("unix://{}?password=s3cret&db=2", s.sock().display());
    round_trip(&sock, 16 * KB, 2);
}

#[test]
fn unreachable_at_startup_serves_down() {
    let port = common::free_port();
    let mut c = config(&format!("redis://127.0.0.1:{port}"), 16 * KB);
    c.breaker_cooldown = Duration::from_secs(30);
    let t = Tier::connect(c, NS).unwrap();
    assert!(t.startup_error().unwrap().contains("unreachable"));
    assert_eq!(t.state(), BreakerState::Down);
    let ks = keys("down", 3);
    let attempts = t.stats().connect_failures;
    assert_eq!(lookup(&t, &ks), vec![MISSING; 3]);
    assert_eq!(store(&t, &ks, &data_for(&ks, 16 * KB)), vec![DROPPED; 3]);
    assert_eq!(load(&t, &ks).0, vec![FAILED; 3]);
    // Failed fast: no job tried to connect while the breaker is open.
    assert_eq!(t.stats().connect_failures, attempts);
    assert!(matches!(
        t.canary(b"c", b"id", Duration::from_secs(1)),
        CanaryOutcome::Down(_)
    ));
    assert_eq!(t.stats().stores_dropped, 3);
}

/// Submits a store every 50 ms until one succeeds (30 s at most: "recovers", not how fast; the
/// bench measures that).
fn recovers(t: &Tier, chunk: usize) {
    let start = Instant::now();
    let ks = keys("recover", 1);
    let data = data_for(&ks, chunk);
    for i in 0.. {
        let ks = vec![format!("recover-{i}").into_bytes()];
        if store(t, &ks, &data) == vec![OK] {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no recovery");
        std::thread::sleep(Duration::from_millis(50));
    }
    unreachable!()
}

#[test]
fn server_killed_mid_load_then_restarted() {
    let Some(mut s) = server!() else { return };
    let chunk = 2 * MB;
    let t = Tier::connect(config(&s.url(), chunk), NS).unwrap();
    let ks = keys("kill", 16);
    assert_eq!(store(&t, &ks, &data_for(&ks, chunk)), vec![OK; 16]);
    // Stopped first, so the load is surely in flight when the server dies.
    s.signal("-STOP");
    let mut bufs = vec![vec![0u8; chunk]; ks.len()];
    let id = submit_load(&t, &ks, &mut bufs);
    std::thread::sleep(Duration::from_millis(100));
    s.kill();
    assert_eq!(wait_job(&t, id), vec![FAILED; 16]);
    for _ in 0..3 {
        store(&t, &ks[..1], &data_for(&ks[..1], chunk));
    }
    assert_eq!(t.state(), BreakerState::Down);
    let st = t.stats();
    assert!(st.breaker_opens >= 1 && st.connect_failures >= 1, "{st:?}");
    let [(_, node)] = &t.node_stats()[..] else {
        panic!("one server, one node")
    };
    // The load, and the stores until the breaker opened (three failures by default).
    assert!(node.resting && node.failures >= 3, "{node:?}");
    s.spawn();
    recovers(&t, chunk);
    assert_eq!(t.state(), BreakerState::Up);
    assert!(!t.node_stats()[0].1.resting);
    assert_eq!(load(&t, &ks[..2]).0, vec![MISSING; 2]);
}

#[test]
fn stopped_server_fails_jobs_by_their_deadline() {
    let Some(s) = server!() else { return };
    let chunk = 256 * KB;
    let mut c = config(&s.url(), chunk);
    c.job_timeout = Duration::from_millis(300);
    c.connections = 1;
    let t = Tier::connect(c, NS).unwrap();
    let ks = keys("stop", 4);
    assert_eq!(store(&t, &ks, &data_for(&ks, chunk)), vec![OK; 4]);
    s.signal("-STOP");
    for i in 0..3 {
        assert_eq!(load(&t, &ks).0, vec![FAILED; 4], "attempt {i}");
    }
    assert!(t.stats().timeouts >= 1);
    assert_eq!(t.state(), BreakerState::Down);
    let timeouts = t.stats().timeouts;
    assert_eq!(lookup(&t, &ks), vec![MISSING; 4]);
    assert_eq!(t.stats().timeouts, timeouts); // answered by the open breaker, not the server
    s.signal("-CONT");
    recovers(&t, chunk);
    assert_eq!(load(&t, &ks).0, vec![OK; 4]);
}

#[test]
fn out_of_memory_fails_stores_without_tripping_the_breaker() {
    let Some(s) = server!("--maxmemory", "8mb", "--maxmemory-policy", "noeviction") else {
        return;
    };
    let chunk = 2 * MB;
    let t = Tier::connect(config(&s.url(), chunk), NS).unwrap();
    let ks = keys("oom", 8);
    let st = store(&t, &ks, &data_for(&ks, chunk));
    assert!(st.contains(&OK) && st.contains(&FAILED), "{st:?}");
    assert!(st.iter().all(|&x| x == OK || x == FAILED));
    for _ in 0..5 {
        store(&t, &ks[7..], &data_for(&ks[7..], chunk));
    }
    let stats = t.stats();
    assert!(
        stats.store_failures >= 5 && stats.server_errors >= 5,
        "{stats:?}"
    );
    assert_eq!(t.state(), BreakerState::Up);
    // Each OOM reply is a failure of the node, which does not rest for it.
    let [(_, node)] = &t.node_stats()[..] else {
        panic!("one server, one node")
    };
    assert_eq!(node.failures, stats.server_errors, "{node:?}");
    assert!(!node.resting);
    // Whatever was reported OK loads; the failed ones are cleanly missing, not corrupt.
    let (ld, _) = load(&t, &ks);
    for (a, b) in st.iter().zip(&ld) {
        assert_eq!((*a == OK), (*b == OK), "{st:?} vs {ld:?}");
        assert_ne!(*b, CORRUPT);
    }
}

#[test]
fn memory_per_chunk_is_close_to_payload() {
    let Some(s) = server!() else { return };
    let chunk = 2 * MB;
    let n = 32;
    let t = Tier::connect(config(&s.url(), chunk), NS).unwrap();
    let mut raw = s.raw();
    let before = raw.info_field("memory", "used_memory");
    let ks = keys("mem", n);
    assert_eq!(store(&t, &ks, &data_for(&ks, chunk)), vec![OK; n]);
    // Measured after the tier's connections close: their query buffers are not chunk memory.
    drop(t);
    std::thread::sleep(Duration::from_millis(200));
    let after = raw.info_field("memory", "used_memory");
    let ratio = (after - before) as f64 / (n * chunk) as f64;
    eprintln!("used_memory delta / payload = {ratio:.4}");
    assert!(ratio <= 1.02, "ratio {ratio}");
}

#[test]
fn backpressure_drops_and_close_fails_queued() {
    let Some(s) = server!() else { return };
    let chunk = 256 * KB;
    let mut c = config(&s.url(), chunk);
    c.max_store_bytes_in_flight = 2 * chunk as u64;
    c.connections = 1;
    c.job_timeout = Duration::from_secs(5);
    let t = Tier::connect(c, NS).unwrap();
    let ks = keys("bp", 2);
    let data = data_for(&ks, chunk);
    s.signal("-STOP");
    let first = submit_store(&t, &ks, &data);
    // Lets the one worker take the store before lookups (which go first) are queued.
    std::thread::sleep(Duration::from_millis(200));
    let dropped = submit_store(&t, &ks[..1], &data[..1]);
    let lookups: Vec<u64> = (0..3)
        .map(|_| t.submit_lookup(ks.clone()).unwrap())
        .collect();
    assert_eq!(wait_job(&t, dropped), vec![DROPPED]);
    assert_eq!(t.in_flight(), 4);
    assert_eq!(t.stats().store_bytes_in_flight, 2 * chunk as u64);
    s.signal("-CONT");
    t.close();
    let done = t.drain(Duration::from_secs(1));
    let got: std::collections::HashMap<u64, Vec<u8>> =
        done.into_iter().map(|c| (c.job_id, c.statuses)).collect();
    assert_eq!(got[&first], vec![OK; 2]);
    // The running job was a lookup or the store; any still queued failed.
    for id in &lookups {
        assert!(
            got[id] == vec![FAILED; 2] || got[id] == vec![OK; 2],
            "{:?}",
            got[id]
        );
    }
    assert!(matches!(t.submit_lookup(ks), Err(RemoteError::Closed)));
    assert_eq!(t.stats().stores_dropped, 1);
}

#[test]
fn canary_outcomes() {
    let Some(s) = server!() else { return };
    let t = Tier::connect(config(&s.url(), 16 * KB), NS).unwrap();
    let d = Duration::from_secs(1);
    assert_eq!(t.canary(b"seed", b"identity-a", d), CanaryOutcome::Written);
    assert_eq!(t.canary(b"seed", b"identity-a", d), CanaryOutcome::Matched);
    assert_eq!(
        t.canary(b"seed", b"identity-b", d),
        CanaryOutcome::Differs(b"identity-a".to_vec())
    );
}

#[test]
fn item_length_is_checked_at_submit() {
    let Some(s) = server!() else { return };
    let t = Tier::connect(config(&s.url(), 16 * KB), NS).unwrap();
    let err = submit_store_result(&t);
    assert!(matches!(err, Err(RemoteError::Config(ref m)) if m.contains("chunk_bytes")));
}

fn submit_store_result(t: &Tier) -> Result<u64, RemoteError> {
    let d = [0u8; 100];
    // SAFETY: the submit fails before any job holds the buffer.
    t.submit_store(vec![(b"k".to_vec(), unsafe {
        kvoffload_redis::RawBuf::new(d.as_ptr(), d.len())
    })])
}

#[test]
fn a_name_that_does_not_resolve_starts_the_tier_down_within_the_connect_timeout() {
    // `.invalid` never resolves (RFC 2606); without DNS the lookup may fail or hang instead.
    let mut cfg = config("redis://kvoffload-test.invalid:6379", 4096);
    cfg.connect_timeout = Duration::from_millis(500);
    let start = Instant::now();
    let t = Tier::connect(cfg, NS).unwrap();
    assert!(
        start.elapsed() < Duration::from_millis(1500),
        "{:?}",
        start.elapsed()
    );
    let why = t.startup_error().expect("started down");
    assert!(why.contains("resolving kvoffload-test.invalid"), "{why}");
}
