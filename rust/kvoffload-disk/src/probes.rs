//! Lookups past the index: a chunk another engine wrote since the last rescan is found by looking
//! for its file, on the I/O threads, never on the caller's (the scheduler's) thread. A lookup that
//! misses the index opens a probe of the rest of its keys and answers "not yet"; the probes of a
//! step go out together at `flush`, at most `per_step` of them; a probe looks for the files in
//! order until the first that is absent, which is then a miss for `miss_ttl` without looking
//! again, so a prompt nobody shares costs one file's lookup, once. A chunk whose load failed is a
//! miss for longer (`hold`): found again at once, it would be promoted and fail again every step.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// The keys of one probe, in order, in one buffer (a prompt's thousands of keys are one copy).
#[derive(Default)]
pub(crate) struct ProbeKeys {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl ProbeKeys {
    fn push(&mut self, key: &[u8]) {
        self.bytes.extend_from_slice(key);
        self.ends.push(self.bytes.len());
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn get(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.bytes[start..self.ends[i]]
    }

    pub fn iter(&self) -> impl Iterator<Item = &[u8]> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }
}

#[derive(Default)]
pub(crate) struct Probes {
    pub per_step: usize,
    pub miss_ttl: Duration,
    /// This step's probes, sent at `flush`.
    pending: Vec<ProbeKeys>,
    /// The requests that asked this step: the probe their later keys join (vLLM's tiering asks
    /// a prompt key by key), or None where they wait on another request's probe.
    asked: HashMap<String, Option<usize>>,
    /// The first key of every probe pending or in flight: a lookup that stops there waits.
    probing: HashSet<Vec<u8>>,
    /// Keys that are misses without looking, each until when.
    missing: HashMap<Vec<u8>, Instant>,
    /// `missing` is cleared of the past ones when it grows to this many.
    prune_at: usize,
    in_flight: usize,
}

/// What a lookup that missed the index gets.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A probe will answer: ask again next step.
    Wait,
    Miss,
}

impl Probes {
    pub fn new(per_step: usize, miss_ttl: Duration) -> Probes {
        Probes {
            per_step,
            miss_ttl,
            ..Probes::default()
        }
    }

    /// `rest` (non-empty) are the keys of `request`'s lookup from the first the index lacks.
    pub fn ask(&mut self, rest: &[&[u8]], request: &str, now: Instant) -> Verdict {
        if self.per_step == 0 {
            return Verdict::Miss;
        }
        if let Some(joined) = self.asked.get(request) {
            // Keys after one already waiting: they join its probe (or wait on another's).
            if let Some(i) = *joined {
                for key in rest {
                    self.pending[i].push(key);
                }
            }
            return Verdict::Wait;
        }
        let first = rest[0];
        if self.probing.contains(first) {
            self.asked.insert(request.to_owned(), None);
            return Verdict::Wait;
        }
        if self.missing.get(first).is_some_and(|&until| now < until) {
            return Verdict::Miss;
        }
        if self.pending.len() >= self.per_step {
            // Past this step's bound the index answers alone (as with no probes): a burst of
            // prompts is never held back a step for the files of all of them.
            return Verdict::Miss;
        }
        let mut keys = ProbeKeys::default();
        for key in rest {
            keys.push(key);
        }
        self.probing.insert(first.to_vec());
        self.asked
            .insert(request.to_owned(), Some(self.pending.len()));
        self.pending.push(keys);
        Verdict::Wait
    }

    /// This step's probes, to hand the I/O threads; the next step starts a new bound.
    pub fn flush(&mut self, now: Instant) -> Vec<ProbeKeys> {
        self.asked.clear();
        if self.missing.len() >= self.prune_at {
            self.missing.retain(|_, until| now < *until);
            self.prune_at = (2 * self.missing.len()).max(1024);
        }
        self.in_flight += self.pending.len();
        std::mem::take(&mut self.pending)
    }

    /// A probe ended: `absent` is the first key whose file it did not find, if any.
    pub fn done(&mut self, keys: &ProbeKeys, absent: Option<&[u8]>, now: Instant) {
        self.in_flight -= 1;
        self.probing.remove(keys.get(0));
        if let Some(key) = absent {
            self.miss(key, now + self.miss_ttl);
        }
    }

    /// `key` is a miss until `until` (a load of it failed), whatever a probe would find.
    pub fn miss(&mut self, key: &[u8], until: Instant) {
        let at = self.missing.entry(key.to_vec()).or_insert(until);
        *at = (*at).max(until);
    }

    /// Probes pending or in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight + self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(1);

    #[test]
    fn a_probe_is_opened_once_joined_by_later_keys_and_bounded_per_step() {
        let mut p = Probes::new(2, TTL);
        let t = Instant::now();
        assert_eq!(p.ask(&[b"a", b"b"], "r1", t), Verdict::Wait);
        // vLLM's tiering asks key by key: the next key joins the request's probe.
        assert_eq!(p.ask(&[b"c"], "r1", t), Verdict::Wait);
        // Another request stopping at the same key waits on that probe, and so do its later keys.
        assert_eq!(p.ask(&[b"a"], "r2", t), Verdict::Wait);
        assert_eq!(p.ask(&[b"z"], "r2", t), Verdict::Wait);
        assert_eq!(p.ask(&[b"x"], "r3", t), Verdict::Wait);
        // Two probes this step: the third request is answered by the index alone.
        assert_eq!(p.ask(&[b"y"], "r4", t), Verdict::Miss);
        let sent = p.flush(t);
        assert_eq!(sent.len(), 2);
        let keys: Vec<&[u8]> = sent[0].iter().collect();
        assert_eq!(keys, vec![&b"a"[..], b"b", b"c"]);
        assert_eq!(p.in_flight(), 2);
        // In flight: its first key waits, also in the next step.
        assert_eq!(p.ask(&[b"a"], "r5", t), Verdict::Wait);
        p.done(&sent[0], Some(b"b"), t);
        p.done(&sent[1], None, t);
        assert_eq!(p.in_flight(), 0);
        p.flush(t);
        // "b" was absent: a miss without looking again, until the TTL has passed.
        assert_eq!(p.ask(&[b"b", b"c"], "r6", t), Verdict::Miss);
        assert_eq!(p.ask(&[b"b"], "r7", t + TTL), Verdict::Wait);
    }

    #[test]
    fn a_failed_load_holds_its_miss_longer_and_zero_probes_means_none() {
        let mut p = Probes::new(4, TTL);
        let t = Instant::now();
        p.miss(b"k", t + 10 * TTL);
        // A probe's shorter miss never shortens it.
        p.miss(b"k", t + TTL);
        assert_eq!(p.ask(&[b"k"], "r", t + 5 * TTL), Verdict::Miss);
        assert_eq!(p.ask(&[b"k"], "r", t + 10 * TTL), Verdict::Wait);
        // Past ones are cleared once there are many.
        p.prune_at = 1;
        p.flush(t + 10 * TTL);
        assert!(p.missing.is_empty());
        let mut off = Probes::new(0, TTL);
        assert_eq!(off.ask(&[b"k"], "r", t), Verdict::Miss);
        assert!(off.flush(t).is_empty());
    }
}
