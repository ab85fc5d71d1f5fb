//! `LookupTable`: a Redis tier's existence verdicts, one per key, shared by every request that
//! asks for it (the contract of vLLM's `AsyncLookupManager`). A scheduler step asks about
//! thousands of keys; keeping the table here makes that one call per request, not one per key.
//!
//! A key asked for the first time is queued; `flush` sends the step's queue as one lookup job;
//! `apply` records its answers. Until then the key's verdict is unknown ("ask again"). A verdict
//! lives while some request that asked for it lives (or its check is in flight).
//!
//! A key whose load failed (`mark_miss`) is also a miss for every request that asks within
//! `NEGATIVE_TTL` after (a bounded negative cache): a chunk the tier claims but cannot deliver
//! must not make each new request promote it, fail and recompute.

use foldhash::fast::RandomState;
use kvoffload_tier::status::OK;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a key whose load failed stays a miss without being asked again.
pub const NEGATIVE_TTL: Duration = Duration::from_secs(30);
/// The most keys the negative cache holds; the oldest go first.
pub const NEGATIVE_CAPACITY: usize = 65_536;

// Keys are block hashes already: a fast hash of them is as good as SipHash, at a third the cost.
type Map<K, V> = HashMap<K, V, RandomState>;
type Set<K> = HashSet<K, RandomState>;
/// One allocation per key, shared by its verdict, the requests that asked and the batch.
type Key = Arc<[u8]>;
/// The keys of one lookup job (or of the next one), each with the generation of its verdict.
type Batch = Vec<(Key, u64)>;

struct Verdict {
    generation: u64,
    found: Option<bool>,
    in_flight: bool,
    requests: u32,
}

/// Keys whose load failed, each until its expiry; `order` is by expiry, as the TTL is fixed.
struct NegativeCache {
    ttl: Duration,
    capacity: usize,
    until: Map<Key, Instant>,
    order: VecDeque<(Key, Instant)>,
}

impl NegativeCache {
    fn insert(&mut self, key: Key, now: Instant) {
        let until = now + self.ttl;
        self.until.insert(key.clone(), until);
        self.order.push_back((key, until));
        while self.order.len() > self.capacity {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        if let Some((key, until)) = self.order.pop_front() {
            // A key marked again since is kept, under its later expiry.
            if self.until.get(&key) == Some(&until) {
                self.until.remove(&key);
            }
        }
    }

    /// Whether `key` is a known miss now; drops what has expired on the way.
    fn holds(&mut self, key: &[u8], now: Instant) -> bool {
        while self.order.front().is_some_and(|(_, until)| *until <= now) {
            self.pop_front();
        }
        self.until.contains_key(key)
    }
}

pub struct LookupTable {
    verdicts: Map<Key, Verdict>,
    requests: Map<String, Set<Key>>,
    batch: Batch,
    jobs: Map<u64, Batch>,
    generation: u64,
    negative: NegativeCache,
}

impl Default for LookupTable {
    fn default() -> Self {
        Self::with_negative_cache(NEGATIVE_TTL, NEGATIVE_CAPACITY)
    }
}

impl LookupTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// A table whose failed keys stay misses for `ttl`, at most `capacity` of them at a time.
    pub fn with_negative_cache(ttl: Duration, capacity: usize) -> Self {
        LookupTable {
            verdicts: Map::default(),
            requests: Map::default(),
            batch: Batch::new(),
            jobs: Map::default(),
            generation: 0,
            negative: NegativeCache {
                ttl,
                capacity,
                until: Map::default(),
                order: VecDeque::new(),
            },
        }
    }

    /// `key`'s verdict for `request`: found or not once answered, `None` while queued or in
    /// flight.
    pub fn lookup(&mut self, key: &[u8], request: &str) -> Option<bool> {
        self.prefix(&[key], request);
        self.verdicts.get(key).and_then(|v| v.found)
    }

    /// Looks `keys` up in order for `request`: the length of the leading run found, and whether
    /// an answer before the first known miss is still out. Every key up to that miss is asked
    /// for, so the rest of a prefix goes out in the same batch as its head.
    pub fn prefix(&mut self, keys: &[&[u8]], request: &str) -> (usize, bool) {
        if !self.requests.contains_key(request) {
            self.requests.insert(request.to_owned(), Set::default());
        }
        let asked = self.requests.get_mut(request).expect("inserted above");
        // A request's first ask registers its whole prefix: grow each table once, not per key.
        asked.reserve(keys.len());
        self.verdicts.reserve(keys.len());
        let (mut found, mut waiting) = (0, false);
        // Read once per call, and only while some key is in the negative cache.
        let now = (!self.negative.until.is_empty()).then(Instant::now);
        for key in keys {
            if !self.verdicts.contains_key(*key) {
                let generation = self.generation;
                self.generation += 1;
                let shared: Key = Arc::from(*key);
                let known_miss = now.is_some_and(|now| self.negative.holds(key, now));
                if !known_miss {
                    self.batch.push((shared.clone(), generation));
                }
                let verdict = Verdict {
                    generation,
                    found: known_miss.then_some(false),
                    in_flight: false,
                    requests: 0,
                };
                self.verdicts.insert(shared, verdict);
            }
            // A repeated ask (every step a request waits) allocates nothing.
            let first_ask = !asked.contains(*key);
            if first_ask {
                let (shared, _) = self.verdicts.get_key_value(*key).expect("inserted above");
                asked.insert(shared.clone());
            }
            let verdict = self.verdicts.get_mut(*key).expect("inserted above");
            verdict.requests += u32::from(first_ask);
            match verdict.found {
                Some(false) => break,
                None => waiting = true,
                Some(true) if !waiting => found += 1,
                Some(true) => {}
            }
        }
        (found, waiting)
    }

    /// Sends the keys queued since the last flush as one job (`submit` returns its id). When it
    /// cannot be sent (the tier closed), they are answered "not found" at once: a request never
    /// waits for an answer that will not come.
    pub fn flush<E>(&mut self, submit: impl FnOnce(Vec<Vec<u8>>) -> Result<u64, E>) {
        let batch = std::mem::take(&mut self.batch);
        let live: Batch = batch
            .into_iter()
            .filter(|(key, generation)| {
                self.verdicts
                    .get(key)
                    .is_some_and(|v| v.generation == *generation)
            })
            .collect();
        if live.is_empty() {
            return;
        }
        match submit(live.iter().map(|(k, _)| k.to_vec()).collect()) {
            Ok(job) => {
                for (key, _) in &live {
                    if let Some(v) = self.verdicts.get_mut(key) {
                        v.in_flight = true;
                    }
                }
                self.jobs.insert(job, live);
            }
            Err(_) => {
                for (key, _) in &live {
                    if let Some(v) = self.verdicts.get_mut(key) {
                        v.found = Some(false);
                    }
                }
            }
        }
    }

    /// Records the answers of lookup job `job` (one status per key; `OK` is found). Returns
    /// false for a job this table did not send.
    pub fn apply(&mut self, job: u64, statuses: &[u8]) -> bool {
        let Some(entries) = self.jobs.remove(&job) else {
            return false;
        };
        for ((key, generation), status) in entries.iter().zip(statuses) {
            let Some(v) = self.verdicts.get_mut(key) else {
                continue;
            };
            if v.generation != *generation {
                continue;
            }
            v.in_flight = false;
            if v.requests == 0 {
                self.verdicts.remove(key);
            } else {
                v.found = Some(*status == OK);
            }
        }
        true
    }

    /// Keys a load failed on count as missing until their requests finish (vLLM #49176: a
    /// verdict of "found" would promote them again and again), and for later requests until
    /// the negative cache's TTL has passed.
    pub fn mark_miss(&mut self, keys: &[&[u8]]) {
        let now = Instant::now();
        for key in keys {
            let shared = match self.verdicts.get_key_value(*key) {
                Some((shared, _)) => shared.clone(),
                None => Arc::from(*key),
            };
            if let Some(v) = self.verdicts.get_mut(*key) {
                if !v.in_flight && v.found.is_some() {
                    v.found = Some(false);
                }
            }
            self.negative.insert(shared, now);
        }
    }

    /// Keys in the negative cache, expired ones included until they are next pruned.
    #[cfg(test)]
    fn known_misses(&self) -> usize {
        self.negative.until.len()
    }

    /// Drops a finished request's interest; a check still in flight stays until it lands.
    pub fn cleanup(&mut self, request: &str) {
        for key in self.requests.remove(request).unwrap_or_default() {
            if let Some(v) = self.verdicts.get_mut(&key) {
                v.requests -= 1;
                if v.requests == 0 && !v.in_flight {
                    self.verdicts.remove(&key);
                }
            }
        }
    }

    /// Lookup jobs sent and not yet applied.
    pub fn in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// Keys with a verdict (known or not).
    pub fn len(&self) -> usize {
        self.verdicts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.verdicts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvoffload_tier::status::{FAILED, MISSING};

    fn sent(table: &mut LookupTable) -> (u64, Vec<Vec<u8>>) {
        let mut out = None;
        table.flush(|keys| {
            out = Some(keys);
            Ok::<u64, ()>(7)
        });
        (7, out.unwrap_or_default())
    }

    #[test]
    fn a_prefix_waits_then_counts_its_leading_hits() {
        let mut t = LookupTable::new();
        let keys: [&[u8]; 4] = [b"a", b"b", b"c", b"d"];
        assert_eq!(t.prefix(&keys, "r1"), (0, true));
        let (job, batch) = sent(&mut t);
        assert_eq!(
            batch,
            vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec(), b"d".to_vec()]
        );
        assert_eq!(t.prefix(&keys, "r1"), (0, true)); // in flight: nothing sent twice
        assert_eq!(sent(&mut t).1, Vec::<Vec<u8>>::new());
        assert!(t.apply(job, &[OK, OK, MISSING, OK]));
        assert_eq!(t.prefix(&keys, "r1"), (2, false));
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn verdicts_are_shared_and_live_while_a_request_does() {
        let mut t = LookupTable::new();
        t.prefix(&[b"a", b"b"], "r1");
        let (job, _) = sent(&mut t);
        t.apply(job, &[OK, FAILED]);
        assert_eq!(t.prefix(&[b"a", b"b"], "r2"), (1, false)); // no new job for r2
        assert!(t.batch.is_empty());
        t.cleanup("r1");
        assert_eq!(t.len(), 2); // r2 still holds both
        t.cleanup("r2");
        assert!(t.is_empty());
    }

    #[test]
    fn an_answer_for_a_finished_request_is_dropped() {
        let mut t = LookupTable::new();
        t.lookup(b"a", "r1");
        let (job, _) = sent(&mut t);
        t.cleanup("r1");
        assert_eq!(t.len(), 1); // in flight: kept until it lands
        t.apply(job, &[OK]);
        assert!(t.is_empty());
        // Asked again later: a new check.
        assert_eq!(t.lookup(b"a", "r2"), None);
        assert_eq!(sent(&mut t).1, vec![b"a".to_vec()]);
    }

    #[test]
    fn a_key_dropped_before_its_flush_is_not_sent() {
        let mut t = LookupTable::new();
        t.lookup(b"a", "r1");
        t.cleanup("r1");
        assert!(t.is_empty());
        let mut called = false;
        t.flush(|_| {
            called = true;
            Ok::<u64, ()>(1)
        });
        assert!(!called);
    }

    #[test]
    fn mark_miss_turns_known_hits_into_misses() {
        let mut t = LookupTable::new();
        t.prefix(&[b"a", b"b"], "r1");
        let (job, _) = sent(&mut t);
        t.apply(job, &[OK, OK]);
        t.mark_miss(&[b"b", b"zz"]);
        assert_eq!(t.prefix(&[b"a", b"b"], "r1"), (1, false));
    }

    #[test]
    fn a_failed_key_is_a_miss_for_later_requests_until_the_ttl() {
        let mut t = LookupTable::with_negative_cache(Duration::from_millis(200), 100);
        t.prefix(&[b"a", b"b", b"c"], "r1");
        let (job, _) = sent(&mut t);
        t.apply(job, &[OK, OK, OK]);
        t.mark_miss(&[b"b"]);
        t.cleanup("r1");
        assert!(t.is_empty());
        // A new request: "a" is asked again, "b" is a miss at once, so "c" is not reached.
        assert_eq!(t.prefix(&[b"a", b"b", b"c"], "r2"), (0, true));
        let (job, batch) = sent(&mut t);
        assert_eq!(batch, vec![b"a".to_vec()]);
        t.apply(job, &[OK]);
        t.cleanup("r2");
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(t.prefix(&[b"a", b"b"], "r3"), (0, true));
        assert_eq!(sent(&mut t).1, vec![b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(t.known_misses(), 0);
    }

    #[test]
    fn the_negative_cache_is_bounded_oldest_first() {
        let mut t = LookupTable::with_negative_cache(Duration::from_secs(60), 2);
        t.mark_miss(&[b"a", b"b", b"c"]);
        assert_eq!(t.known_misses(), 2);
        t.mark_miss(&[b"b"]); // marked again: its newer entry outlives the older one's pop
        t.mark_miss(&[b"d"]);
        assert_eq!(t.prefix(&[b"a"], "r"), (0, true)); // "a" went first: asked again
        assert_eq!(t.prefix(&[b"b"], "s"), (0, false));
        assert_eq!(t.prefix(&[b"d"], "s"), (0, false));
        assert_eq!(t.prefix(&[b"c"], "u"), (0, true));
    }

    #[test]
    fn a_job_that_cannot_be_sent_answers_not_found() {
        let mut t = LookupTable::new();
        t.prefix(&[b"a"], "r1");
        t.flush(|_| Err::<u64, &str>("closed"));
        assert_eq!(t.prefix(&[b"a"], "r1"), (0, false));
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn apply_of_an_unknown_job_changes_nothing() {
        let mut t = LookupTable::new();
        t.lookup(b"a", "r1");
        assert!(!t.apply(99, &[OK]));
        assert_eq!(t.lookup(b"a", "r1"), None);
    }
}
