//! A hybrid model's lookup across its KV-cache groups, as vLLM 0.33's `OffloadingConnector`
//! decides it (`_lookup_complete_chunks`, `_sliding_window_lookup`): full-attention groups
//! first, then window groups by window size, each window group hit only through the chunks its
//! attention reads before the boundary, until the hit converges. One call per request, where a
//! Python loop over groups and store calls cost more than the store's own work.

use crate::chunk::{clamp_to_keys, floor_chunk, load_cap};
use crate::error::{Error, Result};
use crate::keybuf::KeyBuf;
use crate::store::{KeyStatus, Store};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    Full,
    Sliding,
    ChunkedLocal,
    Mamba,
}

/// A group's rule: which of its chunks a hit reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupRule {
    pub kind: GroupKind,
    /// Chunks a hit needs before its boundary; `None`: the whole prefix (full attention).
    pub window_chunks: Option<u64>,
    /// A sliding group's window in tokens, itself included.
    pub window: u64,
    pub extra_retained_tokens: u64,
    /// The draft model's group (EAGLE/MTP): its last chunk is volatile.
    pub eagle: bool,
}

impl GroupRule {
    /// Chunks a hit ending at `num_tokens` loads: a sliding group's allocation keeps the window
    /// ending at the hit, which may reach one chunk further left than the lookup's.
    pub fn load_window_chunks(&self, num_tokens: u64, tpc: u64) -> Option<u64> {
        let window = self.window_chunks?;
        if self.kind != GroupKind::Sliding || tpc == 0 {
            return Some(window);
        }
        let padding = (tpc - num_tokens % tpc) % tpc;
        let reach = self
            .window
            .saturating_add(self.extra_retained_tokens)
            .saturating_add(padding)
            .saturating_sub(1);
        Some(window.max(reach.div_ceil(tpc)))
    }
}

/// One group of a request, as the lookup sees it.
#[derive(Debug, Clone, Copy)]
pub struct LookupGroup<'a> {
    /// The request's chunk keys of this group, from chunk 0.
    pub keys: &'a KeyBuf,
    pub rule: GroupRule,
}

impl LookupGroup<'_> {
    fn slices(&self, start: u64, end: u64) -> Result<Vec<&[u8]>> {
        if start > end || end > self.keys.len() as u64 {
            return Err(Error::InvalidArgument {
                name: "keys",
                value: format!("<{} keys, chunks {start}..{end} asked>", self.keys.len()),
                allowed: "chunks the group has keys for",
            });
        }
        Ok(self.keys.slices(start as usize, end as usize))
    }
}

/// What a lookup asks of one request.
#[derive(Debug, Clone, Copy)]
pub struct LookupAsk {
    /// Tokens the engine has cached locally (a multiple of the block size).
    pub num_local: u64,
    pub num_tokens: u64,
    pub max_load_tokens: Option<u64>,
    /// Whether any load is in flight (a hit on a chunk being loaded waits for it).
    pub loads_in_flight: bool,
}

/// Tokens past `num_local` every group can load (0, or at least a chunk of `tpc` tokens), or
/// `None`: a chunk needed is being stored or loaded (ask again).
pub fn lookup_groups(
    store: &mut Store,
    groups: &[LookupGroup<'_>],
    tpc: u64,
    ask: LookupAsk,
) -> Result<Option<u64>> {
    if tpc == 0 {
        return Err(Error::InvalidArgument {
            name: "tokens_per_chunk",
            value: "0".into(),
            allowed: ">= 1",
        });
    }
    let full = (0..groups.len()).filter(|&g| groups[g].rule.window_chunks.is_none());
    let mut windowed: Vec<usize> = (0..groups.len())
        .filter(|&g| groups[g].rule.window_chunks.is_some())
        .collect();
    // Larger windows first (a stable sort: ties keep the group order).
    windowed.sort_by_key(|&g| std::cmp::Reverse(groups[g].rule.window_chunks));
    let order: Vec<usize> = full.chain(windowed.iter().copied()).collect();

    // Signed and wide: a cap past the prompt, or the step back of one token, may go below 0.
    let tpc_i = i128::from(tpc);
    let num_local = i128::from(ask.num_local);
    let capped = ask.max_load_tokens.is_some();
    let mut max_hit = load_cap(ask.num_tokens, ask.num_local, ask.max_load_tokens);
    if !windowed.is_empty() {
        // The last prompt token is recomputed for its logits: keep a hit after that.
        max_hit -= 1;
        if groups.iter().any(|g| g.rule.kind == GroupKind::Mamba) {
            // A state is stored only on a chunk boundary.
            max_hit = floor_chunk(max_hit, tpc);
        }
    }
    let start = ask.num_local / tpc;
    let mut num_hit: i128 = 0;
    let mut deferred = false;
    let mut eagle_verified = vec![false; groups.len()];
    let mut pending: &[usize] = &order;
    while !pending.is_empty() {
        let mut looked_up_window = false;
        let current = std::mem::take(&mut pending);
        for &gi in current {
            let group = &groups[gi];
            let num_keys = group.keys.len() as i128;
            let unverified = group.rule.eagle && !eagle_verified[gi];
            max_hit = clamp_to_keys(max_hit, group.keys.len() as u64, tpc, capped);
            if max_hit - num_local < tpc_i {
                return Ok(Some(0));
            }
            // An EAGLE group's last chunk is volatile: one more is asked and dropped.
            let query_max = if unverified {
                (max_hit + tpc_i).min(num_keys * tpc_i)
            } else {
                max_hit
            };
            // Positive here (max_hit >= num_local + tpc), and at most the keys' tokens.
            let end = (query_max + tpc_i - 1).div_euclid(tpc_i).min(num_keys) as u64;
            let extra = u64::from(unverified);
            let hits = match group.rule.window_chunks {
                None => {
                    // Stops at the first key not ready: one being stored defers.
                    let (found, waiting) = store.lookup_prefix(&group.slices(start, end)?)?;
                    (!waiting).then_some(found as u64)
                }
                Some(window) => {
                    // At most num_tokens: fits.
                    let candidate = max_hit.min(i128::from(end - extra) * tpc_i) as u64;
                    let first = group
                        .rule
                        .load_window_chunks(candidate, tpc)
                        .expect("a window group has a window");
                    window_lookup(store, group, start, end, window + extra, first + extra)?
                }
            };
            match hits {
                Some(0) => return Ok(Some(0)),
                None => deferred = true,
                Some(mut h) => {
                    if unverified {
                        h -= 1;
                        eagle_verified[gi] = true;
                    }
                    max_hit = max_hit.min(tpc_i * i128::from(start + h));
                }
            }
            let new_hit = max_hit - num_local;
            if new_hit < tpc_i {
                return Ok(Some(0));
            }
            if new_hit < num_hit {
                if !group.rule.eagle {
                    eagle_verified.fill(false);
                }
                if deferred {
                    // Another pass over every group: it may not need to wait any more.
                    deferred = false;
                    pending = &order;
                } else if looked_up_window && pending.is_empty() {
                    // The window groups already asked must hold at the new boundary too.
                    pending = &windowed;
                }
            }
            looked_up_window |= group.rule.window_chunks.is_some();
            num_hit = new_hit;
        }
    }
    if deferred {
        return Ok(None);
    }
    let num_hit = num_hit as u64;
    if ask.loads_in_flight && any_being_loaded(store, groups, ask.num_local, num_hit, tpc)? {
        // They become GPU prefix-cache hits once that load lands (as vLLM waits).
        return Ok(None);
    }
    Ok(Some(num_hit))
}

/// A window group's hit over keys `start..end` (relative to `start`), asking only the last
/// `first` when all are ready (the usual answer).
fn window_lookup(
    store: &mut Store,
    group: &LookupGroup<'_>,
    start: u64,
    end: u64,
    window: u64,
    first: u64,
) -> Result<Option<u64>> {
    if end - start >= first {
        let (found, _) = store.lookup_prefix(&group.slices(end - first, end)?)?;
        if found as u64 == first {
            return Ok(Some(end - start));
        }
    }
    let status = store.lookup(&group.slices(start, end)?)?;
    Ok(window_hits(&status, window as usize, first as usize).map(|h| h as u64))
}

/// The end of the last run of `window` present keys, scanning from the end; the run that
/// reaches the end needs `first_window` (a partial rightmost chunk). With no such run, the
/// length of the run that starts at key 0 (0 when key 0 is absent). `None`: the run found has
/// a key being stored. (vLLM's `_sliding_window_lookup`.)
pub fn window_hits(status: &[KeyStatus], window: usize, first_window: usize) -> Option<usize> {
    let waiting = |run: &[KeyStatus]| run.contains(&KeyStatus::Pending);
    let mut end = status.len();
    let mut need = first_window;
    loop {
        let start = status[..end]
            .iter()
            .rposition(|&s| s == KeyStatus::Absent)
            .map_or(0, |absent| absent + 1);
        if end - start >= need {
            return (!waiting(&status[end - need..end])).then_some(end);
        }
        if start == 0 {
            return (!waiting(&status[..end])).then_some(end);
        }
        end = start - 1;
        need = window;
    }
}

fn any_being_loaded(
    store: &Store,
    groups: &[LookupGroup<'_>],
    num_local: u64,
    num_hit: u64,
    tpc: u64,
) -> Result<bool> {
    let end_tokens = num_local + num_hit;
    let (start, end) = (num_local / tpc, end_tokens.div_ceil(tpc));
    for group in groups {
        let first = match group.rule.load_window_chunks(end_tokens, tpc) {
            Some(window) => start.max(end.saturating_sub(window)),
            None => start,
        };
        if end > first && (store.first_pinned(&group.slices(first, end)?)? as u64) < end - first {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use KeyStatus::{Absent as A, Pending as P, Ready as R};

    #[test]
    fn window_hits_scans_runs_from_the_end() {
        assert_eq!(window_hits(&[R, R, R, R], 2, 3), Some(4));
        // The run at the end is too short for the first window: the next one counts.
        assert_eq!(window_hits(&[R, R, A, R, R, A, R], 2, 2), Some(5));
        // No run long enough: the run from key 0.
        assert_eq!(window_hits(&[R, A, R, A, R], 2, 2), Some(1));
        assert_eq!(window_hits(&[A, R, A, R], 2, 2), Some(0));
        assert_eq!(window_hits(&[R, R, P, R, R], 2, 3), None);
        assert_eq!(window_hits(&[P, R, R, R], 2, 2), Some(4));
        assert_eq!(window_hits(&[], 2, 2), Some(0));
    }

    fn keys(group: u8, n: u8) -> KeyBuf {
        let keys: Vec<[u8; 2]> = (0..n).map(|c| [group, c]).collect();
        KeyBuf::from_keys(&keys).unwrap()
    }

    fn stored(store: &mut Store, keys: &KeyBuf, chunks: std::ops::Range<usize>) {
        let k = keys.slices(chunks.start, chunks.end);
        store.prepare_store(&k).unwrap().unwrap();
        store.complete_store(&k, true).unwrap();
    }

    fn rule(kind: GroupKind, window: u64, tpc: u64) -> GroupRule {
        GroupRule {
            kind,
            window_chunks: (kind != GroupKind::Full).then(|| window.div_ceil(tpc)),
            window,
            extra_retained_tokens: 0,
            eagle: false,
        }
    }

    fn group(keys: &KeyBuf, kind: GroupKind, window: u64, tpc: u64) -> LookupGroup<'_> {
        LookupGroup {
            keys,
            rule: rule(kind, window, tpc),
        }
    }

    fn ask(num_tokens: u64, max_load_tokens: Option<u64>) -> LookupAsk {
        LookupAsk {
            num_local: 0,
            num_tokens,
            max_load_tokens,
            loads_in_flight: false,
        }
    }

    #[test]
    fn a_sliding_group_is_hit_through_its_window_only() {
        // 16-token chunks, a 60-token prompt with a 20-token window: 3 full chunks, the
        // sliding group stored only in chunks 1 and 2.
        let mut store = Store::new(64, crate::PolicyKind::Lru, false).unwrap();
        let (sliding, full) = (keys(0, 3), keys(1, 3));
        stored(&mut store, &full, 0..3);
        stored(&mut store, &sliding, 1..3);
        let groups = [
            group(&sliding, GroupKind::Sliding, 20, 16),
            group(&full, GroupKind::Full, 0, 16),
        ];
        assert_eq!(
            lookup_groups(&mut store, &groups, 16, ask(60, None)),
            Ok(Some(48))
        );
        // A cap: 47 loadable tokens round down to 2 chunks, whose window (chunks 0..2) misses
        // chunk 0 of the sliding group, so the hit shrinks to the run from chunk 0: none.
        assert_eq!(
            lookup_groups(&mut store, &groups, 16, ask(60, Some(47))),
            Ok(Some(0))
        );
        assert_eq!(
            lookup_groups(&mut store, &groups, 16, ask(60, Some(49))),
            Ok(Some(48))
        );
        // A prompt of exactly the 3 chunks: the hit stops a token short of it, inside chunk 2.
        assert_eq!(
            lookup_groups(&mut store, &groups, 16, ask(48, None)),
            Ok(Some(47))
        );
        // Being stored defers.
        let more = keys(1, 4);
        let pending = more.slices(3, 4);
        store.prepare_store(&pending).unwrap().unwrap();
        let groups = [group(&more, GroupKind::Full, 0, 16)];
        assert_eq!(
            lookup_groups(&mut store, &groups, 16, ask(64, None)),
            Ok(None)
        );
        assert!(lookup_groups(&mut store, &groups, 0, ask(64, None)).is_err());
    }

    #[test]
    fn chunks_near_the_integer_limit_do_not_wrap() {
        let mut store = Store::new(8, crate::PolicyKind::Lru, false).unwrap();
        let full = keys(1, 3);
        stored(&mut store, &full, 0..3);
        let tpc = 1u64 << 63;
        // An EAGLE group asks one chunk past a hit of u64::MAX tokens.
        let eagle = LookupGroup {
            keys: &full,
            rule: GroupRule {
                eagle: true,
                ..rule(GroupKind::Full, 0, tpc)
            },
        };
        let hit = lookup_groups(&mut store, &[eagle], tpc, ask(u64::MAX, None));
        assert_eq!(hit, Ok(Some(u64::MAX)));
        let sliding = GroupRule {
            window: u64::MAX,
            extra_retained_tokens: u64::MAX,
            ..rule(GroupKind::Sliding, 1, 16)
        };
        assert_eq!(
            sliding.load_window_chunks(1, 16),
            Some(u64::MAX.div_ceil(16))
        );
    }
}
