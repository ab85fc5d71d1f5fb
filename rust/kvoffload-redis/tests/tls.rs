//! `rediss://` against a real redis-server with a TLS port, certificates made by
//! `tests/tls/make_certs.sh` (openssl) once per run.

mod common;

use common::free_port;
use common::tier::{config, keys, load, lookup, store, NS};
use common::{pattern, Server};
use kvoffload_redis::status::*;
use kvoffload_redis::{Config, RemoteError, Tier, TlsConfig};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const MB: usize = 1024 * 1024;

struct TlsServer {
    server: Server,
    tls_port: u16,
    certs: &'static Path,
}

/// The certificates every test of this run uses (openssl takes a while; nothing writes them).
fn certs() -> &'static Path {
    static CERTS: OnceLock<PathBuf> = OnceLock::new();
    CERTS.get_or_init(|| {
        // Under target/ (cargo clean removes it), one folder per run: a run never changes
        // the files under another's servers.
        let certs = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("kvo-certs-{}", std::process::id()));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/tls/make_certs.sh");
        let ok = Command::new("bash")
            .arg(&script)
            .arg(&certs)
            .status()
            .unwrap()
            .success();
        assert!(ok, "{} failed", script.display());
        certs
    })
}

/// A server with its usual plain port and a TLS port; `auth_clients`: whether it requires a
/// client certificate.
fn tls_server(auth_clients: bool, password: Option<&str>) -> Option<TlsServer> {
    if !Server::available() {
        return None;
    }
    let certs = certs();
    let tls_port = free_port().to_string();
    let file = |n: &str| certs.join(n).display().to_string();
    let (cert, key, ca) = (file("server.crt"), file("server.key"), file("ca.crt"));
    let mut args = vec![
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
    ];
    args.extend([
        "--tls-auth-clients",
        if auth_clients { "yes" } else { "no" },
    ]);
    if let Some(p) = password {
        args.extend(["--requirepass", p]);
    }
    let server = Server::start(&args)?;
    Some(TlsServer {
        server,
        tls_port: tls_port.parse().unwrap(),
        certs,
    })
}

impl TlsServer {
    fn url(&self) -> String {
        match &self.server.password {
            Some(p) => format!("rediss://:{p}@127.0.0.1:{}", self.tls_port),
            None => format!("rediss://127.0.0.1:{}", self.tls_port),
        }
    }

    fn tls(&self, ca: &str) -> TlsConfig {
        TlsConfig {
            ca_file: Some(self.certs.join(ca)),
            ..TlsConfig::default()
        }
    }

    fn client_cert(&self) -> TlsConfig {
        TlsConfig {
            cert_file: Some(self.certs.join("client.crt")),
            key_file: Some(self.certs.join("client.key")),
            ..self.tls("ca.crt")
        }
    }
}

fn cfg(url: &str, chunk: usize, tls: TlsConfig) -> Config {
    let mut c = config(url, chunk);
    c.tls = tls;
    c
}

fn tls_err(res: Result<Tier, RemoteError>) -> String {
    match res {
        Err(RemoteError::Tls(m)) => m,
        Err(e) => panic!("expected a TLS error, got {e:?}"),
        Ok(t) => panic!(
            "expected a TLS error, the tier connected: {:?}",
            t.startup_error()
        ),
    }
}

fn round_trip(t: &Tier, chunk: usize, n: usize, tag: &str) {
    let ks = keys(tag, n);
    let data: Vec<Vec<u8>> = (0..n).map(|i| pattern(i as u64 + 7, chunk)).collect();
    assert_eq!(store(t, &ks, &data), vec![OK; n]);
    assert_eq!(lookup(t, &ks), vec![OK; n]);
    let (st, bufs) = load(t, &ks);
    assert_eq!(st, vec![OK; n]);
    for (b, d) in bufs.iter().zip(&data) {
        assert!(b == d, "payload differs");
    }
}

#[test]
fn verified_round_trip_and_the_plain_port_sees_the_same_keys() {
    let Some(s) = tls_server(false, Some("s3cret")) else {
        return;
    };
    let t = Tier::connect(cfg(&s.url(), 2 * MB, s.tls("ca.crt")), NS).unwrap();
    assert_eq!(t.startup_error(), None);
    round_trip(&t, 2 * MB, 6, "tls");
    let st = t.stats();
    assert_eq!((st.stored_chunks, st.loaded_chunks, st.corrupt), (6, 6, 0));
    // Chunks small enough to go unsplit, many to a TLS record.
    let small = Tier::connect(cfg(&s.url(), 1000, s.tls("ca.crt")), NS).unwrap();
    round_trip(&small, 1000, 50, "tls-small");
    // The same server's plain port sees what went over TLS (same keys, same bytes).
    let plain = Tier::connect(config(&s.server.url(), 2 * MB), NS).unwrap();
    let (st, bufs) = load(&plain, &keys("tls", 6));
    assert_eq!(st, vec![OK; 6]);
    assert!(bufs[5] == pattern(12, 2 * MB));
    // tls_server_name checks the certificate for another of its names than the URL's host.
    let named = TlsConfig {
        server_name: Some("localhost".into()),
        ..s.tls("ca.crt")
    };
    let t2 = Tier::connect(cfg(&s.url(), 2 * MB, named), NS).unwrap();
    assert_eq!(lookup(&t2, &keys("tls", 6)), vec![OK; 6]);
}

#[test]
fn a_certificate_that_does_not_verify_is_a_start_up_error() {
    let Some(s) = tls_server(false, Some("hunter2")) else {
        return;
    };
    let m = tls_err(Tier::connect(cfg(&s.url(), MB, s.tls("other-ca.crt")), NS));
    assert!(m.contains("not signed by a CA of tls_ca_file"), "{m}");
    assert!(!m.contains("hunter2"), "{m}");
    let wrong_name = TlsConfig {
        server_name: Some("redis.example.com".into()),
        ..s.tls("ca.crt")
    };
    let m = tls_err(Tier::connect(cfg(&s.url(), MB, wrong_name), NS));
    assert!(m.contains("set tls_server_name"), "{m}");
}

#[test]
fn a_server_that_requires_a_client_certificate() {
    let Some(s) = tls_server(true, None) else {
        return;
    };
    let m = tls_err(Tier::connect(cfg(&s.url(), MB, s.tls("ca.crt")), NS));
    assert!(
        m.contains("client certificate (tls_cert_file and tls_key_file)"),
        "{m}"
    );
    let t = Tier::connect(cfg(&s.url(), MB, s.client_cert()), NS).unwrap();
    round_trip(&t, MB, 3, "mtls");
    // A client certificate its CA did not sign is refused the same way.
    let c = &s.certs;
    let ok = Command::new("openssl")
        .args(["req", "-x509", "-new", "-key"])
        .arg(c.join("client.key"))
        .args(["-days", "1", "-subj", "/CN=self-signed", "-out"])
        .arg(c.join("self.crt"))
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let self_signed = TlsConfig {
        cert_file: Some(c.join("self.crt")),
        ..s.client_cert()
    };
    let m = tls_err(Tier::connect(cfg(&s.url(), MB, self_signed), NS));
    assert!(m.contains("refused the handshake"), "{m}");
}

#[test]
fn plain_against_tls_and_tls_against_plain_are_refused_clearly() {
    let Some(s) = tls_server(false, None) else {
        return;
    };
    let plain_to_tls = format!("redis://127.0.0.1:{}", s.tls_port);
    let m = tls_err(Tier::connect(config(&plain_to_tls, MB), NS));
    assert!(m.contains("it is a TLS port (use rediss://"), "{m}");
    let tls_to_plain = format!("rediss://127.0.0.1:{}", s.server.port);
    let m = tls_err(Tier::connect(cfg(&tls_to_plain, MB, s.tls("ca.crt")), NS));
    assert!(m.contains("it is a plain port"), "{m}");
}

#[test]
fn tls_options_are_checked_before_any_connection() {
    let dir = std::env::temp_dir();
    let ca = TlsConfig {
        ca_file: Some(dir.join("kvo-no-such-ca.pem")),
        ..TlsConfig::default()
    };
    let config_err = |c: Config| match Tier::connect(c, NS) {
        Err(RemoteError::Config(m)) => m,
        other => panic!("expected a config error, got {:?}", other.err()),
    };
    // Nothing listens on port 1: every one of these fails before connecting.
    let m = config_err(cfg("redis://127.0.0.1:1", MB, ca.clone()));
    assert!(
        m.contains("tls_ca_file set, but the url is not a TLS URL"),
        "{m}"
    );
    let m = config_err(cfg("rediss://127.0.0.1:1", MB, ca));
    assert!(
        m.contains("tls_ca_file=") && m.contains("cannot read it"),
        "{m}"
    );
    let half = TlsConfig {
        cert_file: Some(dir.join("c.pem")),
        ..TlsConfig::default()
    };
    let m = config_err(cfg("rediss://127.0.0.1:1", MB, half));
    assert!(m.contains("needs both"), "{m}");
    let not_pem = dir.join(format!("kvo-not-pem-{}", std::process::id()));
    std::fs::write(&not_pem, b"hello").unwrap();
    let garbage = TlsConfig {
        ca_file: Some(not_pem.clone()),
        ..TlsConfig::default()
    };
    let m = config_err(cfg("rediss://127.0.0.1:1", MB, garbage));
    assert!(m.contains("holds no PEM certificate"), "{m}");
    std::fs::remove_file(not_pem).unwrap();
    let m = config_err(cfg(
        "unix:///tmp/x.sock",
        MB,
        TlsConfig {
            server_name: Some("h".into()),
            ..TlsConfig::default()
        },
    ));
    assert!(m.contains("tls_server_name set"), "{m}");
}

#[test]
fn an_unreachable_tls_server_starts_the_tier_down_and_a_restart_reconnects() {
    let Some(mut s) = tls_server(false, None) else {
        return;
    };
    s.server.kill();
    let t = Tier::connect(cfg(&s.url(), MB, s.tls("ca.crt")), NS).unwrap();
    assert!(t.startup_error().is_some_and(|e| e.contains("unreachable")));
    s.server.spawn();
    // The breaker's cool-down (2 s by default) passes before the workers try again.
    let start = std::time::Instant::now();
    loop {
        let ks = keys("back", 2);
        let data = vec![pattern(1, MB), pattern(2, MB)];
        if store(&t, &ks, &data) == vec![OK; 2] {
            break;
        }
        assert!(start.elapsed().as_secs() < 20, "never reconnected over TLS");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert_eq!(lookup(&t, &keys("back", 2)), vec![OK; 2]);
}

#[test]
fn a_tls_server_that_never_answers_starts_the_tier_down() {
    let certs = certs();
    // Connections land in the listener's backlog and are never answered.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("rediss://127.0.0.1:{}", silent.local_addr().unwrap().port());
    let mut c = config(&url, MB);
    c.connect_timeout = std::time::Duration::from_millis(300);
    c.tls.ca_file = Some(certs.join("ca.crt"));
    let t = Tier::connect(c, NS).unwrap();
    let why = t.startup_error().expect("started down");
    assert!(why.contains("TLS handshake: timed out"), "{why}");
}

/// A port that takes the connection and drops it (a proxy with no backend, a server going
/// down) is a reason to start down and retry, for either scheme: no evidence of the other
/// protocol, so no start-up error.
#[test]
fn a_port_that_drops_connections_starts_the_tier_down_for_either_scheme() {
    let certs = certs();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    // Left running: the process ends it.
    std::thread::spawn(move || {
        for c in l.incoming() {
            drop(c);
        }
    });
    let plain = Tier::connect(config(&format!("redis://127.0.0.1:{port}"), MB), NS).unwrap();
    assert!(plain
        .startup_error()
        .is_some_and(|e| e.contains("unreachable")));
    let mut c = config(&format!("rediss://127.0.0.1:{port}"), MB);
    c.tls.ca_file = Some(certs.join("ca.crt"));
    let tls = Tier::connect(c, NS).unwrap();
    assert!(tls
        .startup_error()
        .is_some_and(|e| e.contains("unreachable")));
}
