//! `Tier` on the real filesystem: jobs spread over threads, the index and its capacity, and
//! a restart that rebuilds the index from the directory.

mod common;

use common::jobs::{data, key, load, open, open_cfg, open_with, store, wait, CHUNK, FILE, NS};
use common::TempDir;
use kvoffload_disk::{BreakerState, DiskConfig, Tier};
use kvoffload_tier::buf::{RawBuf, RawBufMut};
use kvoffload_tier::status::{DROPPED, EXISTS, FAILED, MISSING, OK};
use std::time::{Duration, Instant};

fn files_on_disk(jobs: &Tier) -> usize {
    jobs.files().scan().unwrap().0.len()
}

#[test]
fn a_jobs_chunks_are_spread_over_the_threads_and_come_back_whole() {
    let d = TempDir::new("spread");
    let jobs = open(&d, 1000, 4);
    let ids: Vec<u32> = (0..64).collect();
    assert_eq!(store(&jobs, &ids), vec![OK; 64]);
    let (st, bufs) = load(&jobs, &ids);
    assert_eq!(st, vec![OK; 64]);
    for (i, b) in ids.iter().zip(&bufs) {
        assert!(*b == data(*i), "chunk {i} differs");
    }
    assert_eq!(store(&jobs, &ids[..2]), vec![EXISTS; 2]);
    // Lookups answer from the index: the leading run of chunks it holds.
    let keys: Vec<Vec<u8>> = [0, 1, 2, 500, 3].iter().map(|&i| key(i)).collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    assert_eq!(jobs.lookup_prefix(&refs), 3);
    assert_eq!(load(&jobs, &[500]).0, vec![MISSING]);
    assert_eq!(jobs.in_flight(), 0);
}

#[test]
fn capacity_is_held_by_evicting_the_least_recently_used() {
    let d = TempDir::new("capacity");
    let jobs = open(&d, 4, 2);
    // One job each: a job's chunks run on several threads, in no set order.
    for i in 0..4 {
        assert_eq!(store(&jobs, &[i]), vec![OK]);
    }
    // Chunk 0 read again: chunk 1 is now the least recently used.
    assert_eq!(load(&jobs, &[0]).0, vec![OK]);
    assert_eq!(store(&jobs, &[4]), vec![OK]);
    assert_eq!(store(&jobs, &[5]), vec![OK]);
    assert_eq!(jobs.counts(), (4, 2));
    assert_eq!(files_on_disk(&jobs), 4);
    let (st, _) = load(&jobs, &[0, 1, 2, 3, 4, 5]);
    assert_eq!(st, vec![OK, MISSING, MISSING, OK, OK, OK]);
}

#[test]
fn evicted_keys_are_kept_for_take_evicted_only_when_reported() {
    let d = TempDir::new("evicted");
    let mut cfg = DiskConfig::new(&d.0, CHUNK);
    cfg.rescan = None;
    cfg.report_evictions = true;
    let jobs = open_cfg(cfg, 2, 1);
    for i in 0..4 {
        assert_eq!(store(&jobs, &[i]), vec![OK]);
    }
    // Chunks 0 and 1 made room for 2 and 3, in that order; a second call finds nothing new.
    assert_eq!(jobs.take_evicted(), vec![key(0), key(1)]);
    assert!(jobs.take_evicted().is_empty());
    assert_eq!(load(&jobs, &[0]).0, vec![MISSING]);
    // Not reported (the default): nothing is kept.
    let other = TempDir::new("evicted-off");
    let quiet = open(&other, 1, 1);
    for i in 0..3 {
        assert_eq!(store(&quiet, &[i]), vec![OK]);
    }
    assert_eq!(quiet.counts().1, 2);
    assert!(quiet.take_evicted().is_empty());
}

#[test]
fn a_restarted_tier_serves_what_the_last_one_stored_oldest_evicted_first() {
    let d = TempDir::new("restart");
    {
        let jobs = open(&d, 100, 2);
        for i in 0..6 {
            assert_eq!(store(&jobs, &[i]), vec![OK]);
            // File times order the chunks for the next index: a visible step between them.
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let jobs = open(&d, 100, 2);
    assert_eq!(jobs.counts(), (6, 0));
    let (st, bufs) = load(&jobs, &[0, 5]);
    assert_eq!(st, vec![OK, OK]);
    assert!(bufs[0] == data(0) && bufs[1] == data(5));
    drop(jobs);
    // A smaller capacity: the least recently used files go first. Chunks 0 and 5 were read
    // by the last tier, which set their files' times: 1 and 2 go.
    let jobs = open(&d, 4, 2);
    assert_eq!(jobs.counts(), (4, 2));
    let (st, _) = load(&jobs, &[0, 1, 2, 3, 4, 5]);
    assert_eq!(st, vec![OK, MISSING, MISSING, OK, OK, OK]);
}

#[test]
fn bad_jobs_and_settings_are_refused_naming_them() {
    let d = TempDir::new("bad");
    let err = |r: Result<Tier, kvoffload_disk::DiskError>| r.err().unwrap().to_string();
    let cfg = || DiskConfig::new(&d.0, CHUNK);
    assert!(err(Tier::open(cfg(), NS, FILE, 0)).contains("io_threads=0"));
    assert!(err(Tier::open(cfg(), NS, FILE - 1, 2)).contains("capacity_bytes="));
    let jobs = open(&d, 10, 2);
    let short = [0u8; 10];
    // SAFETY: refused before any I/O.
    let e = jobs
        .submit_store(vec![(key(1), unsafe {
            RawBuf::new(short.as_ptr(), short.len())
        })])
        .unwrap_err();
    assert!(e.to_string().contains("item 0 has 10 bytes"), "{e}");
    let mut one = vec![0u8; CHUNK + 8];
    let p = one.as_mut_ptr();
    // SAFETY: refused before any I/O (the two spans overlap).
    let overlapping = unsafe {
        vec![
            (key(1), RawBufMut::new(p, CHUNK)),
            (key(2), RawBufMut::new(p.add(8), CHUNK)),
        ]
    };
    let e = jobs.submit_load(overlapping).unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    assert_eq!(jobs.in_flight(), 0);
}

#[test]
fn a_second_close_returns_only_once_every_thread_has_stopped() {
    // The binding frees the lent buffers when close returns: two closers at once must both
    // wait for the I/O in flight.
    let d = TempDir::new("close");
    let jobs = open(&d, 1000, 2);
    let bufs: Vec<Vec<u8>> = (0..64).map(data).collect();
    // SAFETY: `bufs` outlives both closes, which end every job.
    let items = bufs
        .iter()
        .enumerate()
        .map(|(i, b)| (key(i as u32), unsafe { RawBuf::new(b.as_ptr(), b.len()) }))
        .collect();
    jobs.submit_store(items).unwrap();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                jobs.close();
                assert_eq!(jobs.in_flight(), 0, "close returned with I/O in flight");
            });
        }
    });
    // A job after close completes at once, failed.
    let id = jobs.submit_store(Vec::new()).unwrap();
    assert_eq!(wait(&jobs, id), Vec::<u8>::new());
}

#[test]
fn engines_sharing_a_directory_find_each_others_chunks_and_hold_the_capacity_together() {
    let d = TempDir::new("shared");
    let every = Some(Duration::from_millis(50));
    let a = open_with(&d, 4, 2, every);
    let b = open_with(&d, 4, 2, every);
    for i in 0..3 {
        assert_eq!(store(&a, &[i]), vec![OK]);
    }
    // B opened before A wrote: it finds A's chunks at its next rescan.
    let until = Instant::now() + Duration::from_secs(10);
    let ks: Vec<Vec<u8>> = (0..3).map(key).collect();
    let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
    while b.lookup_prefix(&refs) < 3 {
        assert!(Instant::now() < until, "B never found A's chunks");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (st, bufs) = load(&b, &[0, 1, 2]);
    assert_eq!(st, vec![OK; 3]);
    assert!(bufs[2] == data(2));
    // B writes three more: together past the capacity of 4 files, which both hold.
    for i in 10..13 {
        assert_eq!(store(&b, &[i]), vec![OK]);
    }
    std::thread::sleep(Duration::from_millis(300)); // a few rescans of both
    assert!(files_on_disk(&b) <= 4, "{} files", files_on_disk(&b));
}

#[test]
fn stores_past_max_store_bytes_in_flight_are_dropped_whole_never_queued() {
    let d = TempDir::new("backpressure");
    let mut cfg = DiskConfig::new(&d.0, CHUNK);
    cfg.rescan = None;
    cfg.max_store_bytes_in_flight = 2 * CHUNK as u64;
    let jobs = Tier::open(cfg, NS, 100 * FILE, 1).unwrap();
    // Three chunks cannot fit two chunks' worth: dropped at once, nothing written.
    assert_eq!(store(&jobs, &[0, 1, 2]), vec![DROPPED; 3]);
    assert_eq!(jobs.stores_dropped(), 3);
    assert_eq!(files_on_disk(&jobs), 0);
    // Two fit; once written, the room is back.
    assert_eq!(store(&jobs, &[0, 1]), vec![OK; 2]);
    assert_eq!(store(&jobs, &[2, 3]), vec![OK; 2]);
    // Loads are never dropped.
    assert_eq!(load(&jobs, &[0, 1, 2, 3]).0, vec![OK; 4]);
}

#[test]
fn a_lookup_handle_learns_of_writes_by_note_and_of_evictions_by_rescan() {
    let d = TempDir::new("lookup-handle");
    // A handle that only answers lookups (a scheduler's): it never evicts, and its writers'
    // handle holds the capacity of 2 files.
    let lookups = open_with(&d, 1 << 20, 1, Some(Duration::from_millis(50)));
    let writer = open(&d, 2, 2);
    for i in 0..2 {
        assert_eq!(store(&writer, &[i]), vec![OK]); // one at a time: 0 is the older
    }
    let ks: Vec<Vec<u8>> = (0..3).map(key).collect();
    let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
    lookups.note_present(&refs[..2]);
    // At once, not at the next rescan.
    assert_eq!(lookups.lookup_prefix(&refs), 2);
    // The writer evicts 0 for 2: the lookup handle's next rescan drops it.
    assert_eq!(store(&writer, &[2]), vec![OK]);
    let until = Instant::now() + Duration::from_secs(10);
    while lookups.lookup_prefix(&refs[..1]) == 1 {
        assert!(Instant::now() < until, "the evicted chunk was never pruned");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(lookups.lookup_prefix(&refs[1..]), 2);
    // A miss reported by another handle drops the chunk here at once, and a scan that still
    // lists its file takes it in again.
    lookups.note_missing(&refs[1..2]);
    assert_eq!(lookups.lookup_prefix(&refs[1..]), 0);
    let until = Instant::now() + Duration::from_secs(10);
    while lookups.lookup_prefix(&refs[1..]) < 2 {
        assert!(Instant::now() < until, "the listed chunk never came back");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(files_on_disk(&lookups), 2);
}

#[test]
fn a_failing_disk_trips_the_breaker_and_a_probe_brings_it_back() {
    let d = TempDir::new("breaker");
    let mut cfg = DiskConfig::new(&d.0, CHUNK);
    cfg.rescan = None;
    cfg.breaker_cooldown = Duration::from_millis(300);
    let jobs = Tier::open(cfg, NS, 100 * FILE, 1).unwrap(); // one thread: items in order
    assert_eq!(store(&jobs, &[0]), vec![OK]);
    // The tier's directory becomes a file: every write fails (ENOTDIR), a real I/O error.
    let dir = jobs.files().dir().to_path_buf();
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::write(&dir, b"not a directory").unwrap();
    assert_eq!(store(&jobs, &[1, 2, 3]), vec![FAILED; 3]);
    assert_eq!(jobs.state(), BreakerState::Down); // 3 in a row: the default
    assert!(jobs.last_error().unwrap().contains("the disk tier is down"));
    // Down: every item fails at once, with no I/O, and lookups miss.
    assert_eq!(store(&jobs, &[4, 5]), vec![FAILED; 2]);
    assert_eq!(load(&jobs, &[0]).0, vec![FAILED]);
    assert_eq!(jobs.files().stats().store_failures, 3);
    assert_eq!(jobs.denied(), 3);
    assert_eq!(jobs.lookup_prefix(&[&key(0)]), 0);
    // The disk is back: after the cool-down one item probes it, and the tier is up again.
    std::fs::remove_file(&dir).unwrap();
    std::thread::sleep(Duration::from_millis(350));
    assert_eq!(jobs.state(), BreakerState::HalfOpen);
    assert_eq!(store(&jobs, &[6]), vec![OK]);
    assert_eq!(jobs.state(), BreakerState::Up);
    assert_eq!(store(&jobs, &[7, 8]), vec![OK; 2]);
}

#[test]
fn missing_files_are_not_a_failing_disk() {
    let d = TempDir::new("not-faults");
    let jobs = open(&d, 100, 1);
    assert_eq!(load(&jobs, &[1, 2, 3, 4]).0, vec![MISSING; 4]);
    assert_eq!(jobs.state(), BreakerState::Up);
}

#[test]
fn a_handle_that_does_not_evict_files_forgets_chunks_past_its_capacity() {
    let d = TempDir::new("forget");
    let writer = open(&d, 100, 1);
    for i in 0..4 {
        assert_eq!(store(&writer, &[i]), vec![OK]);
    }
    let mut cfg = DiskConfig::new(&d.0, CHUNK);
    cfg.rescan = None;
    cfg.evict_files = false;
    let lookups = Tier::open(cfg, NS, 2 * FILE, 1).unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while !lookups.scanned() {
        assert!(Instant::now() < until, "the index was never rebuilt");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Its index holds 2 (the newest files); the writer's 4 files stay.
    assert_eq!(lookups.counts(), (2, 2));
    let ks: Vec<Vec<u8>> = (4..6).map(key).collect();
    let refs: Vec<&[u8]> = ks.iter().map(Vec::as_slice).collect();
    lookups.note_present(&refs);
    assert_eq!(lookups.counts(), (2, 4));
    assert_eq!(lookups.lookup_prefix(&refs), 2);
    assert_eq!(files_on_disk(&writer), 4);
}

#[test]
fn drain_returns_once_no_job_is_in_flight() {
    let d = TempDir::new("drain");
    let jobs = open(&d, 100, 2);
    let bufs: Vec<Vec<u8>> = (0..6).map(data).collect();
    let mut ids = Vec::new();
    for (i, b) in bufs.iter().enumerate() {
        // SAFETY: `bufs` outlives the jobs (drained below).
        let item = (key(i as u32), unsafe { RawBuf::new(b.as_ptr(), b.len()) });
        ids.push(jobs.submit_store(vec![item]).unwrap());
    }
    let mut done: Vec<u64> = jobs
        .drain(Duration::from_secs(30))
        .into_iter()
        .map(|c| c.job_id)
        .collect();
    done.sort_unstable();
    assert_eq!(done, ids);
    assert_eq!(jobs.in_flight(), 0);
    // Nothing in flight: at once, and empty.
    assert!(jobs.drain(Duration::from_secs(30)).is_empty());
}
