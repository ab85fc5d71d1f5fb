//! The index's upkeep: takes in what the directory holds (at open, then every `rescan`, what
//! other engines sharing it wrote), drops what they removed, and holds the capacity by evicting
//! the least recently used chunks (their files too, where this handle may remove them).

use crate::queue::Shared;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Removes the least recently used chunks until the index fits the capacity (their files too).
pub(crate) fn evict(sh: &Shared) {
    loop {
        let victim = {
            let mut ix = sh.index();
            if ix.len() <= sh.capacity_files {
                return;
            }
            ix.pop_oldest_idle()
        };
        let Some(key) = victim else { return };
        // A lookup-only handle forgets the chunk; its writers' handles remove the file.
        if !sh.evict_files {
            sh.evicted.fetch_add(1, Ordering::Relaxed);
        } else if sh.tier.remove(&key).is_ok() {
            sh.evicted.fetch_add(1, Ordering::Relaxed);
            if let Some(keys) = &sh.evicted_keys {
                keys.lock().unwrap_or_else(|p| p.into_inner()).push(key);
            }
        }
    }
}

/// Takes what the directory holds into the index, oldest file first, then holds the capacity;
/// then, every `rescan` while the tier is open, takes in the files other engines sharing the
/// directory wrote since (and holds the capacity over them too).
pub(crate) fn rebuild(sh: &Shared, rescan: Option<Duration>) {
    scan_into_index(sh, false);
    evict(sh);
    sh.scanned.store(true, Ordering::Release);
    let Some(every) = rescan else { return };
    loop {
        {
            let q = sh.lock();
            let q = sh
                .closed_cv
                .wait_timeout_while(q, every, |q| !q.closing)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if q.closing {
                return;
            }
        }
        scan_into_index(sh, true);
        evict(sh);
    }
}

fn scan_into_index(sh: &Shared, recent: bool) {
    let since = sh.index().begin_scan();
    if let Ok((mut found, complete)) = sh.tier.scan() {
        found.sort_by_key(|(_, modified)| *modified);
        // In batches, so lookups and I/O threads never wait long for the index.
        for batch in found.chunks(4096) {
            if sh.lock().closing {
                break;
            }
            let mut ix = sh.index();
            for (key, _) in batch {
                ix.add_scanned(key.clone(), since, recent);
            }
        }
        // Files gone since (another engine evicted them) are misses here too, not loads that
        // fail; only after a listing that saw every subdirectory.
        if complete && !sh.lock().closing {
            let listed: HashSet<Vec<u8>> = found.into_iter().map(|(key, _)| key).collect();
            let mut from = Some(0);
            while let Some(at) = from {
                from = sh.index().prune(&listed, since, at, 4096);
            }
        }
    }
    sh.index().scan_done(since);
}
