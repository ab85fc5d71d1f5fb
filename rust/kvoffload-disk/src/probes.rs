//! Lookups past the index: a chunk another engine wrote since the last rescan is found by looking
//! for its file, on the I/O threads, never on the caller's (the scheduler's) thread. A lookup that
//! misses the index opens a probe of the rest of its keys and answers "not yet"; the probes of a
//! step go out together at `flush`, at most `per_step` of them; a probe looks for the files in
//! order until the first that is absent, which is then a miss without looking again for
//! `miss_ttl`, and at least until a lookup has been told so (however long a step takes), so a
//! prompt nobody shares costs one file's lookup, once. A chunk whose load failed is a miss for
//! longer (`miss`): found again at once, it would be promoted and fail again every step. A probe
//! unanswered for `PATIENCE` (a hung mount) no longer holds lookups back: the index answers them,
//! and no more than twice `per_step` probes are ever out.

use std::collections::HashMap;
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

/// What a request did this step, for its later keys (vLLM's tiering asks a prompt key by key,
/// and goes on past a key that waits, to start the lookups of the rest).
#[derive(Clone, Copy)]
enum Asked {
    /// A key of it was in the index: a probe it opens takes its later keys (a shared prompt).
    Hit,
    /// Its probe (this step's `pending[i]`) takes its later keys.
    Collecting(usize),
    /// Its first key missed the index: that one file is looked for, and its later keys are
    /// misses this step (a prompt nobody shares costs one file, and vLLM's loop ends there).
    /// Found, the next step's probe takes the rest.
    Opened,
    /// It waits on another request's probe.
    Waiting,
}

#[derive(Default)]
pub(crate) struct Probes {
    pub per_step: usize,
    pub miss_ttl: Duration,
    /// This step's probes, sent at `flush`.
    pending: Vec<ProbeKeys>,
    asked: HashMap<String, Asked>,
    /// The first key of every probe pending or in flight, and when it was opened: a lookup that
    /// stops there waits (for `PATIENCE` at most).
    probing: HashMap<Vec<u8>, Instant>,
    /// Keys that are misses without looking, each until when, and whether a lookup has been
    /// answered so (until then it stays, whatever the time).
    missing: HashMap<Vec<u8>, Miss>,
    /// `missing` is cleared of the past ones when it grows to this many.
    prune_at: usize,
    in_flight: usize,
}

#[derive(Clone, Copy)]
struct Miss {
    until: Instant,
    told: bool,
}

/// How long lookups wait on a probe before the index answers them alone (a mount that hangs).
pub(crate) const PATIENCE: Duration = Duration::from_secs(1);
/// A miss nobody was told of is forgotten after this long (its request went away).
const UNTOLD_KEPT: Duration = Duration::from_secs(60);

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

    /// A key of `request` was in the index (asked key by key).
    pub fn hit(&mut self, request: &str) {
        if !self.asked.contains_key(request) {
            self.asked.insert(request.to_owned(), Asked::Hit);
        }
    }

    /// `rest` (non-empty) are the keys of `request`'s lookup from the first the index lacks:
    /// the rest of its prompt, or (`by_key`) the one key asked.
    pub fn ask(&mut self, rest: &[&[u8]], request: &str, by_key: bool, now: Instant) -> Verdict {
        let before = self.asked.get(request).copied();
        match before {
            // Key by key, the next key joins; the rest of a prompt was given whole already.
            Some(Asked::Collecting(i)) => {
                if by_key {
                    self.pending[i].push(rest[0]);
                }
                return Verdict::Wait;
            }
            Some(Asked::Opened | Asked::Waiting) if by_key => return Verdict::Miss,
            Some(Asked::Opened | Asked::Waiting) => return Verdict::Wait,
            Some(Asked::Hit) | None => {}
        }
        let first = rest[0];
        if let Some(&opened) = self.probing.get(first) {
            if now.duration_since(opened) >= PATIENCE {
                return Verdict::Miss;
            }
            self.asked.insert(request.to_owned(), Asked::Waiting);
            return Verdict::Wait;
        }
        if let Some(miss) = self.missing.get_mut(first) {
            if now < miss.until || !miss.told {
                miss.told = true;
                return Verdict::Miss;
            }
        }
        if self.pending.len() >= self.per_step || self.in_flight() >= 2 * self.per_step {
            // Past this step's bound the index answers alone (as with no probes): a burst of
            // prompts is never held back a step for the files of all of them, nor a slow mount
            // given more than it can answer.
            return Verdict::Miss;
        }
        let mut keys = ProbeKeys::default();
        for key in rest {
            keys.push(key);
        }
        self.probing.insert(first.to_vec(), now);
        let collect = !by_key || matches!(before, Some(Asked::Hit));
        let asked = if collect {
            Asked::Collecting(self.pending.len())
        } else {
            Asked::Opened
        };
        self.asked.insert(request.to_owned(), asked);
        self.pending.push(keys);
        Verdict::Wait
    }

    /// This step's probes, to hand the I/O threads; the next step starts a new bound.
    pub fn flush(&mut self, now: Instant) -> Vec<ProbeKeys> {
        self.asked.clear();
        if self.missing.len() >= self.prune_at {
            self.missing.retain(|_, m| {
                now < m.until || (!m.told && now.duration_since(m.until) < UNTOLD_KEPT)
            });
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
        let m = self
            .missing
            .entry(key.to_vec())
            .or_insert(Miss { until, told: false });
        m.until = m.until.max(until);
        m.told = false;
    }

    /// `keys` are there now (written through another handle): no verdict holds them.
    pub fn clear_verdicts(&mut self, keys: &[&[u8]]) {
        if self.missing.is_empty() {
            return;
        }
        for key in keys {
            self.missing.remove(*key);
        }
    }

    /// How many of `keys`, from the first, are not held as misses now (a probe that found the
    /// files of held ones must not bring them back).
    pub fn unheld(&self, keys: &ProbeKeys, now: Instant) -> usize {
        keys.iter()
            .take_while(|k| !self.missing.get(*k).is_some_and(|m| now < m.until))
            .count()
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
        assert_eq!(p.ask(&[b"a", b"b"], "r1", false, t), Verdict::Wait);
        // Asked again in the step with the rest of its prompt: it waits on its probe, which
        // has those keys already.
        assert_eq!(p.ask(&[b"b"], "r1", false, t), Verdict::Wait);
        // Another request stopping at the same key waits on that probe.
        assert_eq!(p.ask(&[b"a"], "r2", false, t), Verdict::Wait);
        assert_eq!(p.ask(&[b"x"], "r3", false, t), Verdict::Wait);
        // Two probes this step: the third request is answered by the index alone.
        assert_eq!(p.ask(&[b"y"], "r4", false, t), Verdict::Miss);
        let sent = p.flush(t);
        assert_eq!(sent.len(), 2);
        let keys: Vec<&[u8]> = sent[0].iter().collect();
        assert_eq!(keys, vec![&b"a"[..], b"b"]);
        assert_eq!(p.in_flight(), 2);
        // In flight: its first key waits, also in the next step.
        assert_eq!(p.ask(&[b"a"], "r5", false, t), Verdict::Wait);
        p.done(&sent[0], Some(b"b"), t);
        p.done(&sent[1], None, t);
        assert_eq!(p.in_flight(), 0);
        p.flush(t);
        // "b" was absent: a miss without looking again, until the TTL has passed.
        assert_eq!(p.ask(&[b"b", b"c"], "r6", false, t), Verdict::Miss);
        assert_eq!(p.ask(&[b"b"], "r7", false, t + TTL), Verdict::Wait);
    }

    #[test]
    fn a_miss_is_told_at_least_once_however_long_a_step_takes() {
        // A step longer than the TTL (or a TTL of 0): the probe's answer still reaches the
        // lookup that asks next, which would otherwise open a probe and wait every step.
        for ttl in [Duration::ZERO, TTL] {
            let mut p = Probes::new(4, ttl);
            let t = Instant::now();
            assert_eq!(p.ask(&[b"k"], "r", false, t), Verdict::Wait);
            let sent = p.flush(t);
            p.done(&sent[0], Some(b"k"), t);
            let later = t + 10 * TTL;
            p.flush(later);
            assert_eq!(p.ask(&[b"k"], "r", false, later), Verdict::Miss);
            // Told once: the next ask past the TTL looks again.
            assert_eq!(p.ask(&[b"k"], "s", false, later), Verdict::Wait);
        }
    }

    #[test]
    fn a_probe_that_hangs_stops_holding_lookups_back_and_probes_out_are_bounded() {
        let mut p = Probes::new(2, TTL);
        let t = Instant::now();
        assert_eq!(p.ask(&[b"a"], "r1", false, t), Verdict::Wait);
        assert_eq!(p.ask(&[b"b"], "r2", false, t), Verdict::Wait);
        p.flush(t);
        assert_eq!(p.ask(&[b"c"], "r3", false, t), Verdict::Wait);
        assert_eq!(p.ask(&[b"d"], "r4", false, t), Verdict::Wait);
        p.flush(t);
        // Four out (twice the step's bound) and none answered: no more are opened.
        assert_eq!(p.ask(&[b"e"], "r5", false, t), Verdict::Miss);
        // Waiting on one unanswered for PATIENCE: the index answers.
        assert_eq!(p.ask(&[b"a"], "r6", false, t), Verdict::Wait);
        p.flush(t);
        assert_eq!(p.ask(&[b"a"], "r6", false, t + PATIENCE), Verdict::Miss);
    }

    #[test]
    fn key_by_key_a_prompt_with_no_hit_probes_one_file_and_one_with_hits_the_rest() {
        let mut p = Probes::new(8, TTL);
        let t = Instant::now();
        // No key of r1 in the index: its first file is looked for, its later keys are misses
        // this step (vLLM's loop ends there, one file is the cost).
        assert_eq!(p.ask(&[b"a"], "r1", true, t), Verdict::Wait);
        assert_eq!(p.ask(&[b"b"], "r1", true, t), Verdict::Miss);
        // r2 had a hit: its probe takes every later key.
        p.hit("r2");
        assert_eq!(p.ask(&[b"m"], "r2", true, t), Verdict::Wait);
        assert_eq!(p.ask(&[b"n"], "r2", true, t), Verdict::Wait);
        // r3 waits on r1's probe: its later keys are misses this step.
        assert_eq!(p.ask(&[b"a"], "r3", true, t), Verdict::Wait);
        assert_eq!(p.ask(&[b"z"], "r3", true, t), Verdict::Miss);
        let sent = p.flush(t);
        let lens: Vec<usize> = sent.iter().map(ProbeKeys::len).collect();
        assert_eq!(lens, vec![1, 2]);
        // A key held (its load failed) cuts what a probe found there.
        p.miss(b"n", t + TTL);
        assert_eq!(p.unheld(&sent[1], t), 1);
        assert_eq!(p.unheld(&sent[1], t + TTL), 2);
    }

    #[test]
    fn a_failed_load_holds_its_miss_longer_and_zero_probes_means_none() {
        let mut p = Probes::new(4, TTL);
        let t = Instant::now();
        p.miss(b"k", t + 10 * TTL);
        // A probe's shorter miss never shortens it.
        p.miss(b"k", t + TTL);
        assert_eq!(p.ask(&[b"k"], "r", false, t + 5 * TTL), Verdict::Miss);
        assert_eq!(p.ask(&[b"k"], "r", false, t + 10 * TTL), Verdict::Wait);
        // Past ones are cleared once there are many.
        p.prune_at = 1;
        p.flush(t + 10 * TTL);
        assert!(p.missing.is_empty());
        let mut off = Probes::new(0, TTL);
        assert_eq!(off.ask(&[b"k"], "r", false, t), Verdict::Miss);
        assert!(off.flush(t).is_empty());
    }
}
