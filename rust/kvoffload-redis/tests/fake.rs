//! Against a fault-injecting fake server, for what a real one will not do.

mod common;

use common::pattern;
use common::tier::{config, keys, load, lookup, store, NS};
use kvoffload_redis::resp::{self, Head};
use kvoffload_redis::status::*;
use kvoffload_redis::{BreakerState, Tier};
use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Normal,
    /// Every reply byte in its own write.
    Dribble,
    /// GETs are never answered.
    Stall,
    /// GETs are answered with a bad type byte.
    Garbage,
    /// A header value one byte short, as a valid bulk, for keys containing "bad".
    ShortBulk,
    /// A bulk that announces more bytes than it sends, then the connection closes.
    Truncated,
}

#[derive(Clone)]
struct Fake {
    port: u16,
    mode: Arc<Mutex<Mode>>,
    data: Arc<Mutex<HashMap<Vec<u8>, Vec<u8>>>>,
    accepted: Arc<AtomicUsize>,
}

impl Fake {
    fn start() -> Fake {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let f = Fake {
            port: l.local_addr().unwrap().port(),
            mode: Arc::new(Mutex::new(Mode::Normal)),
            data: Arc::default(),
            accepted: Arc::default(),
        };
        let f2 = f.clone();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                f2.accepted.fetch_add(1, Ordering::Relaxed);
                let f3 = f2.clone();
                std::thread::spawn(move || f3.serve(s));
            }
        });
        f
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn set_mode(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }

    fn serve(&self, s: TcpStream) {
        s.set_nodelay(true).unwrap();
        let mut w = s.try_clone().unwrap();
        let mut r = BufReader::new(s);
        let mut line = Vec::new();
        loop {
            let Ok(Head::Array(n)) = resp::read_head(&mut r, &mut line) else {
                return;
            };
            let mut args = Vec::new();
            for _ in 0..n {
                let Ok(Head::Bulk(len)) = resp::read_head(&mut r, &mut line) else {
                    return;
                };
                let Ok(v) = resp::read_bulk_vec(&mut r, len, 1 << 30) else {
                    return;
                };
                args.push(v);
            }
            let mode = *self.mode.lock().unwrap();
            let reply = self.answer(&args, mode);
            let Some(reply) = reply else { continue };
            let ok = if mode == Mode::Dribble {
                reply
                    .iter()
                    .all(|b| w.write_all(std::slice::from_ref(b)).is_ok())
            } else {
                w.write_all(&reply).is_ok()
            };
            if !ok || (mode == Mode::Truncated && args[0] == b"GET") {
                return;
            }
        }
    }

    fn answer(&self, args: &[Vec<u8>], mode: Mode) -> Option<Vec<u8>> {
        let mut data = self.data.lock().unwrap();
        let bulk = |v: &[u8]| {
            let mut out = format!("${}\r\n", v.len()).into_bytes();
            out.extend_from_slice(v);
            out.extend_from_slice(b"\r\n");
            out
        };
        Some(match args[0].as_slice() {
            b"PING" => b"+PONG\r\n".to_vec(),
            b"SET" => {
                if data.contains_key(&args[1]) {
                    b"$-1\r\n".to_vec()
                } else {
                    data.insert(args[1].clone(), args[2].clone());
                    b"+OK\r\n".to_vec()
                }
            }
            b"MSETNX" => {
                let pairs: Vec<_> = args[1..].chunks(2).collect();
                if pairs.iter().any(|kv| data.contains_key(&kv[0])) {
                    b":0\r\n".to_vec()
                } else {
                    for kv in pairs {
                        data.insert(kv[0].clone(), kv[1].clone());
                    }
                    b":1\r\n".to_vec()
                }
            }
            b"GET" => match (mode, data.get(&args[1])) {
                (Mode::Stall, _) => return None,
                (Mode::Garbage, _) => b"?garbage\r\n".to_vec(),
                (Mode::Truncated, Some(v)) => {
                    let mut out = bulk(v);
                    out.truncate(out.len() / 2);
                    out
                }
                (Mode::ShortBulk, Some(v)) if args[1].windows(3).any(|w| w == b"bad") => {
                    bulk(&v[..v.len() - 1])
                }
                (_, Some(v)) => bulk(v),
                (_, None) => b"$-1\r\n".to_vec(),
            },
            b"EXISTS" | b"TOUCH" | b"DEL" => {
                let n = args[1..]
                    .iter()
                    .filter(|k| {
                        if args[0] == b"DEL" {
                            data.remove(*k).is_some()
                        } else {
                            data.contains_key(*k)
                        }
                    })
                    .count();
                format!(":{n}\r\n").into_bytes()
            }
            _ => b"-ERR unknown command\r\n".to_vec(),
        })
    }
}

const CHUNK: usize = 16 * 1024;

fn setup(fake: &Fake, job_timeout_ms: u64) -> (Tier, Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let mut c = config(&fake.url(), CHUNK);
    c.job_timeout = Duration::from_millis(job_timeout_ms);
    c.breaker_failures = 2;
    c.connections = 1;
    let t = Tier::connect(c, NS).unwrap();
    let ks = vec![b"bad-key".to_vec(), b"good-key".to_vec()];
    let data: Vec<_> = (0..2).map(|i| pattern(i + 7, CHUNK)).collect();
    assert_eq!(store(&t, &ks, &data), vec![OK; 2]);
    (t, ks, data)
}

#[test]
fn dribbled_replies_still_work() {
    let fake = Fake::start();
    let (t, ks, data) = setup(&fake, 5000);
    fake.set_mode(Mode::Dribble);
    assert_eq!(lookup(&t, &ks), vec![OK; 2]);
    let (st, bufs) = load(&t, &ks);
    assert_eq!(st, vec![OK; 2]);
    assert!(bufs == data);
    let more = keys("dribble", 3);
    assert_eq!(store(&t, &more, &vec![data[0].clone(); 3]), vec![OK; 3]);
}

#[test]
fn a_stall_fails_the_job_by_its_deadline() {
    let fake = Fake::start();
    let (t, ks, _) = setup(&fake, 200);
    fake.set_mode(Mode::Stall);
    let start = Instant::now();
    assert_eq!(load(&t, &ks).0, vec![FAILED; 2]);
    // Not before its deadline (a lower bound the clock guarantees); the upper bound only says
    // "ended, did not hang": timing itself is measured in benches/bench_remote.py.
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(30),
        "{took:?}"
    );
    assert_eq!(t.stats().timeouts, 1);
}

#[test]
fn garbage_drops_the_connection_and_trips_the_breaker() {
    let fake = Fake::start();
    let (t, ks, data) = setup(&fake, 1000);
    fake.set_mode(Mode::Garbage);
    assert_eq!(load(&t, &ks).0, vec![FAILED; 2]);
    assert_eq!(t.state(), BreakerState::Up);
    assert_eq!(load(&t, &ks).0, vec![FAILED; 2]);
    assert_eq!(t.state(), BreakerState::Down);
    let s = t.stats();
    assert_eq!(
        (s.protocol_errors, s.breaker_opens, s.reconnects),
        (2, 1, 1),
        "{s:?}"
    );
    assert_eq!(fake.accepted.load(Ordering::Relaxed), 2);
    fake.set_mode(Mode::Normal);
    // Half-open after the 2 s cool-down: the next job probes and closes the breaker.
    std::thread::sleep(Duration::from_millis(2100));
    let (st, bufs) = load(&t, &ks);
    assert_eq!(st, vec![OK; 2]);
    assert!(bufs == data);
    assert_eq!(t.state(), BreakerState::Up);
}

#[test]
fn a_bulk_of_the_wrong_length_is_corrupt_and_the_stream_stays_in_sync() {
    let fake = Fake::start();
    let (t, ks, data) = setup(&fake, 1000);
    fake.set_mode(Mode::ShortBulk);
    let (st, bufs) = load(&t, &ks);
    assert_eq!(st, vec![CORRUPT, OK]);
    assert!(bufs[1] == data[1]);
    assert_eq!(t.stats().deleted_corrupt, 1);
    assert_eq!(fake.accepted.load(Ordering::Relaxed), 1);
    assert_eq!(load(&t, &ks).0, vec![MISSING, OK]);
}

#[test]
fn a_truncated_bulk_fails_the_job() {
    let fake = Fake::start();
    let (t, ks, _) = setup(&fake, 1000);
    fake.set_mode(Mode::Truncated);
    assert_eq!(load(&t, &ks).0, vec![FAILED; 2]);
    fake.set_mode(Mode::Normal);
    assert_eq!(load(&t, &ks).0, vec![OK; 2]);
}
