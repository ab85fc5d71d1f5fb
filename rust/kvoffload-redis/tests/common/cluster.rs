//! A local Redis Cluster for tests: 3 primaries and 3 replicas of Debian's redis-server on
//! loopback, formed with `redis-cli --cluster create`, a short node timeout so failover is quick.

use super::{free_port, Reply, Server};
use std::process::Command;
use std::time::{Duration, Instant};

pub const REDIS_CLI: &str = "/usr/bin/redis-cli";

pub struct Cluster {
    pub nodes: Vec<Server>,
}

impl Cluster {
    /// `None` without redis-server (skipped, or a panic under CI=true).
    pub fn start() -> Option<Cluster> {
        if !Server::available() {
            return None;
        }
        let nodes: Vec<Server> = (0..6)
            .map(|_| {
                let bus = free_port().to_string();
                Server::start(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-port",
                    &bus,
                    "--appendonly",
                    "no",
                ])
                .expect("available")
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new(REDIS_CLI)
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli");
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let c = Cluster { nodes };
        c.wait_ok(Duration::from_secs(30));
        Some(c)
    }

    /// Waits until every live node says `cluster_state:ok` and agrees on 3 primaries serving
    /// every slot.
    pub fn wait_ok(&self, within: Duration) {
        let start = Instant::now();
        loop {
            let ok = self.live().all(|n| {
                let Reply::Bulk(info) = n.raw().cmd(&[b"CLUSTER", b"INFO"]) else {
                    return false;
                };
                let text = String::from_utf8_lossy(&info);
                text.contains("cluster_state:ok") && text.contains("cluster_slots_ok:16384")
            });
            if ok {
                return;
            }
            assert!(start.elapsed() < within, "the cluster never became ok");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until every primary's replica has acknowledged all its writes. Just after the
    /// cluster forms, a replica may still be in its first full sync (seconds on a busy machine),
    /// and `WAIT` answers 0 until it is online: asked again, not taken for a lost write.
    pub fn wait_replicated(&self, within: Duration) {
        let start = Instant::now();
        for p in self.primaries() {
            while p.raw().cmd(&[b"WAIT", b"1", b"1000"]) != Reply::Int(1) {
                assert!(
                    start.elapsed() < within,
                    "primary {} has no replica in sync after {within:?}",
                    p.port
                );
            }
        }
    }

    pub fn live(&self) -> impl Iterator<Item = &Server> {
        self.nodes.iter().filter(|n| n.is_running())
    }

    pub fn seed_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.nodes[0].port)
    }

    /// The live node that is primary for `slot`, as the first live node sees the cluster.
    pub fn primary_of(&self, slot: u16) -> &Server {
        let any = self.live().next().expect("a live node");
        let Reply::Array(ranges) = any.raw().cmd(&[b"CLUSTER", b"SLOTS"]) else {
            panic!("CLUSTER SLOTS")
        };
        let port = ranges
            .iter()
            .find_map(|r| match r {
                Reply::Array(f) => match (&f[0], &f[1], &f[2]) {
                    (Reply::Int(a), Reply::Int(b), Reply::Array(p))
                        if *a <= i64::from(slot) && i64::from(slot) <= *b =>
                    {
                        match p.get(1) {
                            Some(Reply::Int(port)) => Some(*port as u16),
                            _ => None,
                        }
                    }
                    _ => None,
                },
                _ => None,
            })
            .expect("the slot is served");
        self.live()
            .find(|n| n.port == port)
            .expect("its primary is live")
    }

    pub fn primaries(&self) -> Vec<&Server> {
        self.live().filter(|n| n.role_is_primary()).collect()
    }

    /// Moves `slot` (and its keys) from its primary to another primary, the way
    /// `redis-cli --cluster reshard` does: IMPORTING / MIGRATING, MIGRATE, then SETSLOT NODE.
    /// With `finish` false it stops half-way, after migrating `keys_first` of its keys.
    pub fn move_slot(&self, slot: u16, finish: bool, keys_first: usize) -> (u16, u16) {
        let from = self.primary_of(slot);
        let to = self
            .primaries()
            .into_iter()
            .find(|n| n.port != from.port)
            .unwrap();
        let s = slot.to_string();
        let id = |n: &Server| match n.raw().cmd(&[b"CLUSTER", b"MYID"]) {
            Reply::Bulk(b) => b,
            r => panic!("MYID {r:?}"),
        };
        let (from_id, to_id) = (id(from), id(to));
        let ok = |r: Reply| assert_eq!(r, Reply::Simple("OK".into()));
        ok(to
            .raw()
            .cmd(&[b"CLUSTER", b"SETSLOT", s.as_bytes(), b"IMPORTING", &from_id]));
        ok(from
            .raw()
            .cmd(&[b"CLUSTER", b"SETSLOT", s.as_bytes(), b"MIGRATING", &to_id]));
        let Reply::Array(keys) =
            from.raw()
                .cmd(&[b"CLUSTER", b"GETKEYSINSLOT", s.as_bytes(), b"1000"])
        else {
            panic!("GETKEYSINSLOT")
        };
        let port = to.port.to_string();
        let take = if finish {
            keys.len()
        } else {
            keys_first.min(keys.len())
        };
        for k in keys.iter().take(take) {
            let Reply::Bulk(k) = k else { panic!() };
            ok(from
                .raw()
                .cmd(&[b"MIGRATE", b"127.0.0.1", port.as_bytes(), k, b"0", b"5000"]));
        }
        if finish {
            for n in self.primaries() {
                ok(n.raw()
                    .cmd(&[b"CLUSTER", b"SETSLOT", s.as_bytes(), b"NODE", &to_id]));
            }
        }
        (from.port, to.port)
    }
}
