//! One server connection. Every read and write is bounded by the current job's deadline: the
//! socket timeout is set to the time left before each system call (also each of the several
//! that rustls makes for one of ours), so a stalled or dribbling server cannot stretch a job
//! past it.

use crate::credentials::Credentials;
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
    pub(crate) creds: Credentials,
}

enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
    Tls(Box<StreamOwned<ClientConnection, Armed>>),
}

/// The time left before `deadline`, as a socket timeout (never zero: that means "forever").
fn time_left(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "job deadline passed",
        ));
    }
    Ok(left.max(Duration::from_millis(1)))
}

/// The TCP socket under rustls, arming its own timeout from `deadline` before every system
/// call.
pub(crate) struct Armed {
    pub(crate) tcp: TcpStream,
    pub(crate) deadline: Instant,
}

impl Read for Armed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tcp.set_read_timeout(Some(time_left(self.deadline)?))?;
        self.tcp.read(buf)
    }
}

impl Write for Armed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tcp
            .set_write_timeout(Some(time_left(self.deadline)?))?;
        self.tcp.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

pub struct Stream {
    socket: Socket,
    deadline: Instant,
}

impl Stream {
    fn arm_read(&mut self) -> io::Result<()> {
        let t = Some(time_left(self.deadline)?);
        match &mut self.socket {
            Socket::Tcp(s) => s.set_read_timeout(t),
            Socket::Unix(s) => s.set_read_timeout(t),
            Socket::Tls(s) => {
                s.sock.deadline = self.deadline;
                Ok(())
            }
        }
    }

    fn arm_write(&mut self) -> io::Result<()> {
        let t = Some(time_left(self.deadline)?);
        match &mut self.socket {
            Socket::Tcp(s) => s.set_write_timeout(t),
            Socket::Unix(s) => s.set_write_timeout(t),
            Socket::Tls(s) => {
                s.sock.deadline = self.deadline;
                Ok(())
            }
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
        match &mut self.socket {
            Socket::Tls(s) => {
                s.sock.deadline = self.deadline;
                s.flush()
            }
            _ => Ok(()),
        }
    }
}

pub struct Conn {
    reader: BufReader<Stream>,
    line: Vec<u8>,
    /// Every command goes out after an `ASKING` (see [`Conn::set_asking`]).
    asking: bool,
}

pub(crate) fn open(endpoint: &Endpoint, deadline: Instant) -> Result<TcpOrUnix> {
    let left = || {
        time_left(deadline)
            .map_err(|_| RemoteError::Timeout("connecting: connect timeout passed".into()))
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

pub(crate) enum TcpOrUnix {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// The TLS handshake, done here rather than on the first read so that a certificate that does
/// not verify, or a server that does not speak TLS, fails the connect with its own message (a
/// rustls error: a `Tls` error). A reset, an end or a timeout stays an I/O error: the tier
/// starts down and tries again.
fn handshake(
    tcp: TcpStream,
    endpoint: &Endpoint,
    tls: &TlsClient,
    deadline: Instant,
) -> Result<Socket> {
    let conn = ClientConnection::new(tls.config.clone(), tls.name_for(endpoint)?)
        .map_err(|e| RemoteError::Tls(format!("starting the handshake: {e}")))?;
    let mut s = StreamOwned::new(conn, Armed { tcp, deadline });
    while s.conn.is_handshaking() {
        s.conn
            .complete_io(&mut s.sock)
            .map_err(|e| RemoteError::from_io(e, "TLS handshake"))?;
    }
    Ok(Socket::Tls(Box::new(s)))
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
    /// TLS. Credentials the server refuses are read again from their file or variable (a
    /// rotated secret), and tried once more if they changed.
    pub fn connect_to(target: &Target, endpoint: &Endpoint, deadline: Instant) -> Result<Conn> {
        let tried = target.creds.password();
        match Conn::connect_once(target, endpoint, deadline, tried.as_deref()) {
            // Another connection may have read the new one meanwhile: retried whenever the
            // password now differs from the one refused.
            Err(RemoteError::Auth(e)) => {
                target.creds.reread();
                let now = target.creds.password();
                if now == tried {
                    return Err(RemoteError::Auth(e));
                }
                Conn::connect_once(target, endpoint, deadline, now.as_deref())
            }
            other => other,
        }
    }

    fn connect_once(
        target: &Target,
        endpoint: &Endpoint,
        deadline: Instant,
        password: Option<&str>,
    ) -> Result<Conn> {
        let url = &target.url;
        let socket = match (open(endpoint, deadline)?, &target.tls) {
            (TcpOrUnix::Tcp(s), Some(tls)) => handshake(s, endpoint, tls, deadline)?,
            (TcpOrUnix::Tcp(s), None) => Socket::Tcp(s),
            (TcpOrUnix::Unix(s), _) => Socket::Unix(s),
        };
        let mut conn = Conn {
            reader: BufReader::with_capacity(READ_BUF, Stream { socket, deadline }),
            line: Vec::with_capacity(128),
            asking: false,
        };
        let mut p = Pipeline::new();
        let mut steps = Vec::new();
        if let Some(pass) = password {
            match target.creds.username() {
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
        for step in steps {
            if let Head::Error(msg) = conn.simple()? {
                first_err.get_or_insert((step, msg));
            }
        }
        match first_err {
            None => Ok(conn),
            Some((_, msg)) if is_auth_error(&msg) => Err(RemoteError::Auth(format!(
                "the server refused the credentials {}: {msg}",
                target.creds.origin()
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
        // While asking, every reply is read after an ASKING's: a pipeline without them would
        // put the replies out of step.
        debug_assert_eq!(
            p.is_asking(),
            self.asking,
            "a pipeline not made by Conn::pipeline"
        );
        p.write_to(self.reader.get_mut())
    }

    /// Sends each command of the pipelines made by [`Conn::pipeline`] after an `ASKING` (to the
    /// node a migrating slot's keys went to, as an `ASK` answer says), and reads each reply
    /// after that `ASKING`'s: every reply of a job starts with one `head` or `simple` call.
    pub fn set_asking(&mut self, asking: bool) {
        self.asking = asking;
    }

    pub fn is_asking(&self) -> bool {
        self.asking
    }

    /// A pipeline for this connection (with `ASKING` before each command while asking).
    pub fn pipeline<'a>(&self) -> Pipeline<'a> {
        Pipeline::asking(self.asking)
    }

    fn asking_reply(&mut self) -> Result<()> {
        if self.asking {
            match resp::read_simple(&mut self.reader, &mut self.line)? {
                Head::Simple(s) if s == b"OK" => {}
                h => {
                    return Err(RemoteError::Protocol(format!(
                        "unexpected reply to ASKING: {h:?}"
                    )))
                }
            }
        }
        Ok(())
    }

    pub fn head(&mut self) -> Result<Head> {
        self.asking_reply()?;
        resp::read_head(&mut self.reader, &mut self.line)
    }

    /// A reply without a payload; bulks and arrays are protocol errors here.
    pub fn simple(&mut self) -> Result<Head> {
        self.asking_reply()?;
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
