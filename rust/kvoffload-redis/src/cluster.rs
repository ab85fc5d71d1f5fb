//! Redis Cluster: which node owns a key's slot, the slot map from `CLUSTER SLOTS`, and its
//! refresh (after `MOVED` or a node that fails), rate-limited and from any node that answers.

use crate::conn::{Conn, Target};
use crate::error::{RemoteError, Result};
use crate::resp::Value;
use crate::slot::{chunk_slot, slot, SLOTS};
use crate::url::Endpoint;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A refresh at most this often, however many jobs ask for one.
const REFRESH_EVERY: Duration = Duration::from_millis(100);
/// More primaries than Redis Cluster supports (about 1,000) is garbage; a node index must also
/// stay below the `u16::MAX` that marks a slot without an owner.
const MAX_NODES: usize = 16_384;

/// A primary node, by the address the cluster announces.
pub type Node = (String, u16);

/// A node's name in logs and metrics: `host:port` (`[v6 address]:port`).
pub fn node_name(node: &Node) -> String {
    Endpoint::Tcp {
        host: node.0.clone(),
        port: node.1,
    }
    .to_string()
}

/// Which primary serves each slot.
#[derive(Debug)]
pub struct SlotMap {
    pub nodes: Vec<Node>,
    /// Index into `nodes` per slot; `u16::MAX` for a slot no node serves.
    owner: Vec<u16>,
}

impl SlotMap {
    pub fn node_of(&self, key: &[u8]) -> Option<usize> {
        self.owner_of_slot(slot(key))
    }

    pub fn owner_of_slot(&self, slot: u16) -> Option<usize> {
        match self.owner[usize::from(slot)] {
            u16::MAX => None,
            i => Some(usize::from(i)),
        }
    }

    /// The index of `node`, added if new; `None` past `MAX_NODES`.
    fn index_of(&mut self, node: &Node) -> Option<u16> {
        if let Some(i) = self.nodes.iter().position(|n| n == node) {
            return Some(i as u16);
        }
        if self.nodes.len() >= MAX_NODES {
            return None;
        }
        self.nodes.push(node.clone());
        Some((self.nodes.len() - 1) as u16)
    }

    /// A map with no node: every job asks for a new one (a cluster unreachable at start-up).
    pub fn empty() -> SlotMap {
        SlotMap {
            nodes: Vec::new(),
            owner: vec![u16::MAX; SLOTS],
        }
    }

    /// From a `CLUSTER SLOTS` reply: `[[start, end, [host, port, id, ...], replicas...], ...]`.
    /// A primary announced with a nil or empty host (`cluster-preferred-endpoint-type
    /// unknown-endpoint`) is at `default_host`, the node we asked; one announced as `?` (a
    /// hostname it does not know) cannot be reached: its slots stay without an owner.
    pub fn parse(reply: Value, default_host: &str) -> Result<SlotMap> {
        let bad = |why: &str| RemoteError::Protocol(format!("CLUSTER SLOTS reply: {why}"));
        let Value::Array(ranges) = reply else {
            return Err(match reply {
                Value::Error(m) => RemoteError::Server(format!("CLUSTER SLOTS: {m}")),
                _ => bad("not an array"),
            });
        };
        let mut map = SlotMap {
            nodes: Vec::new(),
            owner: vec![u16::MAX; SLOTS],
        };
        if ranges.len() > SLOTS {
            return Err(bad(&format!("{} ranges for {SLOTS} slots", ranges.len())));
        }
        for range in ranges {
            let Value::Array(fields) = range else {
                return Err(bad("a range is not an array"));
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(primary))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err(bad("a range lacks start, end or primary"));
            };
            let (start, end) = (*start, *end);
            if !(0 <= start && start <= end && end < SLOTS as i64) {
                return Err(bad(&format!("slot range {start}..={end}")));
            }
            let host = match primary.first() {
                Some(Value::Nil) => default_host.to_string(),
                Some(Value::Bulk(h)) if h.is_empty() => default_host.to_string(),
                Some(Value::Bulk(h)) if h == b"?" => continue,
                Some(Value::Bulk(h)) => {
                    String::from_utf8(h.clone()).map_err(|_| bad("a host is not UTF-8"))?
                }
                _ => return Err(bad("a primary lacks its host")),
            };
            let port = match primary.get(1) {
                Some(Value::Int(p)) if (1..=65535).contains(p) => *p as u16,
                _ => return Err(bad("a primary lacks a valid port")),
            };
            let idx = map
                .index_of(&(host, port))
                .ok_or_else(|| bad("too many nodes"))?;
            for s in start..=end {
                map.owner[s as usize] = idx;
            }
        }
        if map.nodes.is_empty() {
            return Err(bad("no slot is served"));
        }
        Ok(map)
    }
}

/// How many of the chunks `keys` each of `nodes` primaries serves, the slots split among them in
/// equal contiguous ranges (as `redis-cli --cluster create` splits them): for the simulator.
pub fn node_counts(keys: &[&[u8]], nodes: usize) -> Vec<u64> {
    let nodes = nodes.max(1);
    let mut counts = vec![0u64; nodes];
    for key in keys {
        let slot = usize::from(chunk_slot(key));
        counts[slot * nodes / SLOTS] += 1;
    }
    counts
}

/// `MOVED <slot> <host>:<port>` (or `ASK ...`, with `kind` "ASK"): the slot and its owner now,
/// or the node its keys are moving to (`None` when the answer names no host, as with
/// `cluster-preferred-endpoint-type unknown-endpoint`).
pub fn parse_redirect(msg: &str, kind: &str) -> Option<(u16, Option<Node>)> {
    let mut words = msg.strip_prefix(kind)?.strip_prefix(' ')?.split(' ');
    let slot = words
        .next()?
        .parse::<u16>()
        .ok()
        .filter(|&s| usize::from(s) < SLOTS)?;
    let owner = words.next().and_then(|w| {
        let (host, port) = w.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port = port.parse::<u16>().ok().filter(|&p| p != 0)?;
        (!host.is_empty() && host != "?").then(|| (host.to_string(), port))
    });
    Some((slot, owner))
}

/// Asks `conn` for the slot map.
pub fn fetch(conn: &mut Conn, host: &str) -> Result<SlotMap> {
    let mut p = crate::resp::Pipeline::new();
    p.command(2).arg(b"CLUSTER").arg(b"SLOTS");
    conn.send(&p)?;
    SlotMap::parse(conn.value()?, host)
}

/// Whether the server runs in cluster mode (`INFO cluster`'s `cluster_enabled:1`).
pub fn enabled(conn: &mut Conn) -> Result<bool> {
    let mut p = crate::resp::Pipeline::new();
    p.command(2).arg(b"INFO").arg(b"cluster");
    conn.send(&p)?;
    match conn.value()? {
        Value::Bulk(text) => Ok(String::from_utf8_lossy(&text)
            .lines()
            .any(|l| l.trim() == "cluster_enabled:1")),
        Value::Error(m) => Err(RemoteError::Server(format!("INFO cluster: {m}"))),
        v => Err(RemoteError::Protocol(format!("INFO cluster gave {v:?}"))),
    }
}

/// The map every worker routes by, and its refresh.
pub struct ClusterState {
    map: Mutex<Arc<SlotMap>>,
    last_refresh: Mutex<Option<Instant>>,
    /// Something showed the map may be out of date (a node failed, a slot had no owner): the
    /// next job asks for a new one before it runs.
    stale: AtomicBool,
    /// Nodes that failed, left alone by every worker (and asked last for a map) until then: a
    /// node of its own breaker, so one that hangs costs one job's deadline, not every job's.
    resting: Mutex<HashMap<Node, Instant>>,
    /// The URL's seed nodes, asked when no node of the map answers.
    seeds: Vec<Node>,
}

impl ClusterState {
    pub fn new(map: SlotMap, seeds: Vec<Node>) -> ClusterState {
        // An empty map (nobody answered at start-up) may be refreshed at once.
        let fetched = (!map.nodes.is_empty()).then(Instant::now);
        ClusterState {
            resting: Mutex::new(HashMap::new()),
            stale: AtomicBool::new(fetched.is_none()),
            map: Mutex::new(Arc::new(map)),
            last_refresh: Mutex::new(fetched),
            seeds,
        }
    }

    pub fn map(&self) -> Arc<SlotMap> {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes the owners that `MOVED` answers named, at once (no round trip); an answer that
    /// names none makes the map stale.
    pub fn apply_moves(&self, moves: &[(u16, Option<Node>)]) {
        let mut guard = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let mut map = SlotMap {
            nodes: guard.nodes.clone(),
            owner: guard.owner.clone(),
        };
        for (slot, node) in moves {
            match node.as_ref().and_then(|n| map.index_of(n)) {
                Some(idx) => map.owner[usize::from(*slot)] = idx,
                None => self.mark_stale(),
            }
        }
        *guard = Arc::new(map);
    }

    /// `node` failed: left alone for `cooldown`, and the map asked for anew.
    pub fn rest(&self, node: &Node, cooldown: Duration) {
        let mut r = self.resting.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        r.retain(|_, until| *until > now);
        r.insert(node.clone(), now + cooldown);
        drop(r);
        self.mark_stale();
    }

    /// The names of the nodes resting now.
    pub fn resting_names(&self) -> Vec<String> {
        let r = self.resting.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        r.iter()
            .filter(|(_, &until)| now < until)
            .map(|(n, _)| node_name(n))
            .collect()
    }

    pub fn is_resting(&self, node: &Node) -> bool {
        let r = self.resting.lock().unwrap_or_else(|p| p.into_inner());
        r.get(node).is_some_and(|&until| Instant::now() < until)
    }

    pub fn mark_stale(&self) {
        self.stale.store(true, Ordering::Relaxed);
    }

    pub fn is_stale(&self) -> bool {
        self.stale.load(Ordering::Relaxed)
    }

    /// Asks the map's nodes and the seeds (resting ones last) for a new map, unless one was
    /// fetched in the last `REFRESH_EVERY`; a node that fails to answer rests for `cooldown`.
    /// True if the map was replaced.
    pub fn refresh(
        &self,
        target: &Target,
        connect_timeout: Duration,
        deadline: Instant,
        cooldown: Duration,
    ) -> bool {
        {
            let mut last = self.last_refresh.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|t| t.elapsed() < REFRESH_EVERY) {
                return false;
            }
            *last = Some(Instant::now());
        }
        let current = self.map();
        let (bad, good): (Vec<&Node>, Vec<&Node>) = current
            .nodes
            .iter()
            .chain(&self.seeds)
            .partition(|n| self.is_resting(n));
        for (host, port) in good.into_iter().chain(bad) {
            let by = deadline.min(Instant::now() + connect_timeout);
            if Instant::now() >= by {
                return false;
            }
            let endpoint = Endpoint::Tcp {
                host: host.clone(),
                port: *port,
            };
            let got = Conn::connect_to(target, &endpoint, by).and_then(|mut c| fetch(&mut c, host));
            match got {
                Ok(map) => {
                    *self.map.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(map);
                    self.stale.store(false, Ordering::Relaxed);
                    return true;
                }
                Err(_) => self.rest(&(host.clone(), *port), cooldown),
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_counts_split_the_slots_evenly() {
        let keys: Vec<Vec<u8>> = (0..30_000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
        assert_eq!(node_counts(&refs, 1), vec![30_000]);
        let three = node_counts(&refs, 3);
        assert_eq!(three.iter().sum::<u64>(), 30_000);
        assert!(
            three.iter().all(|&c| (9_500..10_500).contains(&c)),
            "{three:?}"
        );
        // The node of a key is the owner of its chunk's slot.
        let one: &[u8] = b"chunk";
        let want = usize::from(chunk_slot(one)) * 4 / SLOTS;
        assert_eq!(node_counts(&[one], 4)[want], 1);
    }

    #[test]
    fn moved_and_ask_answers() {
        let node = |h: &str, p: u16| Some((h.to_string(), p));
        let parse_moved = |m: &str| parse_redirect(m, "MOVED");
        assert_eq!(
            parse_moved("MOVED 3999 127.0.0.1:6381"),
            Some((3999, node("127.0.0.1", 6381)))
        );
        assert_eq!(
            parse_moved("MOVED 1 [::1]:7000"),
            Some((1, node("::1", 7000)))
        );
        // Moved, to a node whose name the answer does not give: fetch the map anew.
        assert_eq!(parse_moved("MOVED 1 :7000"), Some((1, None)));
        assert_eq!(parse_moved("MOVED 1 h"), Some((1, None)));
        for bad in [
            "MOVED 16384 h:1",
            "MOVED x h:1",
            "ASK 1 h:1",
            "MOVEDX 1 h:1",
        ] {
            assert_eq!(parse_moved(bad), None, "{bad}");
        }
        assert_eq!(
            parse_redirect("ASK 12 10.0.0.7:6379", "ASK"),
            Some((12, node("10.0.0.7", 6379)))
        );
        assert_eq!(parse_redirect("MOVED 12 h:1", "ASK"), None);
    }

    #[test]
    fn parses_cluster_slots() {
        let node = |h: &str, p: i64| {
            Value::Array(vec![
                Value::Bulk(h.as_bytes().to_vec()),
                Value::Int(p),
                Value::Bulk(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("10.0.0.1", 7000),
                node("10.0.0.4", 7003),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(10922), node("", 7001)]),
            Value::Array(vec![
                Value::Int(10923),
                Value::Int(16383),
                node("10.0.0.1", 7000),
            ]),
        ]);
        let m = SlotMap::parse(reply, "seed").unwrap();
        assert_eq!(
            m.nodes,
            vec![("10.0.0.1".into(), 7000), ("seed".into(), 7001)]
        );
        assert_eq!(m.node_of(b"foo"), Some(0)); // slot 12182
        assert_eq!(m.node_of(b"bar"), Some(0)); // slot 5061
        assert_eq!((m.owner[5460], m.owner[5461], m.owner[10922]), (0, 1, 1));
        for bad in [
            Value::Array(vec![]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(16384),
                node("h", 1),
            ])]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(1),
                node("h", 0),
            ])]),
            Value::Int(3),
        ] {
            assert!(SlotMap::parse(bad, "s").is_err());
        }
        // A nil or empty host is the node asked; "?" cannot be reached.
        let odd = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                Value::Array(vec![Value::Nil, Value::Int(7000)]),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(10922), node("?", 7001)]),
        ]);
        let m = SlotMap::parse(odd, "seed").unwrap();
        assert_eq!(m.nodes, vec![("seed".into(), 7000)]);
        assert_eq!((m.owner_of_slot(0), m.owner_of_slot(6000)), (Some(0), None));
        let partial = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(10),
            node("h", 1),
        ])]);
        assert_eq!(SlotMap::parse(partial, "s").unwrap().node_of(b"foo"), None);
    }
}
