//! One server connection. Every read and write is bounded by the current job's deadline: the
//! socket timeout is set to the time left before each system call, so a stalled or dribbling
//! server cannot stretch a job past it. (Over TLS one of our calls may make several system calls
//! inside rustls, each bounded by the time left when ours began.)

use crate::error::{RemoteError, Result};
use crate::resp::{self, Head, Pipeline};
use crate::tls::TlsClient;
use crate::url::{Endpoint, ServerUrl};
use rustls::{ClientConnection, StreamOwned};
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Large enough for every small reply of a pipeline in one read; bulk bodies bypass it.
const READ_BUF: usize = 64 << 10;

/// Where and how every connection of a tier connects.
pub struct Target {
    pub url: ServerUrl,
    pub tls: Option<TlsClient>,
}

enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

pub struct Stream {
    socket: Socket,
    deadline: Instant,
}

impl Stream {
    fn remaining(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "job deadline passed",
            ));
        }
        // A zero timeout means "block forever" to the kernel; never pass one.
        Ok(left.max(Duration::from_millis(1)))
    }

    fn arm_read(&self) -> io::Result<()> {
        let t = Some(self.remaining()?);
        match &self.socket {
            Socket::Tcp(s) => s.set_read_timeout(t),
            Socket::Unix(s) => s.set_read_timeout(t),
            Socket::Tls(s) => s.sock.set_read_timeout(t),
        }
    }

    fn arm_write(&self) -> io::Result<()> {
        let t = Some(self.remaining()?);
        match &self.socket {
            Socket::Tcp(s) => s.set_write_timeout(t),
            Socket::Unix(s) => s.set_write_timeout(t),
            Socket::Tls(s) => s.sock.set_write_timeout(t),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm_read()?;
        match &mut self.socket {
            Socket::Tcp(s) => s.read(buf),
            Socket::Unix(s) => s.read(buf),
            Socket::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm_write()?;
        match &mut self.socket {
            Socket::Tcp(s) => s.write(buf),
            Socket::Unix(s) => s.write(buf),
            Socket::Tls(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.arm_write()?;
        match &mut self.socket {
            Socket::Tcp(s) => s.write_vectored(bufs),
            Socket::Unix(s) => s.write_vectored(bufs),
            Socket::Tls(s) => s.write_vectored(bufs),
        }
    }

    /// Plain sockets have nothing buffered; rustls may hold the last records.
    fn flush(&mut self) -> io::Result<()> {
        if !matches!(self.socket, Socket::Tls(_)) {
            return Ok(());
        }
        self.arm_write()?;
        match &mut self.socket {
            Socket::Tls(s) => s.flush(),
            _ => Ok(()),
        }
    }
}

pub struct Conn {
    reader: BufReader<Stream>,
    line: Vec<u8>,
}

fn open(endpoint: &Endpoint, deadline: Instant) -> Result<TcpOrUnix> {
    let left = || {
        let d = deadline.saturating_duration_since(Instant::now());
        if d.is_zero() {
            Err(RemoteError::Timeout(
                "connecting: connect timeout passed".into(),
            ))
        } else {
            Ok(d)
        }
    };
    match endpoint {
        Endpoint::Tcp { host, port } => {
            let addrs = resolve(host, *port, left()?)?;
            let mut last = RemoteError::Io(format!("{host}:{port} resolves to no address"));
            for addr in addrs {
                match TcpStream::connect_timeout(&addr, left()?) {
                    Ok(s) => {
                        // Small commands must not wait for Nagle; payloads go out in full writes.
                        s.set_nodelay(true)
                            .map_err(|e| RemoteError::from_io(e, "setting TCP_NODELAY"))?;
                        return Ok(TcpOrUnix::Tcp(s));
                    }
                    Err(e) => last = RemoteError::from_io(e, &format!("connecting to {addr}")),
                }
            }
            Err(last)
        }
        Endpoint::Unix(path) => {
            left()?;
            UnixStream::connect(path)
                .map(TcpOrUnix::Unix)
                .map_err(|e| RemoteError::from_io(e, &format!("connecting to {}", path.display())))
        }
    }
}

/// `host`'s addresses within `within`: getaddrinfo has no timeout of its own, so a name is
/// resolved on a thread of its own and given up on (the thread left to finish) when slow.
fn resolve(host: &str, port: u16, within: Duration) -> Result<Vec<SocketAddr>> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let (tx, rx) = mpsc::channel();
    let name = host.to_string();
    std::thread::Builder::new()
        .name("kvo-resolve".into())
        .spawn(move || {
            let got = (name.as_str(), port)
                .to_socket_addrs()
                .map(|a| a.collect::<Vec<_>>());
            let _ = tx.send(got);
        })
        .map_err(|e| RemoteError::Io(format!("resolving {host}: starting a thread: {e}")))?;
    match rx.recv_timeout(within) {
        Ok(Ok(addrs)) => Ok(addrs),
        Ok(Err(e)) => Err(RemoteError::Io(format!("resolving {host}:{port}: {e}"))),
        Err(_) => Err(RemoteError::Timeout(format!(
            "resolving {host}: no answer within the connect timeout ({within:?})"
        ))),
    }
}

enum TcpOrUnix {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// The TLS handshake, done here rather than on the first read so that a certificate that does
/// not verify, or a plain port, fails the connect with its own message.
fn handshake(tcp: TcpStream, tls: &TlsClient, deadline: Instant) -> Result<Socket> {
    let conn = ClientConnection::new(tls.config.clone(), tls.name.clone())
        .map_err(|e| RemoteError::Tls(format!("starting the handshake: {e}")))?;
    let mut s = StreamOwned::new(conn, tcp);
    while s.conn.is_handshaking() {
        let t = Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        );
        s.sock
            .set_read_timeout(t)
            .and_then(|()| s.sock.set_write_timeout(t))
            .map_err(|e| RemoteError::from_io(e, "arming the TLS handshake"))?;
        if Instant::now() >= deadline {
            return Err(no_handshake());
        }
        match s.conn.complete_io(&mut s.sock) {
            Ok((0, 0)) => {
                return Err(RemoteError::Tls(
                    "the server closed the connection during the TLS handshake: is it a plain \
                     port? (use redis:// there)"
                        .into(),
                ))
            }
            Ok(_) => {}
            Err(e) => {
                return Err(match RemoteError::from_io(e, "TLS handshake") {
                    RemoteError::Timeout(_) => no_handshake(),
                    RemoteError::Io(m) => RemoteError::Tls(format!(
                        "{m}: the connection failed during the TLS handshake: is it a plain \
                         port? (use redis:// there)"
                    )),
                    other => other,
                })
            }
        }
    }
    Ok(Socket::Tls(Box::new(s)))
}

/// How long a plaintext probe waits for its answer after a TLS handshake timed out.
const PROBE_WAIT: Duration = Duration::from_millis(500);

/// Whether the endpoint answers an inline `PING` in RESP: a Redis plain port, which reads a
/// TLS ClientHello as the start of an inline command and waits for its end.
fn answers_plaintext(endpoint: &Endpoint) -> bool {
    let Ok(TcpOrUnix::Tcp(mut s)) = open(endpoint, Instant::now() + PROBE_WAIT) else {
        return false;
    };
    let mut first = [0u8; 1];
    s.set_read_timeout(Some(PROBE_WAIT)).is_ok()
        && s.set_write_timeout(Some(PROBE_WAIT)).is_ok()
        && s.write_all(b"PING\r\n").is_ok()
        && matches!(s.read(&mut first), Ok(1))
        && matches!(first[0], b'+' | b'-')
}

/// A timeout, not a TLS error: a server too slow to answer in time must not stop start-up (the
/// tier starts down and retries), though the hint names the other cause.
fn no_handshake() -> RemoteError {
    RemoteError::Timeout(
        "no TLS handshake within the connect timeout: a server too slow to answer, or a plain \
         port that waits for a RESP command? (use redis:// there)"
            .into(),
    )
}

fn is_auth_error(msg: &str) -> bool {
    [
        "NOAUTH",
        "WRONGPASS",
        "NOPERM",
        "invalid password",
        "invalid username",
    ]
    .iter()
    .any(|p| msg.contains(p))
        || msg.starts_with("ERR AUTH")
}

impl Conn {
    /// Connects, authenticates and selects the database, all before `deadline`.
    pub fn connect(target: &Target, deadline: Instant) -> Result<Conn> {
        Conn::connect_to(target, &target.url.endpoint, deadline)
    }

    /// [`Conn::connect`] to another node of the target (a cluster's), with its credentials and
    /// TLS.
    pub fn connect_to(target: &Target, endpoint: &Endpoint, deadline: Instant) -> Result<Conn> {
        let url = &target.url;
        let socket = match (open(endpoint, deadline)?, &target.tls) {
            (TcpOrUnix::Tcp(s), Some(tls)) => match handshake(s, tls, deadline) {
                Err(RemoteError::Timeout(_)) if answers_plaintext(endpoint) => {
                    return Err(RemoteError::Tls(
                        "the server answers plaintext RESP on this port: it is a plain port \
                         (use redis:// there, rediss:// only against a tls-port)"
                            .into(),
                    ))
                }
                res => res?,
            },
            (TcpOrUnix::Tcp(s), None) => Socket::Tcp(s),
            (TcpOrUnix::Unix(s), _) => Socket::Unix(s),
        };
        let plain_tcp = matches!(socket, Socket::Tcp(_));
        let mut conn = Conn {
            reader: BufReader::with_capacity(READ_BUF, Stream { socket, deadline }),
            line: Vec::with_capacity(128),
        };
        let mut p = Pipeline::new();
        let mut steps = Vec::new();
        if let Some(pass) = &url.password {
            match &url.username {
                Some(user) => p.command(3).arg(b"AUTH").arg(user.as_bytes()),
                None => p.command(2).arg(b"AUTH"),
            }
            .arg(pass.as_bytes());
            steps.push("AUTH");
        }
        if url.db != 0 {
            p.command(2)
                .arg(b"SELECT")
                .arg(url.db.to_string().as_bytes());
            steps.push("SELECT");
        }
        // PING reveals a server that wants a password we were not given (NOAUTH).
        p.command(1).arg(b"PING");
        steps.push("PING");
        conn.send(&p)?;
        let mut first_err = None;
        for (i, step) in steps.into_iter().enumerate() {
            match conn.simple() {
                Ok(Head::Error(msg)) => {
                    first_err.get_or_insert((step, msg));
                }
                Ok(_) => {}
                // A TLS server drops a plaintext client at its first bytes.
                Err(RemoteError::Io(m) | RemoteError::Protocol(m)) if plain_tcp && i == 0 => {
                    return Err(RemoteError::Tls(format!(
                        "{m}: the server dropped our first plaintext command: is it a TLS port? \
                         (use rediss:// there)"
                    )))
                }
                Err(e) => return Err(e),
            }
        }
        match first_err {
            None => Ok(conn),
            Some((_, msg)) if is_auth_error(&msg) => Err(RemoteError::Auth(format!(
                "the server refused the credentials of the URL: {msg}"
            ))),
            Some(("SELECT", msg)) => Err(RemoteError::Auth(format!(
                "the server refused database {} of the URL: {msg}",
                url.db
            ))),
            Some((step, msg)) => Err(RemoteError::Server(format!("{step} at connect: {msg}"))),
        }
    }

    pub fn set_deadline(&mut self, deadline: Instant) {
        self.reader.get_mut().deadline = deadline;
    }

    pub fn send(&mut self, p: &Pipeline<'_>) -> Result<()> {
        p.write_to(self.reader.get_mut())
    }

    pub fn head(&mut self) -> Result<Head> {
        resp::read_head(&mut self.reader, &mut self.line)
    }

    /// A reply without a payload; bulks and arrays are protocol errors here.
    pub fn simple(&mut self) -> Result<Head> {
        resp::read_simple(&mut self.reader, &mut self.line)
    }

    /// A whole small structured reply.
    pub fn value(&mut self) -> Result<resp::Value> {
        resp::read_value(&mut self.reader, &mut self.line)
    }

    pub fn read_into(&mut self, dest: &mut [u8]) -> Result<()> {
        resp::read_into(&mut self.reader, dest)
    }

    pub fn finish_bulk(&mut self) -> Result<()> {
        resp::finish_bulk(&mut self.reader)
    }

    pub fn discard(&mut self, n: usize) -> Result<()> {
        resp::discard(&mut self.reader, n)
    }

    /// Skips a bulk body and its CRLF.
    pub fn skip_bulk(&mut self, n: usize) -> Result<()> {
        self.discard(n)?;
        self.finish_bulk()
    }

    pub fn read_bulk_vec(&mut self, n: usize, max: usize) -> Result<Vec<u8>> {
        resp::read_bulk_vec(&mut self.reader, n, max)
    }
}
