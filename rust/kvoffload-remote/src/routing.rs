//! Running one job on a Redis Cluster: its items grouped by the primary that owns their chunk's
//! slot, each group pipelined on that node's connection, and after a `MOVED` or a node that
//! failed, the slot map refreshed and what is left run once more, within the job's deadline.

use crate::cluster::{ClusterState, Node, SlotMap};
use crate::conn::Conn;
use crate::error::{RemoteError, Result};
use crate::format;
use crate::jobs::{self, Ctx};
use crate::queue::{Job, Shared, Work};
use crate::status::{FAILED, PENDING};
use crate::url::Endpoint;
use std::collections::HashMap;
use std::ops::Range;
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
}

/// What one round left to do.
#[derive(Default)]
struct Round {
    /// Run another round: something failed that a newer map may fix.
    refresh: bool,
    /// Some item's slot has no owner in the map.
    unrouted: bool,
    err: Option<RemoteError>,
}

impl NodeConns {
    fn conn(&mut self, sh: &Shared, node: &Node, deadline: Instant) -> Result<&mut Conn> {
        if !self.conns.contains_key(node) {
            let endpoint = Endpoint::Tcp {
                host: node.0.clone(),
                port: node.1,
            };
            let by = deadline.min(Instant::now() + sh.cfg.connect_timeout);
            let c = Conn::connect_to(&sh.target, &endpoint, by)?;
            self.conns.insert(node.clone(), c);
        }
        let c = self.conns.get_mut(node).expect("inserted above");
        c.set_deadline(deadline);
        Ok(c)
    }

    /// Runs the pending items of `items` (their statuses in `st`) node by node with `run`.
    #[allow(clippy::too_many_arguments)]
    fn round<T>(
        &mut self,
        sh: &Shared,
        ctx: &Ctx<'_>,
        map: &SlotMap,
        items: &mut Vec<T>,
        key: impl Fn(&T) -> &[u8],
        st: &mut [u8],
        deadline: Instant,
        mut run: impl FnMut(&mut Conn, &Ctx<'_>, &mut [T], &mut [u8]) -> Result<()>,
    ) -> Round {
        let mut out = Round::default();
        let mut g = group(std::mem::take(items), |i, t| {
            if st[i] != PENDING {
                SKIP
            } else {
                map.owner_of_slot(format::chunk_slot(key(t)))
                    .unwrap_or(UNROUTED)
            }
        });
        for (owner, range) in g.runs.clone() {
            match owner {
                SKIP => continue,
                // A slot no node serves (a map fetched mid-failover): ask for a new one.
                UNROUTED => {
                    out.refresh = true;
                    out.unrouted = true;
                    continue;
                }
                _ => {}
            }
            let node = &map.nodes[owner];
            let mut sub_st = vec![PENDING; range.len()];
            let res = self
                .conn(sh, node, deadline)
                .and_then(|c| run(c, ctx, &mut g.items[range.clone()], &mut sub_st));
            for (k, &s) in sub_st.iter().enumerate() {
                st[g.orig[range.start + k]] = s;
            }
            if let Err(e) = res {
                self.failed(node, e, &mut out);
            }
        }
        *items = ungroup(g);
        out
    }

    /// A node's connection failed: dropped, and the map is asked for again.
    fn failed(&mut self, node: &Node, e: RemoteError, out: &mut Round) {
        if e.breaks_connection() || !matches!(e, RemoteError::Server(_)) {
            self.conns.remove(node);
        }
        out.refresh = true;
        out.err = Some(e);
    }

    /// [`NodeConns::round`] for lookups, pipelined to every node at once: all nodes are asked
    /// before any answer is read, so a lookup over three nodes costs about one round trip.
    fn lookup_round(
        &mut self,
        sh: &Shared,
        ctx: &Ctx<'_>,
        map: &SlotMap,
        keys: &mut Vec<Vec<u8>>,
        st: &mut [u8],
        deadline: Instant,
    ) -> Round {
        let mut out = Round::default();
        let g = group(std::mem::take(keys), |i, k| {
            if st[i] != PENDING {
                SKIP
            } else {
                map.owner_of_slot(format::chunk_slot(k)).unwrap_or(UNROUTED)
            }
        });
        out.unrouted = g.runs.iter().any(|(o, _)| *o == UNROUTED);
        out.refresh = out.unrouted;
        let runs: Vec<(&Node, Range<usize>)> = g
            .runs
            .iter()
            .filter(|(o, _)| *o < UNROUTED)
            .map(|(o, r)| (&map.nodes[*o], r.clone()))
            .collect();
        let mut sub_st: Vec<Vec<u8>> = runs.iter().map(|(_, r)| vec![PENDING; r.len()]).collect();
        let mut touches: Vec<Option<usize>> = vec![Some(0); runs.len()];
        for (j, (node, range)) in runs.iter().enumerate() {
            let sent = self
                .conn(sh, node, deadline)
                .and_then(|c| jobs::lookup_send(c, ctx, &g.items[range.clone()]));
            if let Err(e) = sent {
                touches[j] = None;
                self.failed(node, e, &mut out);
            }
        }
        for phase in 0..2 {
            for (j, (node, range)) in runs.iter().enumerate() {
                let (Some(t), Some(c)) = (touches[j], self.conns.get_mut(*node)) else {
                    continue;
                };
                let res = if phase == 0 {
                    jobs::lookup_read(c, ctx, &g.items[range.clone()], &mut sub_st[j])
                } else {
                    jobs::lookup_finish(c, ctx, t).map(|()| 0)
                };
                match res {
                    Ok(t) => touches[j] = Some(t),
                    Err(e) => {
                        touches[j] = None;
                        self.failed(node, e, &mut out);
                    }
                }
            }
        }
        for ((_, range), sub) in runs.iter().zip(&sub_st) {
            for (k, &s) in sub.iter().enumerate() {
                st[g.orig[range.start + k]] = s;
            }
        }
        *keys = ungroup(g);
        out
    }

    /// Runs `job` (its items still `PENDING` in `st`) across the cluster's primaries.
    pub(crate) fn attempt(
        &mut self,
        sh: &Shared,
        cl: &ClusterState,
        job: &mut Job,
        st: &mut [u8],
        deadline: Instant,
    ) -> Result<()> {
        let mut last = Round::default();
        for round in 0..2 {
            if round == 1 {
                if !last.refresh {
                    break;
                }
                // MOVED answers are applied already; a node that failed needs the whole map.
                if last.err.is_some() || last.unrouted {
                    cl.refresh(&sh.target, sh.cfg.connect_timeout, deadline);
                }
            }
            let map = cl.map();
            let ctx = sh.ctx();
            last = match &mut job.work {
                Work::Lookup(keys) => self.lookup_round(sh, &ctx, &map, keys, st, deadline),
                Work::Store(items) => self.round(
                    sh,
                    &ctx,
                    &map,
                    items,
                    |it| &it.0,
                    st,
                    deadline,
                    |c, x, it, s| jobs::store(c, x, it, s),
                ),
                Work::Load(items) => {
                    self.round(sh, &ctx, &map, items, |it| &it.0, st, deadline, jobs::load)
                }
            };
            let moves = ctx.moved.take();
            if !moves.is_empty() {
                cl.apply_moves(&moves);
                if round == 0 {
                    // The items a node sent on elsewhere failed: they run again on the new
                    // owners (other failures of the job are retried with them; all are
                    // idempotent).
                    last.refresh = true;
                    for s in st.iter_mut().filter(|s| **s == FAILED) {
                        *s = PENDING;
                    }
                }
            }
        }
        let unrouted = st.contains(&PENDING);
        match last.err {
            Some(e) => Err(e),
            None if unrouted => Err(RemoteError::Io(
                "a slot of the job has no primary in the cluster's slot map".into(),
            )),
            None => Ok(()),
        }
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
}
