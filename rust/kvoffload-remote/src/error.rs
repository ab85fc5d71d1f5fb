//! The error type of the crate. Imports nothing from the other modules, so every module can use it.

use std::fmt;
use std::io;

#[derive(Debug)]
pub enum RemoteError {
    /// A bad configuration value or URL; the message names the field, the value and what is
    /// allowed.
    Config(String),
    /// The server refused our credentials or the database number.
    Auth(String),
    /// The connection failed (refused, reset, closed).
    Io(String),
    /// An operation ran past its deadline; the connection's state is unknown.
    Timeout(String),
    /// The server sent something that is not the RESP2 we expect.
    Protocol(String),
    /// The server answered with an error reply (`-ERR ...`).
    Server(String),
    /// The tier was closed.
    Closed,
}

impl RemoteError {
    pub(crate) fn from_io(err: io::Error, what: &str) -> RemoteError {
        match err.kind() {
            // SO_RCVTIMEO / SO_SNDTIMEO expiry shows up as WouldBlock on Unix.
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                RemoteError::Timeout(format!("{what}: timed out"))
            }
            io::ErrorKind::UnexpectedEof => {
                RemoteError::Io(format!("{what}: connection closed by the server"))
            }
            _ => RemoteError::Io(format!("{what}: {err}")),
        }
    }

    /// Whether the connection must be dropped: its byte stream is out of sync or gone.
    pub(crate) fn breaks_connection(&self) -> bool {
        matches!(
            self,
            RemoteError::Io(_) | RemoteError::Timeout(_) | RemoteError::Protocol(_)
        )
    }
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteError::Config(m) => write!(f, "invalid remote tier configuration: {m}"),
            RemoteError::Auth(m) => write!(f, "remote tier authentication failed: {m}"),
            RemoteError::Io(m) => write!(f, "remote tier I/O error: {m}"),
            RemoteError::Timeout(m) => write!(f, "remote tier timeout: {m}"),
            RemoteError::Protocol(m) => write!(f, "remote tier protocol error: {m}"),
            RemoteError::Server(m) => write!(f, "remote tier server error: {m}"),
            RemoteError::Closed => write!(f, "the remote tier is closed"),
        }
    }
}

impl std::error::Error for RemoteError {}

pub type Result<T, E = RemoteError> = std::result::Result<T, E>;
