//! Eviction order: which ready, unpinned keys leave first when `prepare_store` needs room.
//!
//! `Lru` keeps one recency list. `Arc` keeps T1 (seen once) and T2 (seen again) plus ghost lists
//! B1/B2 of recently evicted keys that steer an adaptive target size for T1. Ghosts remember only
//! a 63-bit fingerprint of the key: a collision merely nudges the target, never serves data.
//!
//! ARC is the published algorithm (Megiddo & Modha, FAST 2003): a call's ghost hits adapt the
//! target before its victims are chosen (REPLACE, with the tie rule for B2 hits), and after its
//! keys are in, |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c hold again (c = slots). For
//! one key per call it makes exactly the paper's decisions (a test replays a reference model);
//! a batch is handled as its keys in turn would be, approximately. Ghosts also never exceed c,
//! even when failed stores leave the cache below c.

mod arc;
mod lru;
mod sampled;

use crate::error::{Error, Result};
use crate::list::{Linked, List};
use arc::Ghosts;
use core::str::FromStr;
pub use lru::Rank;
use lru::Ranked;
pub use sampled::SampledLru;

pub const POLICY_NAMES: &[&str] = &["lru", "arc"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    Lru,
    Arc,
}

impl FromStr for PolicyKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "lru" => Ok(PolicyKind::Lru),
            "arc" => Ok(PolicyKind::Arc),
            _ => Err(Error::UnknownPolicy {
                name: s.to_owned(),
                allowed: POLICY_NAMES,
            }),
        }
    }
}

impl PolicyKind {
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Arc => "arc",
        }
    }
}

/// What the policy needs from an index entry: its links and which list holds it.
pub(crate) trait PolicyNode: Linked {
    fn list(&self) -> u8;
    fn set_list(&mut self, list: u8);
    /// Under `Lru` only: the key's rank (the links are unused then).
    fn rank(&self) -> Rank;
    fn set_rank(&mut self, rank: Rank);
}

pub(crate) const NO_LIST: u8 = u8::MAX;
const T1: u8 = 0;
const T2: u8 = 1;

/// How ARC's REPLACE should pick victims for one call (see `Policy::ghost_outcome`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Replace {
    pub(crate) target_t1: f64,
    pub(crate) b2_hit: bool,
}

pub(crate) struct Policy {
    kind: PolicyKind,
    /// `Arc` only: T1 and T2.
    lists: [List; 2],
    ghosts: Option<Ghosts>,
    /// `Lru` only.
    ranked: Option<Ranked>,
}

impl Policy {
    pub(crate) fn new(kind: PolicyKind, capacity: u32) -> Self {
        let ghosts = (kind == PolicyKind::Arc).then(|| Ghosts::new(capacity));
        let ranked = (kind == PolicyKind::Lru).then(Ranked::default);
        Policy {
            kind,
            lists: [List::default(); 2],
            ghosts,
            ranked,
        }
    }

    pub(crate) fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// A fresh request rank (see `Rank`); ARC orders by use and ignores ranks.
    pub(crate) fn new_rank(&mut self) -> u64 {
        match &mut self.ranked {
            Some(r) => r.next(),
            None => 0,
        }
    }

    /// A new key enters at the most recent end, or at `rank` under LRU. Under ARC a key whose
    /// ghost `take_ghosts` found goes straight to T2: it has been wanted before.
    pub(crate) fn insert<N: PolicyNode>(
        &mut self,
        nodes: &mut [N],
        i: u32,
        ghost_hit: bool,
        rank: Option<Rank>,
    ) {
        if let Some(r) = &mut self.ranked {
            let rank = rank.unwrap_or_else(|| Rank::plain(r.next()));
            nodes[i as usize].set_list(T1);
            r.insert(nodes, i, rank);
            return;
        }
        let list = if ghost_hit { T2 } else { T1 };
        nodes[i as usize].set_list(list);
        self.lists[list as usize].push_mru(nodes, i);
    }

    /// What the ghosts of a call's new keys (their fingerprints, in order) would do, without
    /// doing it: ARC's target after their hits, and whether any hit was in B2 (REPLACE's tie
    /// rule). Victims are chosen with these before anything changes.
    pub(crate) fn ghost_outcome(&self, fingerprints: &[u64]) -> Replace {
        let Some(g) = &self.ghosts else {
            return Replace::default();
        };
        let mut lens = [g.lists[0].len, g.lists[1].len];
        let mut out = Replace {
            target_t1: g.target_t1,
            b2_hit: false,
        };
        for &fp in fingerprints {
            if let Some(found) = g.find(fp) {
                let list = g.nodes[found as usize].list();
                if lens[list] == 0 {
                    continue; // a fingerprint twice in one call: its ghost counts once
                }
                out.target_t1 = g.adapted(out.target_t1, list, lens);
                out.b2_hit |= list == 1;
                lens[list] -= 1;
            }
        }
        out
    }

    /// Consumes the ghosts of a call's new keys: each hit adapts the target and is forgotten.
    /// Returns which keys hit (all false under LRU).
    pub(crate) fn take_ghosts(&mut self, fingerprints: &[u64]) -> Vec<bool> {
        match &mut self.ghosts {
            Some(g) => fingerprints.iter().map(|&fp| g.hit(fp)).collect(),
            None => vec![false; fingerprints.len()],
        }
    }

    /// Restores ARC's bounds once a call's keys are in.
    pub(crate) fn trim_ghosts(&mut self) {
        let t = [self.lists[0].len, self.lists[1].len];
        if let Some(g) = &mut self.ghosts {
            g.trim(t);
        }
    }

    /// Under LRU, moves a resident key up to `rank` if it sorts below it (a request using a
    /// key it did not store); otherwise nothing.
    pub(crate) fn raise<N: PolicyNode>(&mut self, nodes: &mut [N], i: u32, rank: Rank) {
        if let Some(r) = &mut self.ranked {
            if nodes[i as usize].rank() < rank {
                r.remove();
                r.insert(nodes, i, rank);
            }
        }
    }

    /// Removes a key without remembering it (failed store, reset).
    pub(crate) fn remove<N: PolicyNode>(&mut self, nodes: &mut [N], i: u32) {
        if let Some(r) = &mut self.ranked {
            r.remove();
        } else {
            let list = nodes[i as usize].list();
            self.lists[list as usize].unlink(nodes, i);
        }
        nodes[i as usize].set_list(NO_LIST);
    }

    /// Removes a key chosen by `select_victims`; ARC remembers it as a ghost (the bounds are
    /// restored by `trim_ghosts` at the end of the call).
    pub(crate) fn evict<N: PolicyNode>(&mut self, nodes: &mut [N], i: u32, fingerprint: u64) {
        let list = nodes[i as usize].list();
        self.remove(nodes, i);
        if let Some(g) = &mut self.ghosts {
            g.add(list, fingerprint);
        }
    }

    /// Moves a resident key to the recent end. With `promote` (a real reuse) ARC moves it to T2;
    /// without (a key whose store is still in flight, or one only refreshed in its prefix order)
    /// it stays in its list, so a once-used key does not come to look frequent.
    pub(crate) fn touch<N: PolicyNode>(&mut self, nodes: &mut [N], i: u32, promote: bool) {
        if let Some(r) = &mut self.ranked {
            r.remove();
            let rank = Rank::plain(r.next());
            r.insert(nodes, i, rank);
            return;
        }
        let list = nodes[i as usize].list();
        self.lists[list as usize].unlink(nodes, i);
        let to = if self.kind == PolicyKind::Arc && promote {
            T2
        } else {
            list
        };
        nodes[i as usize].set_list(to);
        self.lists[to as usize].push_mru(nodes, i);
    }

    /// Picks exactly `n` victims among nodes for which `evictable` holds, without changing the
    /// order; `None` when fewer than `n` exist. Under ARC, `replace` (from `ghost_outcome`)
    /// steers REPLACE: T1's oldest leaves while |T1| exceeds the target (or equals it after a
    /// B2 hit), else T2's.
    pub(crate) fn select_victims<N: PolicyNode>(
        &mut self,
        nodes: &[N],
        n: usize,
        replace: Replace,
        evictable: impl Fn(u32) -> bool,
    ) -> Option<Vec<u32>> {
        let mut victims = Vec::with_capacity(n);
        if n == 0 {
            return Some(victims);
        }
        if let Some(r) = &mut self.ranked {
            return r.select(nodes, n, evictable);
        }
        let mut t1 = self.lists[T1 as usize]
            .iter(nodes)
            .filter(|&i| evictable(i));
        let mut t2 = self.lists[T2 as usize]
            .iter(nodes)
            .filter(|&i| evictable(i));
        let target = replace.target_t1;
        // Both scans only move forward, so a batch of evictions stays linear.
        let mut virtual_t1 = self.lists[T1 as usize].len;
        while victims.len() < n {
            let t1_len = f64::from(virtual_t1);
            let from_t1 = if t1_len > target || (replace.b2_hit && t1_len == target) {
                t1.next()
            } else {
                None
            };
            let victim = from_t1.or_else(|| t2.next()).or_else(|| t1.next())?;
            if nodes[victim as usize].list() == T1 {
                virtual_t1 = virtual_t1.saturating_sub(1);
            }
            victims.push(victim);
        }
        Some(victims)
    }

    /// Forgets eviction history (ARC ghosts and target); resident keys keep their order.
    pub(crate) fn forget_history(&mut self) {
        if let Some(g) = &mut self.ghosts {
            *g = Ghosts::new(g.capacity);
        }
    }

    pub(crate) fn list_len(&self, list: u8) -> u32 {
        match &self.ranked {
            Some(r) => r.live,
            None => self.lists[list as usize].len,
        }
    }

    /// The members of one list, first to leave first.
    pub(crate) fn list_members<N: PolicyNode>(&self, nodes: &[N], list: u8) -> Vec<u32> {
        match &self.ranked {
            Some(r) => r.sorted(nodes).into_iter().map(|(_, i)| i).collect(),
            None => self.lists[list as usize].iter(nodes).collect(),
        }
    }

    /// Under LRU, a ranked slot whose current rank the order does not hold.
    pub(crate) fn rank_mismatch<N: PolicyNode>(&self, nodes: &[N]) -> Option<u32> {
        let r = self.ranked.as_ref()?;
        let held: std::collections::HashSet<(Rank, u32)> = r.heap.iter().copied().collect();
        (0..nodes.len() as u32).find(|&i| {
            let node = &nodes[i as usize];
            node.list() != NO_LIST && !held.contains(&(node.rank(), i))
        })
    }

    pub(crate) fn num_lists(&self) -> u8 {
        if self.kind == PolicyKind::Arc {
            2
        } else {
            1
        }
    }

    /// Room for a call that evicts up to `keys` keys (ARC's ghosts); false when memory refuses.
    /// LRU's heap is left to grow with its pushes: it holds at most about two entries of 16 bytes
    /// per live key, and reserving ahead of them would hold spare capacity in small stores.
    pub(crate) fn reserve(&mut self, keys: usize) -> bool {
        self.ghosts.as_mut().map_or(true, |g| g.reserve(keys))
    }

    /// What is wrong with ARC's lists, if anything (for `check_invariants`): its bounds.
    pub(crate) fn ghost_problem(&self) -> Option<String> {
        let g = self.ghosts.as_ref()?;
        let (t1, t2) = (u64::from(self.lists[0].len), u64::from(self.lists[1].len));
        let (b1, b2) = (u64::from(g.lists[0].len), u64::from(g.lists[1].len));
        let c = u64::from(g.capacity);
        let broken = b1 + b2 > c || t1 + b1 > c || t1 + t2 + b1 + b2 > 2 * c;
        broken.then(|| format!("ARC bounds broken: |T1|={t1} |T2|={t2} |B1|={b1} |B2|={b2}, c={c}"))
    }

    pub(crate) fn target_t1(&self) -> f64 {
        self.ghosts.as_ref().map_or(0.0, |g| g.target_t1)
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.ghosts.as_ref().map_or(0, Ghosts::heap_bytes)
            + self.ranked.as_ref().map_or(0, Ranked::heap_bytes)
    }
}
