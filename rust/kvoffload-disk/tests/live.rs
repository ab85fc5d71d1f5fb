//! What running engines see, with the shipped defaults: a chunk another engine on the directory
//! just wrote (found by a probe, not at the next rescan ten seconds later), and a tier started on
//! a full filesystem or a read-only mount (mounted by the test), which serves what is there.

mod common;

use common::jobs::{data, key, load, open_cfg, store, wait, CHUNK, FILE, NS};
use common::mount::Mount;
use common::TempDir;
use kvoffload_disk::{BreakerState, DiskConfig, Tier, Writes};
use kvoffload_tier::buf::RawBuf;
use kvoffload_tier::status::{DROPPED, FAILED, OK};
use std::fs;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

fn keys(ids: impl IntoIterator<Item = u32>) -> Vec<Vec<u8>> {
    ids.into_iter().map(key).collect()
}

fn refs(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

/// Sends this step's probes and waits until they have been answered.
fn end_step(jobs: &Tier) {
    jobs.flush();
    let until = Instant::now() + Duration::from_secs(10);
    while jobs.probes_in_flight() > 0 {
        assert!(Instant::now() < until, "a probe was never answered");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn defaults(path: &Path) -> DiskConfig {
    DiskConfig::new(path, CHUNK)
}

#[test]
fn a_running_engine_finds_what_another_just_wrote_at_its_next_lookup() {
    let d = TempDir::new("live");
    let one = open_cfg(defaults(&d.0), 100, 2);
    let two = open_cfg(defaults(&d.0), 100, 2);
    assert_eq!(store(&one, &[0, 1, 2, 3, 4]), vec![OK; 5]);
    // Engine 2's index has not seen them (its rescan is 10 s away): the lookup asks the I/O
    // threads to look for the files and says "not yet"; the next step's lookup hits.
    let prompt = keys(0..7);
    assert_eq!(two.lookup(&refs(&prompt), "r1"), (0, true));
    assert_eq!(two.lookup(&refs(&prompt), "r1"), (0, true)); // asked again in the same step
    end_step(&two);
    assert_eq!(two.lookup(&refs(&prompt), "r1"), (5, false));
    let s = two.files().stats();
    // Five files found, the sixth absent: the seventh is never looked for.
    assert_eq!((s.probed, s.probe_hits), (6, 5));
    let (st, bufs) = load(&two, &[0, 1, 2, 3, 4]);
    assert_eq!(st, vec![OK; 5]);
    assert!((0..5).all(|i| bufs[i] == data(i as u32)));
    // The absent chunk is a miss without looking again, for another request too.
    assert_eq!(two.lookup(&refs(&prompt), "r2"), (5, false));
    end_step(&two);
    assert_eq!(two.files().stats().probed, 6);
    // Engine 1 writes it now: once the short negative cache (1 s) has passed, it is found.
    assert_eq!(store(&one, &[5]), vec![OK]);
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(two.lookup(&refs(&prompt), "r3"), (5, true));
    end_step(&two);
    assert_eq!(two.lookup(&refs(&prompt), "r3"), (6, false));
}

#[test]
fn probes_are_bounded_per_step_and_a_prompt_nobody_shares_costs_one_file_once() {
    let d = TempDir::new("flood");
    let jobs = open_cfg(defaults(&d.0), 100, 1);
    // 500 prompts of 8 chunks each, none on the disk, asked in one step.
    let prompts: Vec<Vec<Vec<u8>>> = (0..500).map(|p| keys(p * 8..p * 8 + 8)).collect();
    let ask = |p: usize| jobs.lookup(&refs(&prompts[p]), &format!("r{p}"));
    let waiting = (0..500).filter(|&p| ask(p).1).count();
    assert_eq!(waiting, 64); // probes_per_step: the rest answered by the index alone
    end_step(&jobs);
    // One file looked for per prompt: its first chunk's, absent.
    assert_eq!(jobs.files().stats().probed, 64);
    // The 64 are misses now without another look; the next step probes the next 64.
    assert!((0..64).all(|p| ask(p) == (0, false)));
    assert_eq!((64..500).filter(|&p| ask(p).1).count(), 64);
    end_step(&jobs);
    assert_eq!(jobs.files().stats().probed, 128);
}

#[test]
fn a_chunk_whose_load_failed_is_not_found_again_by_a_probe() {
    let d = TempDir::new("failed");
    let one = open_cfg(defaults(&d.0), 100, 1);
    let two = open_cfg(defaults(&d.0), 100, 1);
    assert_eq!(store(&one, &[7]), vec![OK]);
    // A load through another handle (a worker's) failed: the chunk stays a miss for a rescan's
    // interval, not offered again and failed again every step (vLLM's livelock guard).
    two.note_missing(&refs(&keys([7])));
    assert_eq!(two.lookup(&refs(&keys([7])), "r"), (0, false));
    assert_eq!(two.probes_in_flight(), 0);
    // Nor by a probe that starts before it and finds its file: it stops there.
    assert_eq!(store(&one, &[6]), vec![OK]);
    assert_eq!(two.lookup(&refs(&keys([6, 7])), "s"), (0, true));
    end_step(&two);
    assert_eq!(two.lookup(&refs(&keys([6, 7])), "s"), (1, false));
}

#[test]
fn a_chunk_written_after_a_probe_missed_it_is_found_once_forgotten() {
    // The scheduler's handle: its index forgets only what the workers report evicted.
    let d = TempDir::new("forgotten");
    let worker = open_cfg(defaults(&d.0), 100, 1);
    let lookups = open_cfg(defaults(&d.0), 100, 1);
    // A probe finds chunk 3 absent: a miss without looking again for a second.
    assert_eq!(lookups.lookup(&refs(&keys([3])), "r1"), (0, true));
    end_step(&lookups);
    assert_eq!(lookups.lookup(&refs(&keys([3])), "r1"), (0, false));
    // The worker writes it, and says so; then its copy is forgotten (as after an eviction
    // report) while the file is there. The probe's old verdict no longer holds: it is looked
    // for, and found, at once.
    assert_eq!(store(&worker, &[3]), vec![OK]);
    lookups.note_present(&refs(&keys([3])));
    assert_eq!(lookups.lookup(&refs(&keys([3])), "r2"), (1, false));
    lookups.forget(&refs(&keys([3])));
    assert_eq!(lookups.lookup(&refs(&keys([3])), "r3"), (0, true));
    end_step(&lookups);
    assert_eq!(lookups.lookup(&refs(&keys([3])), "r3"), (1, false));
}

/// Fills `dir`'s filesystem up with one file; returns its path.
fn fill(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("filler");
    let mut f = fs::File::create(&path).unwrap();
    let block = vec![0u8; 4096];
    while f.write_all(&block).is_ok() {}
    let _ = f.sync_all();
    path
}

#[test]
fn an_engine_starts_on_a_full_filesystem_serves_it_and_writes_again_once_there_is_room() {
    let d = TempDir::new("full-start");
    let Some(_mount) = Mount::tmpfs(&d.0, "1m") else {
        return;
    };
    let tier = d.0.join("tier");
    let first = open_cfg(defaults(&tier), 100, 2);
    assert_eq!(store(&first, &[0, 1, 2, 3]), vec![OK; 4]);
    first.close();
    let filler = fill(&d.0);
    // A restart on the full filesystem opens (the O_DIRECT probe reads a chunk's file) and
    // serves every chunk on it.
    let jobs = open_cfg(defaults(&tier), 100, 2);
    assert!(
        jobs.files().notes().is_empty(),
        "{:?}",
        jobs.files().notes()
    );
    assert_eq!(jobs.lookup(&refs(&keys(0..4)), "r"), (4, false));
    let (st, bufs) = load(&jobs, &[0, 1, 2, 3]);
    assert_eq!(st, vec![OK; 4]);
    assert!((0..4).all(|i| bufs[i] == data(i as u32)));
    // The first store finds it full; those after it are dropped without I/O; the disk is no
    // failing disk, and loads go on.
    assert_eq!(store(&jobs, &[10]), vec![FAILED]);
    assert_eq!(jobs.writes(), Writes::Full);
    assert_eq!(store(&jobs, &[11, 12]), vec![DROPPED; 2]);
    let s = jobs.files().stats();
    assert_eq!((s.stores_full, s.store_failures), (3, 1));
    assert_eq!(jobs.state(), BreakerState::Up);
    assert_eq!(load(&jobs, &[0]).0, vec![OK]);
    // Room again: the next store is written, at once (statvfs says so, no write is tried).
    fs::remove_file(&filler).unwrap();
    assert_eq!(store(&jobs, &[13]), vec![OK]);
    assert_eq!(jobs.writes(), Writes::Open);
    assert_eq!(load(&jobs, &[13]).1[0], data(13));
}

#[test]
fn a_filesystem_out_of_inodes_drops_stores_without_trying_them() {
    let d = TempDir::new("inodes");
    // Room for bytes, not for files: statvfs's free inodes tell.
    let Some(_mount) = Mount::tmpfs(&d.0, "8m,nr_inodes=24") else {
        return;
    };
    let jobs = open_cfg(defaults(&d.0.join("tier")), 100, 1);
    let mut first_full = None;
    for i in 0..40 {
        if store(&jobs, &[i]) != vec![OK] {
            first_full = Some(i);
            break;
        }
    }
    let first_full = first_full.expect("the filesystem never ran out of inodes");
    assert_eq!(jobs.writes(), Writes::Full);
    for i in 100..103 {
        assert_eq!(store(&jobs, &[i]), vec![DROPPED]);
    }
    let s = jobs.files().stats();
    assert_eq!((s.store_failures, s.stores_full), (1, 4));
    assert_eq!(s.stored_chunks, u64::from(first_full));
}

#[test]
fn an_empty_directory_on_a_full_filesystem_opens_and_learns_o_direct_at_its_first_file() {
    let d = TempDir::new("full-empty");
    let Some(_mount) = Mount::tmpfs(&d.0, "256k") else {
        return;
    };
    let filler = fill(&d.0);
    let jobs = open_cfg(defaults(&d.0.join("tier")), 100, 1);
    // Nothing to read, no room to write a probe: buffered until a file says, and said once.
    assert!(!jobs.files().direct());
    let notes = jobs.files().notes().join("; ");
    assert!(notes.contains("O_DIRECT is not known yet"), "{notes}");
    fs::remove_file(&filler).unwrap();
    assert_eq!(store(&jobs, &[1]), vec![OK]);
    // What a tier opened now, with room for its probe, finds out about this filesystem.
    let fs_takes_it = Tier::open(defaults(&d.0.join("probe")), NS, FILE, 1)
        .unwrap()
        .files()
        .direct();
    assert_eq!(jobs.files().direct(), fs_takes_it);
    assert_eq!(load(&jobs, &[1]).1[0], data(1));
}

/// A cache a writer filled with `ids`, mounted read-only beside it (fields drop in order: the
/// writer, then the mount, then the directory).
struct ReadOnlyCache {
    writer: Tier,
    ro: std::path::PathBuf,
    _mount: Mount,
    dir: TempDir,
}

fn read_only_cache(tag: &str, ids: &[u32]) -> Option<ReadOnlyCache> {
    let dir = TempDir::new(tag);
    let (src, ro) = (dir.0.join("src"), dir.0.join("ro"));
    fs::create_dir_all(&ro).unwrap();
    let writer = open_cfg(defaults(&src), 100, 2);
    assert_eq!(store(&writer, ids), vec![OK; ids.len()]);
    let mount = Mount::read_only(&src, &ro)?;
    Some(ReadOnlyCache {
        writer,
        ro,
        _mount: mount,
        dir,
    })
}

#[test]
fn a_read_only_mount_serves_reads_and_never_tries_writes_in_a_loop() {
    let Some(cache) = read_only_cache("ro", &[0, 1, 2]) else {
        return;
    };
    let jobs = open_cfg(defaults(&cache.ro), 100, 2);
    assert_eq!(jobs.lookup(&refs(&keys(0..3)), "r"), (3, false));
    let (st, bufs) = load(&jobs, &[0, 1, 2]);
    assert_eq!(st, vec![OK; 3]);
    assert!((0..3).all(|i| bufs[i] == data(i as u32)));
    // One store is tried (EROFS); every later one is dropped without I/O, for 30 s.
    assert_eq!(store(&jobs, &[5]), vec![FAILED]);
    assert_eq!(jobs.writes(), Writes::ReadOnly);
    for i in 6..16 {
        assert_eq!(store(&jobs, &[i]), vec![DROPPED]);
    }
    let s = jobs.files().stats();
    assert_eq!((s.store_failures, s.stores_read_only), (1, 11));
    assert_eq!(jobs.state(), BreakerState::Up);
    // A chunk another engine writes through a writable path is found by a probe.
    assert_eq!(store(&cache.writer, &[3]), vec![OK]);
    assert_eq!(jobs.lookup(&refs(&keys(0..4)), "s"), (3, true));
    end_step(&jobs);
    assert_eq!(jobs.lookup(&refs(&keys(0..4)), "s"), (4, false));
    assert_eq!(load(&jobs, &[3]).1[0], data(3));
}

#[test]
fn read_only_says_so_up_front_and_an_unwritable_empty_mount_opens() {
    let Some(cache) = read_only_cache("ro-config", &[0]) else {
        return;
    };
    let mut cfg = defaults(&cache.ro);
    cfg.read_only = true;
    let jobs = open_cfg(cfg, 100, 1);
    assert!(jobs.files().notes().is_empty());
    assert_eq!(jobs.writes(), Writes::ReadOnly);
    // Dropped at submit: not one write tried.
    let buf = data(1);
    // SAFETY: `buf` outlives the job (waited for below).
    let item = (key(1), unsafe { RawBuf::new(buf.as_ptr(), buf.len()) });
    let id = jobs.submit_store(vec![item]).unwrap();
    assert_eq!(wait(&jobs, id), vec![DROPPED]);
    let s = jobs.files().stats();
    assert_eq!((s.store_failures, s.stores_read_only), (0, 1));
    assert_eq!(load(&jobs, &[0]).1[0], data(0));
    // A read-only mount whose namespace directory was never made: it opens, empty.
    let empty_src = cache.dir.0.join("empty");
    let empty_ro = cache.dir.0.join("empty-ro");
    fs::create_dir_all(&empty_src).unwrap();
    fs::create_dir_all(&empty_ro).unwrap();
    let Some(_empty) = Mount::read_only(&empty_src, &empty_ro) else {
        return;
    };
    let jobs = open_cfg(defaults(&empty_ro), 100, 1);
    assert!(jobs.files().notes()[0].contains("cannot create"));
    assert_eq!(jobs.lookup(&refs(&keys([0])), "r"), (0, true));
    end_step(&jobs);
    assert_eq!(jobs.lookup(&refs(&keys([0])), "r"), (0, false));
}
