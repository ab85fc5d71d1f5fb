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

use crate::error::{Error, Result};
use crate::heap::QuadHeap;
use crate::index::{Index, MAX_BUCKETS};
use crate::list::{Linked, List, NIL};
use core::str::FromStr;

/// Eviction order of a key under `Lru`, packed in 64 bits: the smallest leaves first. A plain
/// use takes the next value of a counter (`major`); a key used by a request takes that request's
/// rank (drawn once from the same counter) and sorts below every other use of that rank by its
/// position in the request, so within a request tails leave before heads, across all its batches
/// (vLLM 0.33's LRU ranks `(request_rank, -position)` and `(counter, 0)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rank(u64);

const MINOR_BITS: u32 = 24;
const MINOR_MAX: u64 = (1 << MINOR_BITS) - 1;
/// 2^40 draws: past that, ranks saturate (later uses tie, broken by slot) instead of wrapping.
const MAJOR_MAX: u64 = (1 << (64 - MINOR_BITS)) - 1;

impl Rank {
    /// A plain use: above every key of the same major.
    pub fn plain(major: u64) -> Rank {
        Rank((major.min(MAJOR_MAX) << MINOR_BITS) | MINOR_MAX)
    }

    /// Position `position` of a request of rank `major`: positions beyond 2^24 - 2 tie.
    pub fn at(major: u64, position: i64) -> Rank {
        let p = position.clamp(0, MINOR_MAX as i64 - 1) as u64;
        Rank((major.min(MAJOR_MAX) << MINOR_BITS) | (MINOR_MAX - 1 - p))
    }

    pub(crate) fn from_bits(bits: u64) -> Rank {
        Rank(bits)
    }

    pub(crate) fn to_bits(self) -> u64 {
        self.0
    }
}

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

/// LRU as a lazy min-heap of `(rank, slot)`: a key's current rank lives in its node, and an
/// entry whose rank is no longer its node's (or whose node left the order) is dropped when it
/// surfaces. A new use is then one push, mostly near the recent end (cheap to sift), instead of
/// a removal and an insertion in an ordered tree.
#[derive(Default)]
struct Ranked {
    heap: QuadHeap<(Rank, u32)>,
    counter: u64,
    live: u32,
}

impl Ranked {
    fn next(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    fn insert<N: PolicyNode>(&mut self, nodes: &mut [N], i: u32, rank: Rank) {
        nodes[i as usize].set_rank(rank);
        self.heap.push((rank, i));
        self.live += 1;
        // Stale entries are at most twice the live ones (plus slack): rebuilding is linear.
        // A slot freed and taken again at an equal rank leaves equal entries: keep one (a
        // slot's current entries are all equal, its node holding their one rank).
        if self.heap.len() > 2 * self.live as usize + 64 {
            let mut kept = vec![false; nodes.len()];
            let mut current = self.heap.take();
            current.retain(|&e| {
                is_current(nodes, e) && !std::mem::replace(&mut kept[e.1 as usize], true)
            });
            // Gives back what a once larger order held, as the store's metadata bytes count it.
            current.shrink_to_fit();
            self.heap = QuadHeap::from_vec(current);
        }
    }

    /// Leaves the order; its entry goes stale (the caller takes the node out of the list, or
    /// inserts it again with a new rank).
    fn remove(&mut self) {
        self.live -= 1;
    }

    /// The `n` first evictable slots in order, the heap as it was otherwise (their entries are
    /// consumed: the caller evicts them).
    fn select<N: PolicyNode>(
        &mut self,
        nodes: &[N],
        n: usize,
        evictable: impl Fn(u32) -> bool,
    ) -> Option<Vec<u32>> {
        let mut victims = Vec::with_capacity(n);
        let mut kept = Vec::new();
        let mut last = None;
        while victims.len() < n {
            let Some(entry) = self.heap.pop() else {
                break;
            };
            // A slot freed and taken again at an equal rank can leave a duplicate: they pop in
            // a row.
            if !is_current(nodes, entry) || last == Some(entry) {
                continue;
            }
            last = Some(entry);
            if evictable(entry.1) {
                victims.push(entry.1);
            } else {
                kept.push(entry);
            }
        }
        let found = victims.len() == n;
        if !found {
            kept.extend(victims.iter().map(|&i| (nodes[i as usize].rank(), i)));
        }
        self.heap.extend(kept);
        found.then_some(victims)
    }

    /// The current entries, first to leave first.
    fn sorted<N: PolicyNode>(&self, nodes: &[N]) -> Vec<(Rank, u32)> {
        let mut out: Vec<_> = self
            .heap
            .iter()
            .copied()
            .filter(|&e| is_current(nodes, e))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    fn heap_bytes(&self) -> usize {
        self.heap.capacity() * core::mem::size_of::<(Rank, u32)>()
    }
}

fn is_current<N: PolicyNode>(nodes: &[N], (rank, i): (Rank, u32)) -> bool {
    let node = &nodes[i as usize];
    node.list() != NO_LIST && node.rank() == rank
}

/// A remembered key: 16 bytes. The fingerprint's lowest bit is replaced by the ghost list
/// (0 = B1, 1 = B2), so fingerprints compare on their upper 63 bits.
#[derive(Clone, Copy)]
struct Ghost {
    tagged: u64,
    prev: u32,
    next: u32,
}

const _: () = assert!(core::mem::size_of::<Ghost>() == 16);

impl Ghost {
    fn fingerprint(&self) -> u64 {
        self.tagged & !1
    }

    fn list(&self) -> usize {
        (self.tagged & 1) as usize
    }
}

impl Linked for Ghost {
    fn prev(&self) -> u32 {
        self.prev
    }
    fn next(&self) -> u32 {
        self.next
    }
    fn set_prev(&mut self, v: u32) {
        self.prev = v;
    }
    fn set_next(&mut self, v: u32) {
        self.next = v;
    }
}

/// Ghosts are looked up on every insert and mostly miss, but they must stay within the metadata
/// budget per slot: a fuller table than the main index.
const GHOST_INDEX_LOAD: f64 = 0.8;

/// ARC's B1/B2: at most `capacity` fingerprints in all, so ghosts cost a bounded amount per slot.
struct Ghosts {
    capacity: u32,
    target_t1: f64,
    nodes: Vec<Ghost>,
    free: Vec<u32>,
    table: Index,
    lists: [List; 2],
}

impl Ghosts {
    fn new(capacity: u32) -> Self {
        Ghosts {
            capacity,
            target_t1: 0.0,
            nodes: Vec::new(),
            free: Vec::new(),
            // A call may add up to `capacity` ghosts before it trims (bounded by what the table
            // can address, far beyond any real call).
            table: Index::new(
                (2 * capacity as usize).min((MAX_BUCKETS as f64 * GHOST_INDEX_LOAD) as usize),
                GHOST_INDEX_LOAD,
            ),
            lists: [List::default(); 2],
        }
    }

    fn find(&self, fp: u64) -> Option<u32> {
        let fp = fp & !1;
        let nodes = &self.nodes;
        self.table
            .find(fp, |g| nodes[g as usize].fingerprint() == fp)
    }

    /// The target after a hit in ghost list `list` (0 = B1: favour recency, 1 = B2: favour
    /// frequency) with the lists `lens` long.
    fn adapted(&self, target: f64, list: usize, lens: [u32; 2]) -> f64 {
        let (b1, b2) = (f64::from(lens[0]), f64::from(lens[1]));
        if list == 0 {
            (target + (b2 / b1).max(1.0)).min(f64::from(self.capacity))
        } else {
            (target - (b1 / b2).max(1.0)).max(0.0)
        }
    }

    /// If `fp` is a ghost: adapt the target, forget the ghost, and report the hit.
    fn hit(&mut self, fp: u64) -> bool {
        let Some(g) = self.find(fp) else { return false };
        let lens = [self.lists[0].len, self.lists[1].len];
        self.target_t1 = self.adapted(self.target_t1, self.nodes[g as usize].list(), lens);
        self.drop_ghost(g);
        true
    }

    /// ARC's bounds, given T1 and T2's lengths: |T1| + |B1| <= c, and all four lists <= 2c
    /// (the oldest ghosts go); ghosts alone never exceed c either (they can when failed stores
    /// left the cache below c).
    fn trim(&mut self, t: [u32; 2]) {
        let c = self.capacity;
        let (t1, t2) = (u64::from(t[0]), u64::from(t[1]));
        let b = |g: &Ghosts, l: usize| u64::from(g.lists[l].len);
        while self.lists[0].len > 0 && t1 + b(self, 0) > u64::from(c) {
            self.drop_ghost(self.lists[0].head);
        }
        while self.lists[1].len > 0 && t1 + t2 + b(self, 0) + b(self, 1) > 2 * u64::from(c) {
            self.drop_ghost(self.lists[1].head);
        }
        while self.lists[0].len + self.lists[1].len > c {
            let from = usize::from(self.lists[1].len > 0);
            self.drop_ghost(self.lists[from].head);
        }
    }

    fn drop_ghost(&mut self, g: u32) {
        let list = self.nodes[g as usize].list();
        self.lists[list].unlink(&mut self.nodes, g);
        let fp = self.nodes[g as usize].fingerprint();
        let removed = self.table.remove(fp, g);
        debug_assert!(removed, "ghost {g} is indexed");
        self.free.push(g);
    }

    /// Remembers an evicted key. It cannot be a ghost already: its ghost, if any, was consumed
    /// when it was inserted (a fingerprint collision would only leave a harmless duplicate).
    fn add(&mut self, list: u8, fp: u64) {
        let fp = fp & !1;
        let node = Ghost {
            tagged: fp | u64::from(list),
            prev: NIL,
            next: NIL,
        };
        let g = match self.free.pop() {
            Some(g) => {
                self.nodes[g as usize] = node;
                g
            }
            None => {
                // `reserve` made room.
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.lists[list as usize].push_mru(&mut self.nodes, g);
        self.table.insert(fp, g);
    }

    /// Room for `n` more evictions (a call may hold up to `capacity + n` ghosts until it
    /// trims): nodes, their index and the free list; false when memory refuses.
    fn reserve(&mut self, n: usize) -> bool {
        let n = n.min(self.capacity as usize); // a call evicts at most every slot
        let fresh = n.saturating_sub(self.free.len());
        self.table.len() + n <= self.table.limit()
            && self.nodes.try_reserve(fresh).is_ok()
            && self.free.try_reserve(self.nodes.len() + fresh).is_ok()
            && self.table.reserve(n)
    }

    fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * core::mem::size_of::<Ghost>()
            + self.free.capacity() * 4
            + self.table.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::Rank;

    #[test]
    fn rank_order() {
        // Within a request, tails leave first; the request's keys sit between older and newer
        // draws; positions past the minor range tie instead of wrapping.
        assert!(Rank::at(5, 3) < Rank::at(5, 0));
        assert!(Rank::at(5, 0) < Rank::plain(5));
        assert!(Rank::plain(4) < Rank::at(5, 1 << 30));
        assert!(Rank::at(5, 0) < Rank::plain(6));
        assert_eq!(Rank::at(5, 1 << 30), Rank::at(5, i64::MAX));
        assert_eq!(Rank::at(5, -3), Rank::at(5, 0));
        assert_eq!(Rank::plain(u64::MAX), Rank::plain(1 << 41));
    }
}
