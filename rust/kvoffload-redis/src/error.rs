//! The error type of the crate. Imports nothing from the other modules, so every module can use it.

use rustls::{AlertDescription, CertificateError};
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
    /// A TLS handshake or record failed, or one side spoke TLS and the other did not. Never a
    /// silent fallback to plaintext: the message says which side and why.
    Tls(String),
    /// The server sent something that is not the RESP2 we expect.
    Protocol(String),
    /// The server answered with an error reply (`-ERR ...`).
    Server(String),
    /// The tier was closed.
    Closed,
}

impl RemoteError {
    pub(crate) fn from_io(err: io::Error, what: &str) -> RemoteError {
        if let Some(tls) = err
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>())
        {
            return RemoteError::Tls(format!("{what}: {}", describe_tls(tls)));
        }
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
            RemoteError::Io(_)
                | RemoteError::Timeout(_)
                | RemoteError::Protocol(_)
                | RemoteError::Tls(_)
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
            RemoteError::Tls(m) => write!(f, "remote tier TLS error: {m}"),
            RemoteError::Protocol(m) => write!(f, "remote tier protocol error: {m}"),
            RemoteError::Server(m) => write!(f, "remote tier server error: {m}"),
            RemoteError::Closed => write!(f, "the remote tier is closed"),
        }
    }
}

impl std::error::Error for RemoteError {}

/// A rustls error with what an operator can do about it.
fn describe_tls(e: &rustls::Error) -> String {
    use rustls::Error as E;
    let hint = match e {
        E::InvalidCertificate(CertificateError::UnknownIssuer) => {
            "the server's certificate is not signed by a CA of tls_ca_file (or of the system's \
             roots when tls_ca_file is not set)"
        }
        E::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => {
            "the server's certificate is not for the url's host; set tls_server_name to a name \
             it holds"
        }
        E::InvalidCertificate(_) => "the server's certificate did not verify",
        E::AlertReceived(
            AlertDescription::CertificateRequired
            | AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::HandshakeFailure
            | AlertDescription::AccessDenied,
        ) => {
            "the server refused the handshake: it may require a client certificate \
             (tls_cert_file and tls_key_file) that its CA signed"
        }
        E::InvalidMessage(_) | E::InappropriateMessage { .. } => {
            "the server does not speak TLS on this port: is it a plain port? (use redis:// \
             there, rediss:// only against a tls-port)"
        }
        _ => "",
    };
    if hint.is_empty() {
        e.to_string()
    } else {
        format!("{hint} ({e})")
    }
}

pub type Result<T, E = RemoteError> = std::result::Result<T, E>;
