//! `Tier` helpers: chunks of a known pattern, stored and loaded through jobs, waited for.

use super::TempDir;
use kvoffload_disk::{DiskConfig, Tier};
use kvoffload_tier::buf::{RawBuf, RawBufMut};
use std::time::{Duration, Instant};

pub const NS: [u8; 16] = *b"disk-jobs-tests!";
pub const CHUNK: usize = 64 * 1024;
/// One chunk's file: the 4 KiB header block and the payload.
pub const FILE: u64 = 4096 + CHUNK as u64;

pub fn key(i: u32) -> Vec<u8> {
    let mut k = vec![0xab; 32];
    k.extend_from_slice(&i.to_be_bytes());
    k
}

pub fn data(i: u32) -> Vec<u8> {
    (0..CHUNK)
        .map(|j| (j as u32).wrapping_mul(31).wrapping_add(i) as u8)
        .collect()
}

pub fn open(dir: &TempDir, chunks: u64, threads: usize) -> Tier {
    open_with(dir, chunks, threads, None)
}

pub fn open_with(dir: &TempDir, chunks: u64, threads: usize, rescan: Option<Duration>) -> Tier {
    let mut cfg = DiskConfig::new(&dir.0, CHUNK);
    cfg.rescan = rescan;
    open_cfg(cfg, chunks, threads)
}

/// Opens the tier and waits until its start-up scan has indexed the directory.
pub fn open_cfg(cfg: DiskConfig, chunks: u64, threads: usize) -> Tier {
    let jobs = Tier::open(cfg, NS, chunks * FILE, threads).unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while !jobs.scanned() {
        assert!(Instant::now() < until, "the index was never rebuilt");
        std::thread::sleep(Duration::from_millis(1));
    }
    jobs
}

pub fn wait(jobs: &Tier, id: u64) -> Vec<u8> {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        for c in jobs.wait(Duration::from_millis(100)) {
            if c.job_id == id {
                return c.statuses;
            }
        }
        assert!(Instant::now() < until, "job {id} never completed");
    }
}

pub fn store(jobs: &Tier, ids: &[u32]) -> Vec<u8> {
    let bufs: Vec<Vec<u8>> = ids.iter().map(|&i| data(i)).collect();
    // SAFETY: `bufs` outlives the job (waited for below).
    let items = ids
        .iter()
        .zip(&bufs)
        .map(|(&i, b)| (key(i), unsafe { RawBuf::new(b.as_ptr(), b.len()) }))
        .collect();
    let id = jobs.submit_store(items).unwrap();
    wait(jobs, id)
}

pub fn load(jobs: &Tier, ids: &[u32]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut bufs: Vec<Vec<u8>> = ids.iter().map(|_| vec![0u8; CHUNK]).collect();
    // SAFETY: as above; each buffer is its own allocation.
    let items = ids
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&i, b)| (key(i), unsafe { RawBufMut::new(b.as_mut_ptr(), b.len()) }))
        .collect();
    let id = jobs.submit_load(items).unwrap();
    let st = wait(jobs, id);
    (st, bufs)
}
