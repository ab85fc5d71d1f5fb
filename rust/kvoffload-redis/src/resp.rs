//! RESP2 encoding and reply parsing. Payloads are never copied: a command refers to the
//! caller's slices and goes out with `write_vectored`; a bulk reply is read straight into the
//! caller's slice.

use crate::error::{RemoteError, Result};
use std::io::{BufRead, IoSlice, Write};

/// Below this, an argument is copied into the header buffer: fewer iovecs beat a memcpy.
const COPY_BELOW: usize = 4096;
/// Redis's own cap on a bulk string (proto-max-bulk-len); anything larger is garbage.
pub const MAX_BULK: usize = 512 << 20;
/// Longest status / error / integer line we accept.
const MAX_LINE: usize = 64 << 10;
/// Writes hand the kernel at most this many iovecs at once (IOV_MAX is 1024 on Linux).
const MAX_IOV: usize = 512;

enum Seg<'a> {
    Own(usize, usize),
    Ref(&'a [u8]),
}

/// Pipelined commands: small bytes in one buffer, large payloads borrowed from the caller.
#[derive(Default)]
pub struct Pipeline<'a> {
    small: Vec<u8>,
    segs: Vec<Seg<'a>>,
    commands: usize,
    asking: bool,
}

impl<'a> Pipeline<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// A pipeline whose every command is preceded by `ASKING` (a Redis Cluster slot being
    /// imported by the node it is sent to), when `asking`.
    pub fn asking(asking: bool) -> Self {
        Pipeline {
            asking,
            ..Self::default()
        }
    }

    pub fn len(&self) -> usize {
        self.commands
    }

    pub fn is_asking(&self) -> bool {
        self.asking
    }

    pub fn is_empty(&self) -> bool {
        self.commands == 0
    }

    fn push_small(&mut self, bytes: &[u8]) {
        let start = self.small.len();
        self.small.extend_from_slice(bytes);
        let end = self.small.len();
        match self.segs.last_mut() {
            Some(Seg::Own(_, e)) if *e == start => *e = end,
            _ => self.segs.push(Seg::Own(start, end)),
        }
    }

    fn push_len(&mut self, tag: u8, n: usize) {
        let mut b = [0u8; 24];
        b[0] = tag;
        let mut w = &mut b[1..];
        // Writing into a 23-byte slice cannot fail for a usize and CRLF.
        let _ = write!(w, "{n}\r\n");
        let used = 24 - w.len();
        self.push_small(&b[..used]);
    }

    /// Starts a command of `nargs` arguments; follow with exactly that many `arg*` calls.
    pub fn command(&mut self, nargs: usize) -> &mut Self {
        if self.asking {
            self.push_small(b"*1\r\n$6\r\nASKING\r\n");
        }
        self.commands += 1;
        self.push_len(b'*', nargs);
        self
    }

    pub fn arg(&mut self, a: &[u8]) -> &mut Self {
        self.push_len(b'$', a.len());
        self.push_small(a);
        self.push_small(b"\r\n");
        self
    }

    /// One argument made of a small copied `prefix` and a borrowed `payload`.
    pub fn arg_payload(&mut self, prefix: &[u8], payload: &'a [u8]) -> &mut Self {
        self.push_len(b'$', prefix.len() + payload.len());
        self.push_small(prefix);
        if payload.len() < COPY_BELOW {
            self.push_small(payload);
        } else {
            self.segs.push(Seg::Ref(payload));
        }
        self.push_small(b"\r\n");
        self
    }

    /// Writes everything, looping on partial writes.
    pub fn write_to<W: Write>(&self, w: &mut W) -> Result<()> {
        let mut iov: Vec<IoSlice<'_>> = self
            .segs
            .iter()
            .map(|s| match *s {
                Seg::Own(a, b) => IoSlice::new(&self.small[a..b]),
                Seg::Ref(r) => IoSlice::new(r),
            })
            .collect();
        let mut bufs = &mut iov[..];
        while !bufs.is_empty() {
            let n = bufs.len().min(MAX_IOV);
            match w.write_vectored(&bufs[..n]) {
                Ok(0) => return Err(RemoteError::Io("writing: connection closed".into())),
                Ok(written) => IoSlice::advance_slices(&mut bufs, written),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(RemoteError::from_io(e, "writing")),
            }
        }
        w.flush().map_err(|e| RemoteError::from_io(e, "writing"))
    }
}

/// The first line of a reply; a bulk's body is then read by the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    Simple(Vec<u8>),
    Error(String),
    Int(i64),
    Nil,
    Bulk(usize),
    Array(usize),
}

fn proto(what: String) -> RemoteError {
    RemoteError::Protocol(what)
}

fn io(e: std::io::Error) -> RemoteError {
    RemoteError::from_io(e, "reading reply")
}

/// Reads one CRLF-terminated line into `line` (without the CRLF).
fn read_line<R: BufRead>(r: &mut R, line: &mut Vec<u8>) -> Result<()> {
    line.clear();
    loop {
        let buf = r.fill_buf().map_err(io)?;
        if buf.is_empty() {
            return Err(RemoteError::Io(
                "reading reply: connection closed by the server".into(),
            ));
        }
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                line.extend_from_slice(&buf[..i]);
                r.consume(i + 1);
                if line.pop() != Some(b'\r') {
                    return Err(proto("line ends in LF without CR".into()));
                }
                return Ok(());
            }
            None => {
                line.extend_from_slice(buf);
                let n = buf.len();
                r.consume(n);
            }
        }
        if line.len() > MAX_LINE {
            return Err(proto(format!("reply line longer than {MAX_LINE} bytes")));
        }
    }
}

fn parse_int(line: &[u8]) -> Result<i64> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| proto(format!("bad integer {:?}", String::from_utf8_lossy(line))))
}

fn parse_len(line: &[u8], what: &str) -> Result<Option<usize>> {
    match parse_int(line)? {
        -1 => Ok(None),
        n if n >= 0 && (n as u64) <= MAX_BULK as u64 => Ok(Some(n as usize)),
        n => Err(proto(format!("{what} length {n} out of range"))),
    }
}

/// Reads a reply's first line. `line` is scratch space, kept by the caller to avoid allocations.
pub fn read_head<R: BufRead>(r: &mut R, line: &mut Vec<u8>) -> Result<Head> {
    read_line(r, line)?;
    let Some((&tag, rest)) = line.split_first() else {
        return Err(proto("empty reply line".into()));
    };
    Ok(match tag {
        b'+' => Head::Simple(rest.to_vec()),
        b'-' => Head::Error(String::from_utf8_lossy(rest).into_owned()),
        b':' => Head::Int(parse_int(rest)?),
        b'$' => parse_len(rest, "bulk")?.map_or(Head::Nil, Head::Bulk),
        b'*' => parse_len(rest, "array")?.map_or(Head::Nil, Head::Array),
        other => return Err(proto(format!("unexpected reply type byte 0x{other:02x}"))),
    })
}

/// Fills `dest` from the reply stream: a whole bulk body or a piece of one.
pub fn read_into<R: BufRead>(r: &mut R, dest: &mut [u8]) -> Result<()> {
    // BufReader::read_exact drains its buffer, then reads large remainders straight into dest.
    r.read_exact(dest).map_err(io)
}

/// Consumes the CRLF after a bulk body.
pub fn finish_bulk<R: BufRead>(r: &mut R) -> Result<()> {
    let mut crlf = [0u8; 2];
    read_into(r, &mut crlf)?;
    if crlf != *b"\r\n" {
        return Err(proto("bulk string not followed by CRLF".into()));
    }
    Ok(())
}

/// Skips `n` bytes of a bulk body (and not its CRLF), keeping the stream in sync.
pub fn discard<R: BufRead>(r: &mut R, mut n: usize) -> Result<()> {
    while n > 0 {
        let buf = r.fill_buf().map_err(io)?;
        if buf.is_empty() {
            return Err(RemoteError::Io(
                "reading reply: connection closed by the server".into(),
            ));
        }
        let k = buf.len().min(n);
        r.consume(k);
        n -= k;
    }
    Ok(())
}

/// A whole small bulk body (canary values), after its `Head::Bulk(n)`.
pub fn read_bulk_vec<R: BufRead>(r: &mut R, n: usize, max: usize) -> Result<Vec<u8>> {
    if n > max {
        return Err(proto(format!(
            "bulk of {n} bytes where at most {max} expected"
        )));
    }
    let mut v = vec![0u8; n];
    read_into(r, &mut v)?;
    finish_bulk(r)?;
    Ok(v)
}

/// Reads a reply that carries no payload (status, error, integer, nil), refusing bulks and arrays.
pub fn read_simple<R: BufRead>(r: &mut R, line: &mut Vec<u8>) -> Result<Head> {
    match read_head(r, line)? {
        Head::Bulk(n) => Err(proto(format!("unexpected bulk reply of {n} bytes"))),
        Head::Array(n) => Err(proto(format!("unexpected array reply of {n} items"))),
        h => Ok(h),
    }
}

/// A whole reply as a tree, for the few small structured replies we read (`CLUSTER SLOTS`,
/// `INFO`). Bounded: at most `MAX_VALUE_BYTES` of bulk data and nesting `MAX_VALUE_DEPTH`.
#[derive(Debug, PartialEq, Eq)]
pub enum Value {
    Simple(Vec<u8>),
    Error(String),
    Int(i64),
    Nil,
    Bulk(Vec<u8>),
    Array(Vec<Value>),
}

const MAX_VALUE_BYTES: usize = 16 << 20;
const MAX_VALUE_DEPTH: usize = 8;

pub fn read_value<R: BufRead>(r: &mut R, line: &mut Vec<u8>) -> Result<Value> {
    let mut budget = MAX_VALUE_BYTES;
    read_value_in(r, line, 0, &mut budget)
}

fn read_value_in<R: BufRead>(
    r: &mut R,
    line: &mut Vec<u8>,
    depth: usize,
    budget: &mut usize,
) -> Result<Value> {
    if depth > MAX_VALUE_DEPTH {
        return Err(proto(format!("reply nested deeper than {MAX_VALUE_DEPTH}")));
    }
    Ok(match read_head(r, line)? {
        Head::Simple(s) => Value::Simple(s),
        Head::Error(m) => Value::Error(m),
        Head::Int(n) => Value::Int(n),
        Head::Nil => Value::Nil,
        Head::Bulk(n) => {
            *budget = budget
                .checked_sub(n)
                .ok_or_else(|| proto(format!("reply larger than {MAX_VALUE_BYTES} bytes")))?;
            Value::Bulk(read_bulk_vec(r, n, MAX_VALUE_BYTES)?)
        }
        Head::Array(n) => {
            // Each item costs at least its line: a huge count from garbage fails on the budget.
            let mut items = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                *budget = budget
                    .checked_sub(4)
                    .ok_or_else(|| proto(format!("reply larger than {MAX_VALUE_BYTES} bytes")))?;
                items.push(read_value_in(r, line, depth + 1, budget)?);
            }
            Value::Array(items)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufReader, Cursor};

    #[test]
    fn encodes_commands_with_borrowed_payload() {
        let payload = vec![7u8; 5000];
        let mut p = Pipeline::new();
        p.command(3)
            .arg(b"SET")
            .arg(b"k")
            .arg_payload(b"hd", &payload);
        p.command(1).arg(b"PING");
        let mut out = Vec::new();
        p.write_to(&mut out).unwrap();
        let mut want = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5002\r\nhd".to_vec();
        want.extend_from_slice(&payload);
        want.extend_from_slice(b"\r\n*1\r\n$4\r\nPING\r\n");
        assert_eq!(out, want);
        assert_eq!(p.len(), 2);
    }

    /// A writer that takes a few bytes per call, to exercise the partial-write loop.
    struct Trickle(Vec<u8>);
    impl Write for Trickle {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let n = b.len().min(3);
            self.0.extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn partial_writes_complete() {
        let payload = vec![1u8; 10000];
        let mut p = Pipeline::new();
        p.command(2).arg(b"X").arg_payload(b"", &payload);
        let mut all = Vec::new();
        p.write_to(&mut all).unwrap();
        let mut t = Trickle(Vec::new());
        p.write_to(&mut t).unwrap();
        assert_eq!(t.0, all);
    }

    #[test]
    fn parses_replies() {
        let data = b"+OK\r\n-ERR bad\r\n:42\r\n$-1\r\n$5\r\nhello\r\n*2\r\n$3\r\nabcdef\r\n";
        let mut r = BufReader::with_capacity(4, Cursor::new(&data[..]));
        let mut line = Vec::new();
        assert_eq!(
            read_head(&mut r, &mut line).unwrap(),
            Head::Simple(b"OK".to_vec())
        );
        assert_eq!(
            read_head(&mut r, &mut line).unwrap(),
            Head::Error("ERR bad".into())
        );
        assert_eq!(read_head(&mut r, &mut line).unwrap(), Head::Int(42));
        assert_eq!(read_head(&mut r, &mut line).unwrap(), Head::Nil);
        assert_eq!(read_head(&mut r, &mut line).unwrap(), Head::Bulk(5));
        let mut dest = [0u8; 5];
        read_into(&mut r, &mut dest).unwrap();
        finish_bulk(&mut r).unwrap();
        assert_eq!(&dest, b"hello");
        assert_eq!(read_head(&mut r, &mut line).unwrap(), Head::Array(2));
        assert_eq!(read_head(&mut r, &mut line).unwrap(), Head::Bulk(3));
        read_into(&mut r, &mut dest[..3]).unwrap();
        assert!(matches!(finish_bulk(&mut r), Err(RemoteError::Protocol(_))));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            &b"?what\r\n"[..],
            b"$-5\r\n",
            b"$99999999999\r\n",
            b":12x\r\n",
            b"+OK\n",
            b"\r\n",
        ] {
            let mut r = BufReader::new(Cursor::new(bad));
            let got = read_head(&mut r, &mut Vec::new());
            assert!(
                matches!(got, Err(RemoteError::Protocol(_))),
                "{bad:?}: {got:?}"
            );
        }
        let mut r = BufReader::new(Cursor::new(&b"+OK"[..]));
        assert!(matches!(
            read_head(&mut r, &mut Vec::new()),
            Err(RemoteError::Io(_))
        ));
        let long = vec![b'+'; MAX_LINE + 10];
        let mut r = BufReader::new(Cursor::new(long));
        assert!(matches!(
            read_head(&mut r, &mut Vec::new()),
            Err(RemoteError::Protocol(_))
        ));
    }

    #[test]
    fn discard_skips_exactly() {
        let mut r = BufReader::with_capacity(3, Cursor::new(&b"abcdefgh\r\n:1\r\n"[..]));
        discard(&mut r, 8).unwrap();
        finish_bulk(&mut r).unwrap();
        assert_eq!(read_head(&mut r, &mut Vec::new()).unwrap(), Head::Int(1));
    }
}
