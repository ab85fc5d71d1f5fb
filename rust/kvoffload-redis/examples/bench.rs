//! Store and load throughput of 64 chunks of 2 MiB: `cargo run --release --example bench -- URL`.
//! Run it next to `redis-benchmark -t set,get -d 2097152 -n 200 -P 16 -q` for a baseline.

use kvoffload_redis::{Config, RawBuf, RawBufMut, Tier};
use std::time::{Duration, Instant};

fn wait(t: &Tier, id: u64) -> Vec<u8> {
    loop {
        if let Some(c) = t
            .wait(Duration::from_secs(10))
            .into_iter()
            .find(|c| c.job_id == id)
        {
            return c.statuses;
        }
    }
}

fn main() {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let (chunk, n, rounds) = (2 << 20, 64usize, 5);
    let tier = Tier::connect(Config::new(url, chunk), *b"bench-namespace!").expect("connect");
    let src: Vec<u8> = (0..chunk * n).map(|i| (i * 31 % 251) as u8).collect();
    let mut dst = vec![0u8; chunk * n];
    let gb = (chunk * n) as f64 / 1e9;
    let (mut best_store, mut best_load) = (0f64, 0f64);
    for round in 0..rounds {
        let keys: Vec<Vec<u8>> = (0..n)
            .map(|i| format!("bench-{round}-{i}").into_bytes())
            .collect();
        let items = keys
            .iter()
            .enumerate()
            // SAFETY: `src` outlives the job, which is waited for below.
            .map(|(i, k)| {
                (k.clone(), unsafe {
                    RawBuf::new(src[i * chunk..].as_ptr(), chunk)
                })
            })
            .collect();
        let t0 = Instant::now();
        let st = wait(&tier, tier.submit_store(items).unwrap());
        let store_s = t0.elapsed().as_secs_f64();
        assert!(st.iter().all(|&s| s == 0), "store {st:?}");
        let base = dst.as_mut_ptr();
        let items = keys
            .iter()
            .enumerate()
            // SAFETY: `dst` is untouched until the job completes.
            .map(|(i, k)| {
                (k.clone(), unsafe {
                    RawBufMut::new(base.add(i * chunk), chunk)
                })
            })
            .collect();
        let t0 = Instant::now();
        let st = wait(&tier, tier.submit_load(items).unwrap());
        let load_s = t0.elapsed().as_secs_f64();
        assert!(st.iter().all(|&s| s == 0), "load {st:?}");
        assert!(dst == src);
        best_store = best_store.max(gb / store_s);
        best_load = best_load.max(gb / load_s);
    }
    println!("64 x 2 MiB, one job each, best of {rounds}: store {best_store:.2} GB/s, load {best_load:.2} GB/s");
}
