//! Running one job on a Redis Cluster: its items grouped by the primary that owns their chunk's
//! slot, each group pipelined on that node's connection, and after a `MOVED` or a node that
//! failed, the slot map refreshed and what is left run once more, within the job's deadline.

use crate::cluster::{ClusterState, Node, SlotMap};
use crate::conn::Conn;
use crate::error::{RemoteError, Result};
use crate::jobs::{self, Ctx};
use crate::queue::{Job, Shared, Work};
use crate::slot::chunk_slot;
use crate::stats::Counters;
use crate::url::Endpoint;
use kvoffload_tier::status::{FAILED, PENDING};
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Mutex;
use std::time::Instant;

/// Sort keys of items that are not sent to a node this round.
const SKIP: usize = usize::MAX;
const UNROUTED: usize = usize::MAX - 1;

/// A job's items reordered so that each node's are contiguous.
struct Grouped<T> {
    items: Vec<T>,
    /// The original index of each reordered item.
    orig: Vec<usize>,
    runs: Vec<(usize, Range<usize>)>,
}

fn group<T>(items: Vec<T>, owner: impl Fn(usize, &T) -> usize) -> Grouped<T> {
    let mut tagged: Vec<(usize, usize, T)> = items
        .into_iter()
        .enumerate()
        .map(|(i, t)| (owner(i, &t), i, t))
        .collect();
    tagged.sort_by_key(|&(o, i, _)| (o, i));
    let mut runs: Vec<(usize, Range<usize>)> = Vec::new();
    for (pos, (o, _, _)) in tagged.iter().enumerate() {
        match runs.last_mut() {
            Some((last, r)) if last == o => r.end = pos + 1,
            _ => runs.push((*o, pos..pos + 1)),
        }
    }
    let (orig, items) = tagged.into_iter().map(|(_, i, t)| (i, t)).unzip();
    Grouped { items, orig, runs }
}

fn ungroup<T>(g: Grouped<T>) -> Vec<T> {
    let mut back: Vec<(usize, T)> = g.orig.into_iter().zip(g.items).collect();
    back.sort_by_key(|&(i, _)| i);
    back.into_iter().map(|(_, t)| t).collect()
}

/// A worker's connections, one per primary it has talked to.
#[derive(Default)]
pub(crate) struct NodeConns {
    conns: HashMap<Node, Conn>,
    ever_connected: HashSet<Node>,
}

/// What one round of a job did.
#[derive(Default)]
struct Round {
    /// Some node answered (the cluster is there, whatever else failed).
    answered: bool,
    /// The last node failure.
    err: Option<RemoteError>,
    /// The `MOVED` answers (slot, new owner).
    moved: Vec<Redirect>,
    /// The `ASK` answers (slot, where its keys went).
    asked: Vec<Redirect>,
}

/// A slot and the node a `MOVED` or `ASK` answer names (`None`: it names none we can reach).
type Redirect = (u16, Option<Node>);

impl NodeConns {
    fn conn(&mut self, sh: &Shared, node: &Node, deadline: Instant) -> Result<&mut Conn> {
        if !self.conns.contains_key(node) {
            let c = connect(sh, node, deadline, self.ever_connected.contains(node))?;
            self.ever_connected.insert(node.clone());
            self.conns.insert(node.clone(), c);
        }
        let c = self.conns.get_mut(node).expect("inserted above");
        c.set_deadline(deadline);
        Ok(c)
    }

    /// A node's connection failed: dropped, the node left alone for the breaker's cool-down,
    /// and the map asked for anew (its slots may have a new owner).
    fn failed(
        &mut self,
        sh: &Shared,
        cl: &ClusterState,
        node: &Node,
        e: RemoteError,
        out: &mut Round,
    ) {
        if !matches!(e, RemoteError::Server(_)) {
            self.conns.remove(node);
            cl.rest(node, sh.cfg.breaker_cooldown);
        }
        let name = crate::cluster::node_name(node);
        sh.nodes.failed(&name, 1);
        sh.note(format!("cluster node {name}: {e}"));
        out.err = Some(e);
    }

    /// The runs of `g` to send, each with its node: not those whose node is resting or whose
    /// slot no node owns (they stay pending, and fail unsent).
    fn runs<'m, T>(
        &self,
        cl: &ClusterState,
        nodes: &'m [Node],
        g: &Grouped<T>,
    ) -> Vec<(&'m Node, Range<usize>)> {
        let mut runs = Vec::new();
        for (owner, range) in &g.runs {
            match *owner {
                SKIP => {}
                // Its slots may have a new owner by now (a replica took over).
                n if n == UNROUTED || cl.is_resting(&nodes[n]) => cl.mark_stale(),
                n => runs.push((&nodes[n], range.clone())),
            }
        }
        runs
    }

    /// Runs the pending items of `items` (their statuses in `st`) with `run`, every node's part
    /// at once (each on a thread of its own but the first, or inline where the system gives no
    /// thread): a node that hangs holds up only its own items, and the job takes as long as its
    /// slowest node, not the sum of them.
    #[allow(clippy::too_many_arguments)]
    fn round<T: Send>(
        &mut self,
        sh: &Shared,
        cl: &ClusterState,
        route: &Route<'_>,
        items: &mut Vec<T>,
        key: impl Fn(&T) -> &[u8],
        st: &mut [u8],
        deadline: Instant,
        store: bool,
        run: impl Fn(&mut Conn, &Ctx<'_>, &mut [T], &mut [u8]) -> Result<()> + Sync,
    ) -> Round {
        let mut out = Round::default();
        let mut g = group(std::mem::take(items), |i, t| route.owner(st[i], key(t)));
        let runs = self.runs(cl, route.nodes, &g);
        let slices = split_runs(&mut g.items, runs.iter().map(|(_, r)| r.clone()));
        // Each part, taken by whichever thread runs it.
        let parts: Vec<Mutex<Option<Part<'_, T>>>> = runs
            .iter()
            .zip(slices)
            .map(|((node, _), items)| {
                let known = self.ever_connected.contains(*node);
                let conn = self.conns.remove(*node);
                Mutex::new(Some((*node, conn, known, items)))
            })
            .collect();
        let one = |part: &Mutex<Option<Part<'_, T>>>| {
            let (node, conn, known, items) = part
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .expect("each part runs once");
            let x = sh.ctx();
            let mut sub_st = vec![PENDING; items.len()];
            let conn = match conn {
                Some(c) => Ok(c),
                None => connect(sh, node, deadline, known),
            };
            let (res, conn) = match conn {
                Ok(mut c) => {
                    c.set_deadline(deadline);
                    c.set_asking(route.asking());
                    let res = run(&mut c, &x, items, &mut sub_st);
                    c.set_asking(false);
                    (res, Some(c))
                }
                Err(e) => (Err(e), None),
            };
            let redirects = (x.moved.take(), x.asked.take());
            (res, conn, sub_st, x.refused.get(), redirects)
        };
        let results: Vec<_> = std::thread::scope(|scope| {
            let spawned: Vec<_> = parts
                .iter()
                .skip(1)
                .map(|part| {
                    std::thread::Builder::new()
                        .spawn_scoped(scope, || one(part))
                        .ok()
                })
                .collect();
            let mut results: Vec<_> = parts.iter().take(1).map(one).collect();
            for (part, handle) in parts.iter().skip(1).zip(spawned) {
                results.push(match handle {
                    Some(h) => h.join().expect("a node's part never panics"),
                    None => one(part), // no thread to be had: this one runs it
                });
            }
            results
        });
        for ((node, range), (res, conn, sub_st, refused, (moved, asked))) in
            runs.iter().zip(results)
        {
            out.moved.extend(moved);
            out.asked.extend(asked);
            if let Some(c) = conn {
                self.ever_connected.insert((*node).clone());
                self.conns.insert((*node).clone(), c);
            }
            let name = crate::cluster::node_name(node);
            sh.nodes.moved(&name, store, &sub_st, sh.layout.chunk_bytes);
            sh.nodes.failed(&name, refused);
            settle(&g, range, &sub_st, st);
            match res {
                Ok(()) => out.answered = true,
                Err(e) => self.failed(sh, cl, node, e, &mut out),
            }
        }
        *items = ungroup(g);
        out
    }

    /// [`NodeConns::round`] for lookups, pipelined to every node at once: all nodes are asked
    /// before any answer is read, so a lookup over three nodes costs about one round trip.
    fn lookup_round(
        &mut self,
        sh: &Shared,
        cl: &ClusterState,
        route: &Route<'_>,
        keys: &mut Vec<Vec<u8>>,
        st: &mut [u8],
        deadline: Instant,
    ) -> Round {
        let mut out = Round::default();
        let ctx = sh.ctx();
        let g = group(std::mem::take(keys), |i, k| route.owner(st[i], k));
        let runs = self.runs(cl, route.nodes, &g);
        let mut sub_st: Vec<Vec<u8>> = runs.iter().map(|(_, r)| vec![PENDING; r.len()]).collect();
        // Per run: the TOUCH commands it has out, or None once its node failed.
        let mut touches: Vec<Option<usize>> = vec![Some(0); runs.len()];
        for (j, (node, range)) in runs.iter().enumerate() {
            let sent = self.conn(sh, node, deadline).and_then(|c| {
                c.set_asking(route.asking());
                jobs::lookup_send(c, &ctx, &g.items[range.clone()])
            });
            if let Err(e) = sent {
                touches[j] = None;
                self.failed(sh, cl, node, e, &mut out);
            }
        }
        for phase in 0..2 {
            for (j, (node, range)) in runs.iter().enumerate() {
                let (Some(t), Some(c)) = (touches[j], self.conns.get_mut(*node)) else {
                    continue;
                };
                let refused = ctx.refused.get();
                let res = if phase == 0 {
                    jobs::lookup_read(c, &ctx, &g.items[range.clone()], &mut sub_st[j])
                } else {
                    jobs::lookup_finish(c, &ctx, t).map(|()| 0)
                };
                let name = crate::cluster::node_name(node);
                sh.nodes.failed(&name, ctx.refused.get() - refused);
                match res {
                    Ok(t) => touches[j] = Some(t),
                    Err(e) => {
                        touches[j] = None;
                        self.failed(sh, cl, node, e, &mut out);
                    }
                }
            }
        }
        for (node, _) in &runs {
            if let Some(c) = self.conns.get_mut(*node) {
                c.set_asking(false);
            }
        }
        out.answered = touches.iter().any(Option::is_some);
        for ((_, range), sub) in runs.iter().zip(&sub_st) {
            settle(&g, range, sub, st);
        }
        *keys = ungroup(g);
        out.moved = ctx.moved.take();
        out.asked = ctx.asked.take();
        out
    }

    /// Runs `job` (its items still `PENDING` in `st`) across the cluster's primaries. An error
    /// only when no node answered: one bad node fails its own items, and the tier's breaker
    /// is for a cluster that is gone.
    pub(crate) fn attempt(
        &mut self,
        sh: &Shared,
        cl: &ClusterState,
        job: &mut Job,
        st: &mut [u8],
        deadline: Instant,
    ) -> Result<()> {
        if cl.is_stale() {
            // A new map first, asked of the nodes that work before those resting, in at most
            // half of what is left of the job's deadline.
            let now = Instant::now();
            let by =
                now + (deadline.saturating_duration_since(now) / 2).min(sh.cfg.connect_timeout);
            cl.refresh(
                &sh.target,
                sh.cfg.connect_timeout,
                by,
                sh.cfg.breaker_cooldown,
            );
        }
        let mut answered = false;
        let mut last_err = None;
        // Slots that answered `ASK`, and where their keys went: asked there once, after the
        // `MOVED` retry (a slot being migrated keeps answering `ASK` until it is done).
        let mut asks: Vec<Redirect> = Vec::new();
        let (mut moves_retried, mut asks_retried) = (false, false);
        let mut asking = false;
        // Items put back for a retry: counted again only if they are sent again.
        let mut retried = vec![false; st.len()];
        loop {
            let map = cl.map();
            let (ask_nodes, ask_slots) = ask_route(&asks);
            let route = if asking {
                Route {
                    nodes: &ask_nodes,
                    slots: Slots::Ask(&ask_slots),
                }
            } else {
                Route {
                    nodes: &map.nodes,
                    slots: Slots::Map(&map),
                }
            };
            let out = match &mut job.work {
                Work::Lookup(keys) => self.lookup_round(sh, cl, &route, keys, st, deadline),
                Work::Store(items) => self.round(
                    sh,
                    cl,
                    &route,
                    items,
                    |it| &it.0,
                    st,
                    deadline,
                    true,
                    |c, x, it, s| jobs::store(c, x, it, s),
                ),
                Work::Load(items) => self.round(
                    sh,
                    cl,
                    &route,
                    items,
                    |it| &it.0,
                    st,
                    deadline,
                    false,
                    jobs::load,
                ),
            };
            answered |= out.answered;
            last_err = out.err.or(last_err);
            let moves = out.moved;
            if !asking {
                asks.extend(out.asked);
            }
            if !moves.is_empty() {
                cl.apply_moves(&moves);
            }
            // Once more for the moved slots' items (on their new owners), then once for the
            // migrating slots' (where `ASK` sent them); what they counted as failed is taken back.
            let again: HashSet<u16> = if !moves.is_empty() && !moves_retried {
                moves_retried = true;
                asking = false;
                moves.iter().map(|(slot, _)| *slot).collect()
            } else if !asks.is_empty() && !asks_retried {
                asks_retried = true;
                asking = true;
                asks.iter().map(|(slot, _)| *slot).collect()
            } else {
                break;
            };
            let mut again_now = 0u64;
            for (i, s) in st.iter_mut().enumerate() {
                if *s == FAILED && again.contains(&chunk_slot(job.key(i))) {
                    *s = PENDING;
                    retried[i] = true;
                    again_now += 1;
                }
            }
            match job.work {
                Work::Lookup(_) => Counters::sub(&sh.stats.lookup_keys, again_now),
                Work::Store(_) => Counters::sub(&sh.stats.store_failures, again_now),
                Work::Load(_) => Counters::sub(&sh.stats.load_failures, again_now),
            }
        }
        // A lookup key taken back for a retry that never went out was still asked once.
        if let Work::Lookup(_) = job.work {
            let not_resent = st
                .iter()
                .zip(&retried)
                .filter(|&(&s, &r)| r && s == PENDING)
                .count() as u64;
            Counters::add(&sh.stats.lookup_keys, not_resent);
        }
        let unsent = st.iter().filter(|&&s| s == PENDING).count() as u64;
        match last_err {
            // The worker fails and counts what is pending, and the tier's breaker counts it.
            Some(e) if !answered => Err(e),
            None if unsent > 0 && !answered => Err(RemoteError::Io(
                "no primary of the cluster could be asked (none owns the slots, or all rest \
                 after failures)"
                    .into(),
            )),
            _ => {
                // Items of a node that failed, rests or owns no slot: failed, unsent.
                match job.work {
                    Work::Store(_) => Counters::add(&sh.stats.store_failures, unsent),
                    Work::Load(_) => Counters::add(&sh.stats.load_failures, unsent),
                    Work::Lookup(_) => {}
                }
                for s in st.iter_mut().filter(|s| **s == PENDING) {
                    *s = FAILED;
                }
                Ok(())
            }
        }
    }
}

/// A part of a round: its node, this worker's connection to it (if any), whether this worker
/// was ever connected to it, and its items.
type Part<'a, T> = (&'a Node, Option<Conn>, bool, &'a mut [T]);

/// The nodes `ASK` named (each once) and each asked slot's index among them.
fn ask_route(asks: &[Redirect]) -> (Vec<Node>, HashMap<u16, usize>) {
    let mut nodes: Vec<Node> = Vec::new();
    let mut slots = HashMap::new();
    for (slot, node) in asks {
        let Some(node) = node else { continue };
        let i = nodes.iter().position(|n| n == node).unwrap_or_else(|| {
            nodes.push(node.clone());
            nodes.len() - 1
        });
        slots.insert(*slot, i);
    }
    (nodes, slots)
}

/// Connects to `node` (counted: a reconnect if this worker had been connected to it before, or
/// a connect failure).
fn connect(sh: &Shared, node: &Node, deadline: Instant, reconnect: bool) -> Result<Conn> {
    let endpoint = Endpoint::Tcp {
        host: node.0.clone(),
        port: node.1,
    };
    let by = deadline.min(Instant::now() + sh.cfg.connect_timeout);
    match Conn::connect_to(&sh.target, &endpoint, by) {
        Ok(c) => {
            if reconnect {
                Counters::add(&sh.stats.reconnects, 1);
            }
            Ok(c)
        }
        Err(e) => {
            Counters::add(&sh.stats.connect_failures, 1);
            Err(e)
        }
    }
}

/// The disjoint sub-slices of `items` at `ranges` (ascending, not overlapping).
fn split_runs<T>(items: &mut [T], ranges: impl Iterator<Item = Range<usize>>) -> Vec<&mut [T]> {
    let mut out = Vec::new();
    let mut rest = items;
    let mut at = 0;
    for r in ranges {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - at);
        let (part, tail) = tail.split_at_mut(r.len());
        out.push(part);
        rest = tail;
        at = r.end;
    }
    out
}

/// Where a round sends its pending items: to the owner of their slot in the map, or, after
/// `ASK` answers, to the node each migrating slot's keys went to, every command after `ASKING`.
struct Route<'a> {
    /// What an owner index points into.
    nodes: &'a [Node],
    slots: Slots<'a>,
}

enum Slots<'a> {
    Map(&'a SlotMap),
    Ask(&'a HashMap<u16, usize>),
}

impl Route<'_> {
    fn owner(&self, status: u8, key: &[u8]) -> usize {
        if status != PENDING {
            return SKIP;
        }
        let slot = chunk_slot(key);
        match self.slots {
            Slots::Map(map) => map.owner_of_slot(slot).unwrap_or(UNROUTED),
            Slots::Ask(asked) => asked.get(&slot).copied().unwrap_or(SKIP),
        }
    }

    fn asking(&self) -> bool {
        matches!(self.slots, Slots::Ask(_))
    }
}

/// Copies a run's statuses back to the job's order.
fn settle<T>(g: &Grouped<T>, range: &Range<usize>, sub_st: &[u8], st: &mut [u8]) {
    for (k, &s) in sub_st.iter().enumerate() {
        st[g.orig[range.start + k]] = s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_and_ungroup_keep_every_item_once_in_order() {
        let items: Vec<u32> = (0..10).collect();
        let g = group(items, |i, _| [2, 0, SKIP, 2, 1, 0, UNROUTED, 2, 1, 0][i]);
        assert_eq!(g.items, vec![1, 5, 9, 4, 8, 0, 3, 7, 6, 2]);
        assert_eq!(
            g.runs,
            vec![
                (0, 0..3),
                (1, 3..5),
                (2, 5..8),
                (UNROUTED, 8..9),
                (SKIP, 9..10)
            ]
        );
        assert_eq!(ungroup(g), (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn split_runs_gives_each_range_its_own_slice() {
        let mut items: Vec<u32> = (0..10).collect();
        let parts = split_runs(&mut items, [1..3, 3..4, 7..10].into_iter());
        let got: Vec<Vec<u32>> = parts.iter().map(|p| p.to_vec()).collect();
        assert_eq!(got, vec![vec![1, 2], vec![3], vec![7, 8, 9]]);
        assert!(split_runs(&mut items, std::iter::empty()).is_empty());
    }
}
