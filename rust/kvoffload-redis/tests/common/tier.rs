//! Synchronous wrappers around the tier's job API, for tests.

use kvoffload_redis::{Completion, Config, RawBuf, RawBufMut, Tier};
use std::collections::HashMap;
use std::time::{Duration, Instant};

pub const NS: [u8; 16] = *b"namespace-digest";

pub fn config(url: &str, chunk: usize) -> Config {
    Config::new(url, chunk)
}

pub fn wait_jobs(t: &Tier, ids: &[u64]) -> HashMap<u64, Vec<u8>> {
    let mut got = HashMap::new();
    let start = Instant::now();
    while ids.iter().any(|id| !got.contains_key(id)) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "jobs {ids:?} never completed"
        );
        for Completion { job_id, statuses } in t.wait(Duration::from_millis(100)) {
            got.insert(job_id, statuses);
        }
    }
    got
}

pub fn wait_job(t: &Tier, id: u64) -> Vec<u8> {
    wait_jobs(t, &[id]).remove(&id).unwrap()
}

pub fn store(t: &Tier, keys: &[Vec<u8>], data: &[Vec<u8>]) -> Vec<u8> {
    let id = submit_store(t, keys, data);
    wait_job(t, id)
}

pub fn submit_store(t: &Tier, keys: &[Vec<u8>], data: &[Vec<u8>]) -> u64 {
    let items = keys
        .iter()
        .zip(data)
        // SAFETY: `data` outlives the job: every caller waits for its completion.
        .map(|(k, d)| (k.clone(), unsafe { RawBuf::new(d.as_ptr(), d.len()) }))
        .collect();
    t.submit_store(items).unwrap()
}

/// Submits a load into `bufs`; the caller must wait for the job before touching them.
pub fn submit_load(t: &Tier, keys: &[Vec<u8>], bufs: &mut [Vec<u8>]) -> u64 {
    let items = keys
        .iter()
        .zip(bufs.iter_mut())
        // SAFETY: the caller waits for the job before using or dropping `bufs`.
        .map(|(k, b)| {
            (k.clone(), unsafe {
                RawBufMut::new(b.as_mut_ptr(), b.len())
            })
        })
        .collect();
    t.submit_load(items).unwrap()
}

pub fn load(t: &Tier, keys: &[Vec<u8>]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut bufs = vec![vec![0u8; t.chunk_bytes()]; keys.len()];
    let id = submit_load(t, keys, &mut bufs);
    (wait_job(t, id), bufs)
}

pub fn lookup(t: &Tier, keys: &[Vec<u8>]) -> Vec<u8> {
    let id = t.submit_lookup(keys.to_vec()).unwrap();
    wait_job(t, id)
}

pub fn keys(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{prefix}-{i}").into_bytes())
        .collect()
}
