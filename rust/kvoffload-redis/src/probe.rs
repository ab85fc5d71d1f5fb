//! What a port speaks, asked only when a start-up connection failed without saying why: a TLS
//! url against a plain port, or a plain url against a TLS port, is a start-up error only on
//! positive evidence, so a reset or a slow server still just starts the tier down.

use crate::conn::{open, Armed, TcpOrUnix};
use crate::tls;
use crate::url::Endpoint;
use rustls::pki_types::ServerName;
use rustls::{ClientConnection, RootCertStore};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a probe may take, on top of the connect that failed.
pub const PROBE_WAIT: Duration = Duration::from_millis(500);

/// Whether the endpoint answers an inline `PING` in RESP (`+PONG`, or `-NOAUTH`): a Redis
/// plain port.
pub fn answers_resp(endpoint: &Endpoint) -> bool {
    let deadline = Instant::now() + PROBE_WAIT;
    let Ok(TcpOrUnix::Tcp(tcp)) = open(endpoint, deadline) else {
        return false;
    };
    let mut s = Armed { tcp, deadline };
    let mut first = [0u8; 1];
    s.write_all(b"PING\r\n").is_ok()
        && matches!(s.read(&mut first), Ok(1))
        && matches!(first[0], b'+' | b'-')
}

/// Whether the endpoint answers a TLS ClientHello with TLS: the handshake is started with no
/// trusted root at all, so a TLS server always ends it with a certificate error (or its own
/// alert); anything else (bytes that are not TLS, a reset, silence) is not evidence.
pub fn speaks_tls(endpoint: &Endpoint) -> bool {
    let Endpoint::Tcp { host, .. } = endpoint else {
        return false;
    };
    let deadline = Instant::now() + PROBE_WAIT;
    let Ok(TcpOrUnix::Tcp(tcp)) = open(endpoint, deadline) else {
        return false;
    };
    let Ok(builder) = tls::builder() else {
        return false;
    };
    let config = builder
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth();
    let name = ServerName::try_from(host.clone())
        .unwrap_or_else(|_| ServerName::try_from("localhost").expect("a valid name"));
    let Ok(mut conn) = ClientConnection::new(Arc::new(config), name) else {
        return false;
    };
    let mut sock = Armed { tcp, deadline };
    loop {
        match conn.complete_io(&mut sock) {
            Ok(_) if conn.is_handshaking() => {}
            Ok(_) => return true,
            Err(e) => {
                let tls_error = e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>());
                return matches!(
                    tls_error,
                    Some(rustls::Error::InvalidCertificate(_) | rustls::Error::AlertReceived(_))
                );
            }
        }
    }
}
