//! Orphans, aliasing, queueing and failure reasons, mostly against a real redis-server.

mod common;

use common::tier::{config, keys, load, store, submit_store, wait_job, wait_jobs, NS};
use common::{pattern, redis_key, Reply};
use kvoffload_redis::status::*;
use kvoffload_redis::{BreakerState, CanaryOutcome, RawBufMut, RemoteError, Tier};
use std::time::Duration;

const KB: usize = 1024;

fn data_for(n: usize, len: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| pattern(i as u64 + 7, len)).collect()
}

#[test]
fn an_orphan_body_is_cleared_by_the_next_store() {
    let Some(s) = server!() else { return };
    let chunk = 64 * KB;
    let t = Tier::connect(config(&s.url(), chunk), NS).unwrap();
    let ks = keys("orphan", 1);
    let data = data_for(1, chunk);
    // As left by allkeys-lru evicting the header: a body nobody's header vouches for.
    let mut raw = s.raw();
    let (h, b) = (redis_key(&NS, &ks[0], "h"), redis_key(&NS, &ks[0], "b"));
    raw.cmd(&[b"SET", &b, &pattern(1, chunk - 4096)]);
    assert_eq!(store(&t, &ks, &data), vec![OK]);
    assert_eq!(raw.int(&[b"EXISTS", &h, &b]), 2, "both parts ours");
    let why = t.last_error().expect("a reason");
    assert!(why.contains("without its header"), "{why}");
    let (st, bufs) = load(&t, &ks);
    assert_eq!(st, vec![OK]);
    assert!(bufs[0] == data[0], "payload differs");
}

#[test]
fn a_store_queued_past_its_budget_is_dropped_unrun() {
    let Some(s) = server!() else { return };
    // 1 s of budget per chunk on top of 100 ms: the running store of 30 chunks has 30 s
    // (a liveness bound), the queued one of 1 chunk 1.1 s.
    let chunk = 100_000;
    let mut c = config(&s.url(), chunk);
    c.connections = 1;
    c.job_timeout = Duration::from_millis(100);
    c.min_bandwidth = 100_000;
    // One breaker failure would open it: the expired job must not count as one.
    c.breaker_failures = 1;
    let t = Tier::connect(c, NS).unwrap();
    let (big_keys, big) = (keys("running", 30), data_for(30, chunk));
    let (late_keys, late) = (keys("queued", 1), data_for(1, chunk));
    s.signal("-STOP");
    let running = submit_store(&t, &big_keys, &big);
    let queued = submit_store(&t, &late_keys, &late);
    // Past the queued store's budget (a lower bound only) while the running one blocks.
    std::thread::sleep(Duration::from_millis(1500));
    s.signal("-CONT");
    let got = wait_jobs(&t, &[running, queued]);
    assert_eq!(got[&running], vec![OK; 30]);
    assert_eq!(got[&queued], vec![DROPPED]);
    let st = t.stats();
    assert_eq!(
        (st.expired_in_queue, st.stores_dropped, st.store_failures),
        (1, 1, 0),
        "{st:?}"
    );
    assert_eq!((st.breaker_opens, st.timeouts), (0, 0), "{st:?}");
    assert_eq!(t.state(), BreakerState::Up);
    assert!(t.last_error().unwrap().contains("in the queue"));
    assert_eq!(load(&t, &late_keys).0, vec![MISSING], "never sent");
    assert_eq!(store(&t, &late_keys, &late), vec![OK]);
}

#[test]
fn a_full_noeviction_server_makes_the_canary_down_and_names_the_reply() {
    let Some(s) = server!("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") else {
        return;
    };
    let t = Tier::connect(config(&s.url(), 16 * KB), NS).unwrap();
    let mut raw = s.raw();
    // Small values: a large one's query buffer counts too, and frees on its OOM reply.
    let filler = vec![b'x'; KB];
    let oom = |raw: &mut common::Raw, k: &[u8], v: &[u8]| matches!(raw.cmd(&[b"SET", k, v]), Reply::Error(m) if m.starts_with("OOM"));
    let full = (0..100_000).any(|i| oom(&mut raw, format!("fill-{i}").as_bytes(), &filler));
    assert!(full, "the server never reported OOM");
    // The failed SET's own argument made it over; pinned well below the usage so that the
    // server's housekeeping (query buffers shrinking) cannot let a small SET back in.
    let used = raw.info_field("memory", "used_memory");
    let limit = (used / 2).to_string();
    raw.cmd(&[b"CONFIG", b"SET", b"maxmemory", limit.as_bytes()]);
    assert!(oom(&mut raw, b"tiny", b"1"), "full for small values too");
    match t.canary(b"c", b"identity", Duration::from_secs(5)) {
        CanaryOutcome::Down(why) => assert!(why.contains("OOM"), "{why}"),
        other => panic!("{other:?}"),
    }
    let ks = keys("oom", 1);
    assert_eq!(store(&t, &ks, &data_for(1, 16 * KB)), vec![FAILED]);
    let why = t.last_error().unwrap();
    assert!(why.contains("OOM command not allowed"), "{why}");
    assert_eq!(t.state(), BreakerState::Up);
}

#[test]
fn corrupt_values_name_their_reason_not_the_key() {
    let Some(s) = server!() else { return };
    let chunk = 64 * KB;
    let t = Tier::connect(config(&s.url(), chunk), NS).unwrap();
    assert_eq!(t.last_error(), None);
    let ks = vec![b"secret-key-name".to_vec()];
    assert_eq!(store(&t, &ks, &data_for(1, chunk)), vec![OK]);
    let h = redis_key(&NS, &ks[0], "h");
    s.raw().cmd(&[b"SETRANGE", &h, b"30", b"\xff"]);
    assert_eq!(load(&t, &ks).0, vec![CORRUPT]);
    let why = t.last_error().unwrap();
    assert!(
        why.contains("corrupt value for key 7365637265742d6b..: header checksum mismatch"),
        "{why}"
    );
    assert!(!why.contains("secret"), "{why}");
}

#[test]
fn overlapping_load_destinations_are_refused() {
    // Refused at submit, before any I/O: no server needed.
    let port = common::free_port();
    let chunk = 16 * KB;
    let t = Tier::connect(config(&format!("redis://127.0.0.1:{port}"), chunk), NS).unwrap();
    let mut mem = vec![0u8; 2 * chunk];
    let base = mem.as_mut_ptr();
    let submit = |offsets: &[usize]| {
        let items = offsets
            .iter()
            .enumerate()
            // SAFETY: each span lies in `mem`, which outlives the job: it is waited for below.
            .map(|(i, &off)| {
                (vec![i as u8], unsafe {
                    RawBufMut::new(base.add(off), chunk)
                })
            })
            .collect();
        t.submit_load(items)
    };
    match submit(&[chunk, 0, chunk / 2]) {
        Err(RemoteError::Config(m)) => {
            assert!(m.contains("items 1 and 2") && m.contains("overlap"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    // Adjacent is fine (and fails fast: the tier is down).
    let id = submit(&[chunk, 0]).unwrap();
    assert_eq!(wait_job(&t, id), vec![FAILED; 2]);
}
