//! Test helpers: a real redis-server started per test, a raw client, fill patterns.
#![allow(dead_code)]

pub mod cluster;
pub mod tier;

use kvoffload_redis::resp::{self, Head, Pipeline};
use std::io::BufReader;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub const REDIS: &str = "/usr/bin/redis-server";

pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    l.local_addr().unwrap().port()
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

pub struct Server {
    child: Option<Child>,
    pub port: u16,
    pub dir: PathBuf,
    pub password: Option<String>,
    args: Vec<String>,
}

/// `let Some(s) = server!(args) else { return };`: skips (or panics in CI) without redis-server.
#[macro_export]
macro_rules! server {
    ($($arg:expr),* $(,)?) => {
        common::Server::start(&[$($arg),*])
    };
}

impl Server {
    pub fn available() -> bool {
        if std::path::Path::new(REDIS).exists() {
            return true;
        }
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("{REDIS} is missing and CI=true: install redis-server");
        }
        eprintln!("skipping: {REDIS} is not installed");
        false
    }

    pub fn start(extra: &[&str]) -> Option<Server> {
        if !Self::available() {
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "kvo-remote-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let password = extra
            .windows(2)
            .find(|w| w[0] == "--requirepass")
            .map(|w| w[1].to_string());
        let mut s = Server {
            child: None,
            port: free_port(),
            dir,
            password,
            args: extra.iter().map(|s| s.to_string()).collect(),
        };
        // A port free when asked may be taken by a parallel test's server before ours binds it.
        for _ in 0..5 {
            if s.try_spawn() {
                return Some(s);
            }
            s.kill();
            s.port = free_port();
        }
        panic!("redis-server did not start on 5 free ports");
    }

    pub fn sock(&self) -> PathBuf {
        self.dir.join("redis.sock")
    }

    /// Starts (again) on the same port and socket.
    pub fn spawn(&mut self) {
        assert!(
            self.try_spawn(),
            "redis-server did not start on port {}",
            self.port
        );
    }

    /// Starts the server and waits until it answers; false if it exits first (its port taken)
    /// or does not answer within 10 s.
    fn try_spawn(&mut self) -> bool {
        let child = Command::new(REDIS)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--unixsocket")
            .arg(self.sock())
            .args(["--unixsocketperm", "700"])
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if self.answers() {
                return true;
            }
            let exited = self
                .child
                .as_mut()
                .is_some_and(|c| !matches!(c.try_wait(), Ok(None)));
            if exited {
                self.child = None;
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Whether the server on our port answers PING (after AUTH when it has a password). Any
    /// I/O error is a "no": not listening yet, or a process leaving the port.
    fn answers(&self) -> bool {
        let Ok(stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        if stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .is_err()
        {
            return false;
        }
        let mut r = BufReader::new(stream);
        let mut ask = |args: &[&[u8]]| {
            let mut p = Pipeline::new();
            p.command(args.len());
            for a in args {
                p.arg(a);
            }
            let mut line = Vec::new();
            p.write_to(r.get_mut()).is_ok()
                && matches!(resp::read_head(&mut r, &mut line), Ok(Head::Simple(_)))
        };
        if let Some(password) = &self.password {
            if !ask(&[b"AUTH", password.as_bytes()]) {
                return false;
            }
        }
        ask(&[b"PING"])
    }

    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn try_raw(&self) -> std::io::Result<Raw> {
        let s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut r = Raw {
            r: BufReader::new(s),
        };
        if let Some(p) = &self.password {
            r.cmd(&[b"AUTH", p.as_bytes()]);
        }
        Ok(r)
    }

    pub fn raw(&self) -> Raw {
        self.try_raw().expect("raw connection")
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// `ROLE` says master.
    pub fn role_is_primary(&self) -> bool {
        self.try_raw().is_ok_and(|mut r| {
            matches!(r.cmd(&[b"ROLE"]), Reply::Array(f) if f.first() == Some(&Reply::Bulk(b"master".to_vec())))
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.is_some() {
            // A stopped server ignores SIGKILL until continued? No: SIGKILL always works.
            self.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    Simple(String),
    Error(String),
    Int(i64),
    Nil,
    Bulk(Vec<u8>),
    Array(Vec<Reply>),
}

/// A plain connection for planting and inspecting values.
pub struct Raw {
    r: BufReader<TcpStream>,
}

impl Raw {
    pub fn cmd(&mut self, args: &[&[u8]]) -> Reply {
        let mut p = Pipeline::new();
        p.command(args.len());
        for a in args {
            p.arg(a);
        }
        p.write_to(self.r.get_mut()).unwrap();
        self.reply()
    }

    fn reply(&mut self) -> Reply {
        let mut line = Vec::new();
        match resp::read_head(&mut self.r, &mut line).unwrap() {
            Head::Simple(s) => Reply::Simple(String::from_utf8(s).unwrap()),
            Head::Error(e) => Reply::Error(e),
            Head::Int(n) => Reply::Int(n),
            Head::Nil => Reply::Nil,
            Head::Bulk(n) => Reply::Bulk(resp::read_bulk_vec(&mut self.r, n, 1 << 30).unwrap()),
            Head::Array(n) => Reply::Array((0..n).map(|_| self.reply()).collect()),
        }
    }

    pub fn int(&mut self, args: &[&[u8]]) -> i64 {
        match self.cmd(args) {
            Reply::Int(n) => n,
            r => panic!("{args:?}: {r:?}"),
        }
    }

    pub fn info_field(&mut self, section: &str, field: &str) -> u64 {
        let Reply::Bulk(b) = self.cmd(&[b"INFO", section.as_bytes()]) else {
            panic!("INFO")
        };
        let text = String::from_utf8(b).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .unwrap_or_else(|| panic!("no {field}"))
            .trim()
            .parse()
            .unwrap()
    }
}

/// Deterministic, key-dependent content.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn redis_key(ns: &[u8; 16], key: &[u8], part: &str) -> Vec<u8> {
    let part = match part {
        "h" => kvoffload_redis::format::Part::Header,
        "b" => kvoffload_redis::format::Part::Body,
        p => panic!("no part {p:?}"),
    };
    let mut k = Vec::new();
    kvoffload_redis::format::redis_key(&mut k, ns, key, part);
    k
}
