//! Redis Cluster: which node owns a key's slot, the slot map from `CLUSTER SLOTS`, and its
//! refresh (after `MOVED` or a node that fails), rate-limited and from any node that answers.

use crate::conn::{Conn, Target};
use crate::error::{RemoteError, Result};
use crate::resp::Value;
use crate::url::Endpoint;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const SLOTS: usize = 16384;
/// A refresh at most this often, however many jobs ask for one.
const REFRESH_EVERY: Duration = Duration::from_millis(100);

/// CRC16-XMODEM, as Redis Cluster hashes keys.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slot of `key`: of its `{hash tag}` when it has a non-empty one, as Redis computes it.
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter()
            .position(|&b| b == b'}')
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS as u16
}

/// A primary node, by the address the cluster announces.
pub type Node = (String, u16);

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

    /// A map with no node: every job asks for a new one (a cluster unreachable at start-up).
    pub fn empty() -> SlotMap {
        SlotMap {
            nodes: Vec::new(),
            owner: vec![u16::MAX; SLOTS],
        }
    }

    /// From a `CLUSTER SLOTS` reply: `[[start, end, [host, port, id, ...], replicas...], ...]`.
    /// A primary announced with an empty host is at `default_host` (the node we asked).
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
                Some(Value::Bulk(h)) if h.is_empty() || h == b"?" => default_host.to_string(),
                Some(Value::Bulk(h)) => {
                    String::from_utf8(h.clone()).map_err(|_| bad("a host is not UTF-8"))?
                }
                _ => return Err(bad("a primary lacks its host")),
            };
            let port = match primary.get(1) {
                Some(Value::Int(p)) if (1..=65535).contains(p) => *p as u16,
                _ => return Err(bad("a primary lacks a valid port")),
            };
            let node = (host, port);
            let idx = match map.nodes.iter().position(|n| *n == node) {
                Some(i) => i,
                None => {
                    map.nodes.push(node);
                    map.nodes.len() - 1
                }
            };
            for s in start..=end {
                map.owner[s as usize] = idx as u16;
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
        let slot = usize::from(crate::format::chunk_slot(key));
        counts[slot * nodes / SLOTS] += 1;
    }
    counts
}

/// `MOVED <slot> <host>:<port>`: the slot and its owner now.
pub fn parse_moved(msg: &str) -> Option<(u16, Node)> {
    let mut words = msg.strip_prefix("MOVED ")?.split(' ');
    let slot = words
        .next()?
        .parse::<u16>()
        .ok()
        .filter(|&s| usize::from(s) < SLOTS)?;
    let (host, port) = words.next()?.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then_some(())?;
    Some((slot, (host.to_string(), port.parse().ok()?)))
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
    /// The URL's seed nodes, asked when no node of the map answers.
    seeds: Vec<Node>,
}

impl ClusterState {
    pub fn new(map: SlotMap, seeds: Vec<Node>) -> ClusterState {
        // An empty map (nobody answered at start-up) may be refreshed at once.
        let fetched = (!map.nodes.is_empty()).then(Instant::now);
        ClusterState {
            map: Mutex::new(Arc::new(map)),
            last_refresh: Mutex::new(fetched),
            seeds,
        }
    }

    pub fn map(&self) -> Arc<SlotMap> {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes the owners that `MOVED` answers named, at once (no round trip).
    pub fn apply_moves(&self, moves: &[(u16, Node)]) {
        let mut guard = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let mut map = SlotMap {
            nodes: guard.nodes.clone(),
            owner: guard.owner.clone(),
        };
        for (slot, node) in moves {
            let idx = match map.nodes.iter().position(|n| n == node) {
                Some(i) => i,
                None => {
                    map.nodes.push(node.clone());
                    map.nodes.len() - 1
                }
            };
            map.owner[usize::from(*slot)] = idx as u16;
        }
        *guard = Arc::new(map);
    }

    /// Asks the map's nodes, then the seeds, for a new map, unless one was fetched in the last
    /// `REFRESH_EVERY`. True if the map was replaced.
    pub fn refresh(&self, target: &Target, connect_timeout: Duration, deadline: Instant) -> bool {
        {
            let mut last = self.last_refresh.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|t| t.elapsed() < REFRESH_EVERY) {
                return false;
            }
            *last = Some(Instant::now());
        }
        let current = self.map();
        let candidates = current.nodes.iter().chain(&self.seeds);
        for (host, port) in candidates {
            let by = deadline.min(Instant::now() + connect_timeout);
            if Instant::now() >= by {
                return false;
            }
            let endpoint = Endpoint::Tcp {
                host: host.clone(),
                port: *port,
            };
            let got = Conn::connect_to(target, &endpoint, by).and_then(|mut c| fetch(&mut c, host));
            if let Ok(map) = got {
                *self.map.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(map);
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_as_redis_computes_them() {
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        // An empty tag, or none closed, hashes the whole key.
        assert_eq!(slot(b"{}foo"), crc16(b"{}foo") % 16384);
        assert_eq!(slot(b"{foo"), crc16(b"{foo") % 16384);
        // Only the first '{' opens the tag.
        assert_eq!(slot(b"a{b}{c}"), slot(b"b"));
    }

    #[test]
    fn every_part_of_every_shard_of_a_chunk_is_in_one_slot() {
        use crate::format::{redis_key, Part};
        let mut k = Vec::new();
        let mut slots = Vec::new();
        // Namespace digests holding braces do not move the tag.
        for ns in [[b'{'; 16], [b'}'; 16], *b"rank-0-namespace"] {
            for part in [Part::Header, Part::Body] {
                redis_key(&mut k, &ns, b"block-hash-and-group", part);
                slots.push(slot(&k));
            }
        }
        assert!(slots.iter().all(|&s| s == slots[0]), "{slots:?}");
        redis_key(&mut k, b"rank-0-namespace", b"another-chunk", Part::Header);
        assert_ne!(slot(&k), slots[0]);
        assert!(k.starts_with(b"kvo2:{"), "{k:?}");
        assert_eq!(k[22], b'}');
    }

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
        let want = usize::from(crate::format::chunk_slot(one)) * 4 / SLOTS;
        assert_eq!(node_counts(&[one], 4)[want], 1);
    }

    #[test]
    fn moved_answers() {
        assert_eq!(
            parse_moved("MOVED 3999 127.0.0.1:6381"),
            Some((3999, ("127.0.0.1".into(), 6381)))
        );
        assert_eq!(
            parse_moved("MOVED 1 [::1]:7000"),
            Some((1, ("::1".into(), 7000)))
        );
        for bad in [
            "MOVED 16384 h:1",
            "MOVED 1 :7000",
            "MOVED x h:1",
            "ASK 1 h:1",
            "MOVED 1 h",
        ] {
            assert_eq!(parse_moved(bad), None, "{bad}");
        }
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
        let partial = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(10),
            node("h", 1),
        ])]);
        assert_eq!(SlotMap::parse(partial, "s").unwrap().node_of(b"foo"), None);
    }
}
