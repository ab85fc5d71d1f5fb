//! Running one job on one connection: pipelined lookups, stores and loads.
//!
//! Each function sends all of a job's commands, then reads the replies in order. A data problem
//! (missing or corrupt value, an error reply) settles one item and the stream stays in sync; an
//! `Err` means the connection is unusable or the deadline passed, and the caller fails the items
//! still `PENDING`.

use crate::conn::Conn;
use crate::error::{RemoteError, Result};
use crate::format::{self, Header, Layout, Part, HEADER_LEN};
use crate::resp::{Head, Pipeline};
use crate::stats::Counters;
use kvoffload_tier::buf::{RawBuf, RawBufMut};
use kvoffload_tier::status::{CORRUPT, EXISTS, FAILED, MISSING, OK, PENDING};
use std::sync::Mutex;

pub(crate) struct Ctx<'a> {
    pub layout: Layout,
    pub ns: &'a [u8; 16],
    pub lookup_ns: &'a [[u8; 16]],
    pub ttl_ms: Option<u64>,
    pub touch_on_hit: bool,
    /// A Redis Cluster: a command's keys must share one slot (one chunk's).
    pub cluster: bool,
    /// The `ASK` answers seen (slot, the node its keys went to): a migrating slot's chunk is
    /// asked again there, after `ASKING`, once.
    pub asked: std::cell::RefCell<Vec<(u16, Option<crate::cluster::Node>)>>,
    /// Error replies other than redirects (OOM, READONLY, CLUSTERDOWN, TRYAGAIN, ...): the
    /// node refused them, counted in its per-node `failures`.
    pub refused: std::cell::Cell<u64>,
    /// The `MOVED` answers seen (slot, new owner): the slot map is stale there.
    /// (`None`: an owner we cannot reach by its announced name; the map must be fetched anew.)
    pub moved: std::cell::RefCell<Vec<(u16, Option<crate::cluster::Node>)>>,
    pub stats: &'a Counters,
    pub last_error: &'a Mutex<Option<String>>,
}

/// Keeps `why` as the tier's last failure reason, for `Tier::last_error`.
pub(crate) fn note(slot: &Mutex<Option<String>>, why: String) {
    // A plain value, valid whatever a panicking holder was doing.
    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
}

/// A key for messages: a short hex prefix, since keys are binary and may be long.
pub(crate) fn key_hint(key: &[u8]) -> String {
    let mut s: String = key.iter().take(8).map(|b| format!("{b:02x}")).collect();
    if key.len() > 8 {
        s.push_str("..");
    }
    s
}

impl Ctx<'_> {
    fn key(&self, buf: &mut Vec<u8>, key: &[u8], part: Part) {
        format::redis_key(buf, self.ns, key, part)
    }

    fn parts(&self) -> &'static [Part] {
        if self.layout.split {
            &[Part::Header, Part::Body]
        } else {
            &[Part::Header]
        }
    }

    /// Each Redis key of every shard of chunk `key`, in `buf`.
    fn each_shard_key(&self, buf: &mut Vec<u8>, key: &[u8], mut f: impl FnMut(&[u8])) {
        for ns in self.lookup_ns {
            for &part in self.parts() {
                format::redis_key(buf, ns, key, part);
                f(buf);
            }
        }
    }

    /// An error reply settles one item; the connection is fine, so the breaker does not count it.
    fn server_error(&self, msg: &str) {
        if let Some(m) = crate::cluster::parse_redirect(msg, "MOVED") {
            self.moved.borrow_mut().push(m);
        } else if let Some(a) = crate::cluster::parse_redirect(msg, "ASK") {
            self.asked.borrow_mut().push(a);
        } else {
            self.refused.set(self.refused.get() + 1);
        }
        Counters::add(&self.stats.server_errors, 1);
        self.note(RemoteError::Server(msg.to_string()).to_string());
    }

    fn note(&self, why: String) {
        note(self.last_error, why)
    }
}

fn unexpected(what: &str, h: Head) -> RemoteError {
    RemoteError::Protocol(format!("unexpected reply to {what}: {h:?}"))
}

/// `cmd` (`TOUCH`, `DEL`) over the keys of `n` chunks, `keys_of(i, k, push)` giving chunk `i`'s
/// keys: one command, or in a cluster one per chunk (a command's keys must share one slot).
/// Returns how many of its commands the server refused (each counted and noted).
fn keyed_command(
    conn: &mut Conn,
    ctx: &Ctx<'_>,
    cmd: &'static [u8],
    n: usize,
    keys_per_chunk: usize,
    keys_of: impl FnMut(usize, &mut Vec<u8>, &mut dyn FnMut(&[u8])),
) -> Result<usize> {
    let sent = send_keyed(conn, ctx, cmd, n, keys_per_chunk, keys_of)?;
    read_refusals(conn, ctx, cmd, sent)
}

/// The sending half of [`keyed_command`]: how many commands went out.
fn send_keyed(
    conn: &mut Conn,
    ctx: &Ctx<'_>,
    cmd: &'static [u8],
    n: usize,
    keys_per_chunk: usize,
    mut keys_of: impl FnMut(usize, &mut Vec<u8>, &mut dyn FnMut(&[u8])),
) -> Result<usize> {
    let mut p = conn.pipeline();
    let mut k = Vec::new();
    let commands = if ctx.cluster { n } else { 1 };
    for c in 0..commands {
        let chunks = if ctx.cluster { c..c + 1 } else { 0..n };
        p.command(1 + chunks.len() * keys_per_chunk).arg(cmd);
        for i in chunks {
            keys_of(i, &mut k, &mut |key| {
                p.arg(key);
            });
        }
    }
    conn.send(&p)?;
    Ok(commands)
}

/// The replies of `commands` integer commands: how many the server refused.
fn read_refusals(
    conn: &mut Conn,
    ctx: &Ctx<'_>,
    cmd: &'static [u8],
    commands: usize,
) -> Result<usize> {
    let mut refused = 0;
    for _ in 0..commands {
        if let Err(m) = read_int(conn, std::str::from_utf8(cmd).unwrap_or("command"))? {
            ctx.server_error(&m);
            refused += 1;
        }
    }
    Ok(refused)
}

fn read_int(conn: &mut Conn, what: &str) -> Result<std::result::Result<i64, String>> {
    match conn.simple()? {
        Head::Int(n) => Ok(Ok(n)),
        Head::Error(m) => Ok(Err(m)),
        h => Err(unexpected(what, h)),
    }
}

pub(crate) fn lookup(
    conn: &mut Conn,
    ctx: &Ctx<'_>,
    keys: &[Vec<u8>],
    st: &mut [u8],
) -> Result<()> {
    lookup_send(conn, ctx, keys)?;
    let touches = lookup_read(conn, ctx, keys, st)?;
    lookup_finish(conn, ctx, touches)
}

/// A lookup in three halves, so that a cluster's nodes can all be asked before any answer is
/// read: the `EXISTS` commands out; ...
pub(crate) fn lookup_send(conn: &mut Conn, ctx: &Ctx<'_>, keys: &[Vec<u8>]) -> Result<()> {
    // One EXISTS per chunk over every part of every shard: a chunk counts only whole, so a
    // shard evicted on one rank is a miss here, not a promotion that fails.
    let parts = ctx.lookup_ns.len() * ctx.parts().len();
    let mut p = conn.pipeline();
    let mut k = Vec::new();
    for key in keys {
        p.command(1 + parts).arg(b"EXISTS");
        ctx.each_shard_key(&mut k, key, |k| {
            p.arg(k);
        });
    }
    conn.send(&p)?;
    Ok(())
}

/// ... their answers in, and `TOUCH` of the hits out (how many `TOUCH` commands); ...
pub(crate) fn lookup_read(
    conn: &mut Conn,
    ctx: &Ctx<'_>,
    keys: &[Vec<u8>],
    st: &mut [u8],
) -> Result<usize> {
    let parts = ctx.lookup_ns.len() * ctx.parts().len();
    let mut hits = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        st[i] = match read_int(conn, "EXISTS")? {
            Ok(n) if n == parts as i64 => {
                hits.push(key);
                OK
            }
            Ok(n) if (0..parts as i64).contains(&n) => MISSING,
            Ok(n) => {
                return Err(RemoteError::Protocol(format!(
                    "EXISTS of {parts} keys gave {n}"
                )))
            }
            Err(m) => {
                ctx.server_error(&m);
                FAILED
            }
        };
    }
    Counters::add(&ctx.stats.lookup_keys, keys.len() as u64);
    Counters::add(&ctx.stats.lookup_hits, hits.len() as u64);
    if !ctx.touch_on_hit || hits.is_empty() {
        return Ok(0);
    }
    // EXISTS leaves the LRU clock alone; without this a hot prefix is evicted like a cold one.
    // Every shard's keys: touching one rank's alone leaves the others to age out first.
    send_keyed(conn, ctx, b"TOUCH", hits.len(), parts, |i, k, push| {
        ctx.each_shard_key(k, hits[i], |key| push(key));
    })
}

/// ... and the `TOUCH` answers in.
pub(crate) fn lookup_finish(conn: &mut Conn, ctx: &Ctx<'_>, touches: usize) -> Result<()> {
    read_refusals(conn, ctx, b"TOUCH", touches).map(|_| ())
}

fn set_ok(conn: &mut Conn) -> Result<std::result::Result<bool, String>> {
    match conn.simple()? {
        Head::Simple(s) if s == b"OK" => Ok(Ok(true)),
        Head::Nil => Ok(Ok(false)),
        Head::Error(m) => Ok(Err(m)),
        h => Err(unexpected("SET", h)),
    }
}

pub(crate) fn store(
    conn: &mut Conn,
    ctx: &Ctx<'_>,
    items: &[(Vec<u8>, RawBuf)],
    st: &mut [u8],
) -> Result<()> {
    let lay = ctx.layout;
    let headers: Vec<[u8; HEADER_LEN]> = items
        .iter()
        .map(|(key, buf)| Header::for_chunk(&lay, ctx.ns, key, buf.slice()).encode())
        .collect();
    let all: Vec<usize> = (0..items.len()).collect();
    let written = write_pairs(conn, ctx, items, &headers, &all)?;
    // A split chunk refused because its body part alone is there (its header was evicted:
    // allkeys-lru takes parts one by one) would be refused forever: clear it, write once more.
    let orphans = if lay.split {
        orphan_bodies(conn, ctx, items, &all, &written)?
    } else {
        Vec::new()
    };
    let mut outcome = written;
    if !orphans.is_empty() {
        keyed_command(conn, ctx, b"DEL", orphans.len(), 1, |i, k, push| {
            ctx.key(k, &items[orphans[i]].0, Part::Body);
            push(k);
        })?;
        let again = write_pairs(conn, ctx, items, &headers, &orphans)?;
        for (&i, w) in orphans.iter().zip(again) {
            outcome[i] = w;
        }
    }
    let (mut ok, mut exists, mut failed) = (0u64, 0u64, 0u64);
    for (i, w) in outcome.into_iter().enumerate() {
        st[i] = match w {
            Ok(true) => OK,
            Ok(false) => EXISTS,
            Err(m) => {
                ctx.server_error(&m);
                FAILED
            }
        };
        match st[i] {
            OK => ok += 1,
            EXISTS => exists += 1,
            _ => failed += 1,
        }
    }
    Counters::add(&ctx.stats.stored_chunks, ok);
    Counters::add(&ctx.stats.store_exists, exists);
    Counters::add(&ctx.stats.store_failures, failed);
    Counters::add(&ctx.stats.bytes_written, ok * lay.chunk_bytes as u64);
    Ok(())
}

/// Writes items `which`, each only if absent: one `SET NX` per unsplit chunk, one `MSETNX` of
/// both parts per split one, so two writers of a chunk never pair one's header with the other's
/// body (the first wins both parts, atomically). Per item: written, already there, or the
/// server's error reply.
fn write_pairs(
    conn: &mut Conn,
    ctx: &Ctx<'_>,
    items: &[(Vec<u8>, RawBuf)],
    headers: &[[u8; HEADER_LEN]],
    which: &[usize],
) -> Result<Vec<std::result::Result<bool, String>>> {
    let lay = ctx.layout;
    let ttl = ctx.ttl_ms.map(|t| t.to_string());
    let mut p = conn.pipeline();
    let (mut kb, mut kh) = (Vec::new(), Vec::new());
    for &i in which {
        let (key, buf) = &items[i];
        let payload = buf.slice();
        ctx.key(&mut kh, key, Part::Header);
        if lay.split {
            ctx.key(&mut kb, key, Part::Body);
            p.command(5)
                .arg(b"MSETNX")
                .arg(&kb)
                .arg_payload(b"", &payload[..lay.body()])
                .arg(&kh)
                .arg_payload(&headers[i], &payload[lay.body()..]);
            // MSETNX takes no expiry; set it on whatever holds the keys now (ours or the
            // first writer's: refreshing theirs is harmless).
            if let Some(t) = &ttl {
                p.command(3).arg(b"PEXPIRE").arg(&kb).arg(t.as_bytes());
                p.command(3).arg(b"PEXPIRE").arg(&kh).arg(t.as_bytes());
            }
        } else {
            p.command(if ttl.is_some() { 6 } else { 4 })
                .arg(b"SET")
                .arg(&kh)
                .arg_payload(&headers[i], payload)
                .arg(b"NX");
            if let Some(t) = &ttl {
                p.arg(b"PX").arg(t.as_bytes());
            }
        }
    }
    conn.send(&p)?;
    let mut out = Vec::with_capacity(which.len());
    for _ in which {
        if lay.split {
            out.push(read_int(conn, "MSETNX")?.map(|n| n == 1));
            if ttl.is_some() {
                for _ in 0..2 {
                    if let Err(m) = read_int(conn, "PEXPIRE")? {
                        ctx.server_error(&m);
                    }
                }
            }
        } else {
            out.push(set_ok(conn)?);
        }
    }
    Ok(out)
}

/// The refused items (`which` with `Ok(false)`) whose header part is absent: a body alone.
fn orphan_bodies(
    conn: &mut Conn,
    ctx: &Ctx<'_>,
    items: &[(Vec<u8>, RawBuf)],
    which: &[usize],
    written: &[std::result::Result<bool, String>],
) -> Result<Vec<usize>> {
    let refused: Vec<usize> = which
        .iter()
        .copied()
        .filter(|&i| written[i] == Ok(false))
        .collect();
    if refused.is_empty() {
        return Ok(refused);
    }
    let mut p = conn.pipeline();
    let mut k = Vec::new();
    for &i in &refused {
        ctx.key(&mut k, &items[i].0, Part::Header);
        p.command(2).arg(b"EXISTS").arg(&k);
    }
    conn.send(&p)?;
    let mut orphans = Vec::new();
    for &i in &refused {
        if read_int(conn, "EXISTS")? == Ok(0) {
            ctx.note(format!(
                "store of key {}: a body part without its header (left by eviction) was \
                 cleared",
                key_hint(&items[i].0)
            ));
            orphans.push(i);
        }
    }
    Ok(orphans)
}

/// How one part of a loaded chunk turned out.
enum Got {
    Ok,
    Missing,
    /// Failed a check: which one.
    Corrupt(&'static str),
    Failed,
}

/// Reads the `:h` reply: the header into a stack buffer, checked, then the tail into place.
fn read_header_part(
    conn: &mut Conn,
    ctx: &Ctx<'_>,
    key: &[u8],
    dest: &mut [u8],
) -> Result<(Got, u32)> {
    let lay = ctx.layout;
    let n = match conn.head()? {
        Head::Nil => return Ok((Got::Missing, 0)),
        Head::Error(m) if m.starts_with("WRONGTYPE") => {
            return Ok((Got::Corrupt("header part is not a string"), 0));
        }
        Head::Error(m) => {
            ctx.server_error(&m);
            return Ok((Got::Failed, 0));
        }
        Head::Bulk(n) => n,
        h => return Err(unexpected("GET", h)),
    };
    if n != HEADER_LEN + lay.tail {
        conn.skip_bulk(n)?;
        return Ok((Got::Corrupt("header part has the wrong length"), 0));
    }
    let mut raw = [0u8; HEADER_LEN];
    conn.read_into(&mut raw)?;
    match Header::decode_checked(&raw, &lay, ctx.ns, key) {
        Ok(h) => {
            conn.read_into(&mut dest[lay.body()..])?;
            conn.finish_bulk()?;
            Ok((Got::Ok, h.payload_crc))
        }
        Err(why) => {
            conn.skip_bulk(n - HEADER_LEN)?;
            Ok((Got::Corrupt(why), 0))
        }
    }
}

/// Reads the `:b` reply straight into place, or skips it when the header already failed.
fn read_body_part(conn: &mut Conn, ctx: &Ctx<'_>, want: bool, dest: &mut [u8]) -> Result<Got> {
    let n = match conn.head()? {
        // After `ASK`, on the node importing the slot: a body not moved yet, not a damaged value.
        Head::Nil if conn.is_asking() => return Ok(Got::Missing),
        Head::Nil => return Ok(Got::Corrupt("body part missing")),
        Head::Error(m) if m.starts_with("WRONGTYPE") => {
            return Ok(Got::Corrupt("body part is not a string"));
        }
        Head::Error(m) => {
            ctx.server_error(&m);
            return Ok(Got::Failed);
        }
        Head::Bulk(n) => n,
        h => return Err(unexpected("GET", h)),
    };
    if !want || n != dest.len() {
        conn.skip_bulk(n)?;
        // Unwanted: the header's reason is the one reported.
        return Ok(Got::Corrupt("body part has the wrong length"));
    }
    conn.read_into(dest)?;
    conn.finish_bulk()?;
    Ok(Got::Ok)
}

/// Bytes of GET replies a load keeps requested ahead of the one it reads.
const LOAD_WINDOW_BYTES: usize = 4 << 20;

pub(crate) fn load(
    conn: &mut Conn,
    ctx: &Ctx<'_>,
    items: &mut [(Vec<u8>, RawBufMut)],
    st: &mut [u8],
) -> Result<()> {
    let lay = ctx.layout;
    let mut k = Vec::new();
    // A sliding window of GETs, not the whole job at once: Redis copies every reply into its
    // output buffer before writing it, and 64 queued 2 MiB replies (128 MiB) loaded at 1.4 GB/s
    // where a window of 4 MiB reaches 2.6-2.8 GB/s (benches/bench_remote.py, loopback).
    let n = items.len();
    let window = (LOAD_WINDOW_BYTES / lay.chunk_bytes.max(1)).clamp(1, n.max(1));
    let keys: Vec<Vec<u8>> = items.iter().map(|(key, _)| key.clone()).collect();
    let send_gets = |conn: &mut Conn, k: &mut Vec<u8>, range: std::ops::Range<usize>| {
        let mut p = conn.pipeline();
        for key in &keys[range] {
            for &part in ctx.parts() {
                ctx.key(k, key, part);
                p.command(2).arg(b"GET").arg(k);
            }
        }
        conn.send(&p)
    };
    send_gets(conn, &mut k, 0..window.min(n))?;
    let mut corrupt = Vec::new();
    let (mut ok, mut missing, mut failed) = (0u64, 0u64, 0u64);
    for (i, (_, buf)) in items.iter_mut().enumerate() {
        if i + window < n {
            send_gets(conn, &mut k, i + window..i + window + 1)?;
        }
        let key = &keys[i];
        let dest = buf.slice_mut();
        let (head, crc) = read_header_part(conn, ctx, key, dest)?;
        let got = if lay.split {
            let body = read_body_part(conn, ctx, matches!(head, Got::Ok), &mut dest[..lay.body()])?;
            match (head, body) {
                (Got::Ok, Got::Ok) => Got::Ok,
                (Got::Ok, other) => other,
                (other, _) => other,
            }
        } else {
            head
        };
        let got = match got {
            Got::Ok if format::crc(dest) != crc => Got::Corrupt("payload checksum mismatch"),
            g => g,
        };
        st[i] = match got {
            Got::Ok => OK,
            Got::Missing => MISSING,
            Got::Corrupt(why) => {
                ctx.note(format!("corrupt value for key {}: {why}", key_hint(key)));
                CORRUPT
            }
            Got::Failed => FAILED,
        };
        match st[i] {
            OK => ok += 1,
            MISSING => missing += 1,
            CORRUPT => corrupt.push(&key[..]),
            _ => failed += 1,
        }
    }
    Counters::add(&ctx.stats.loaded_chunks, ok);
    Counters::add(&ctx.stats.load_missing, missing);
    Counters::add(&ctx.stats.load_failures, failed);
    Counters::add(&ctx.stats.corrupt, corrupt.len() as u64);
    Counters::add(&ctx.stats.bytes_read, ok * lay.chunk_bytes as u64);
    if !corrupt.is_empty() {
        let parts = ctx.parts().len();
        let refused = keyed_command(conn, ctx, b"DEL", corrupt.len(), parts, |i, k, push| {
            for &part in ctx.parts() {
                ctx.key(k, corrupt[i], part);
                push(k);
            }
        })?;
        if refused == 0 {
            Counters::add(&ctx.stats.deleted_corrupt, corrupt.len() as u64);
        }
    }
    debug_assert!(!st.contains(&PENDING));
    Ok(())
}

/// What the canary found under its key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CanaryOutcome {
    /// Ours is the first identity stored.
    Written,
    /// The stored identity equals ours.
    Matched,
    /// Another identity is stored: its bytes.
    Differs(Vec<u8>),
    /// The server could not be asked: why.
    Down(String),
}

pub(crate) fn canary(
    conn: &mut Conn,
    key: &[u8],
    identity: &[u8],
    ttl_ms: Option<u64>,
) -> Result<CanaryOutcome> {
    // Twice: the stored value may expire between our SET NX and our GET.
    for _ in 0..2 {
        let mut p = Pipeline::new();
        let ttl = ttl_ms.map(|t| t.to_string());
        p.command(if ttl.is_some() { 6 } else { 4 })
            .arg(b"SET")
            .arg(key)
            .arg(identity)
            .arg(b"NX");
        if let Some(t) = &ttl {
            p.arg(b"PX").arg(t.as_bytes());
        }
        p.command(2).arg(b"GET").arg(key);
        conn.send(&p)?;
        let written = set_ok(conn)?.map_err(RemoteError::Server)?;
        let stored = match conn.head()? {
            Head::Bulk(n) => Some(conn.read_bulk_vec(n, 1 << 20)?),
            Head::Nil => None,
            Head::Error(m) => return Err(RemoteError::Server(m)),
            h => return Err(unexpected("GET", h)),
        };
        match stored {
            _ if written => return Ok(CanaryOutcome::Written),
            Some(v) if v == identity => return Ok(CanaryOutcome::Matched),
            Some(v) => return Ok(CanaryOutcome::Differs(v)),
            None => continue,
        }
    }
    Err(RemoteError::Protocol(
        "canary key vanished twice between SET NX and GET".into(),
    ))
}
