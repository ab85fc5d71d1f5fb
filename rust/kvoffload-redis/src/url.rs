//! Server URLs: `redis://[user:pass@]host[:port][,host[:port]...][/db]` (`rediss://` for TLS;
//! `valkey://` and `valkeys://` are the same; several hosts are a cluster's seed nodes) and
//! `unix://path[?db=N&password=P]`.

use crate::error::{RemoteError, Result};
use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp { host, port } if host.contains(':') => write!(f, "[{host}]:{port}"),
            Endpoint::Tcp { host, port } => write!(f, "{host}:{port}"),
            Endpoint::Unix(path) => write!(f, "{}", path.display()),
        }
    }
}

/// Its `Debug` shows no password.
#[derive(Clone, PartialEq, Eq)]
pub struct ServerUrl {
    pub endpoint: Endpoint,
    pub username: Option<String>,
    pub password: Option<String>,
    pub db: u32,
    /// `rediss://` / `valkeys://`: the connection is TLS, never plain.
    pub tls: bool,
    /// Every host of a TCP URL in order (`endpoint` is the first): a cluster's seed nodes.
    pub seeds: Vec<(String, u16)>,
}

const ALLOWED: &str = "allowed: redis://[user:password@]host[:port][,host[:port]...][/db] \
                       (rediss:// for TLS) or unix:///path/to.sock[?db=N&password=P]";

/// The URL with its password replaced, for messages and logs. The credentials end at the last
/// `@`, as in [`parse`], so a password holding an unescaped `@` is hidden whole.
pub fn mask(url: &str) -> String {
    let masked = match url.split_once("://") {
        // A unix socket path may hold an `@`; its password is only ever in the query.
        Some((scheme, rest)) if scheme != "unix" => match rest.rsplit_once('@') {
            // A user alone (its password in password_file or password_env) has nothing to hide.
            Some((auth, tail)) => match auth.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{tail}"),
                None => url.to_string(),
            },
            None => url.to_string(),
        },
        _ => url.to_string(),
    };
    mask_query(&masked)
}

/// Every query parameter's value replaced but `db`'s and the user's (a password, or a misspelt
/// name for one).
fn mask_query(url: &str) -> String {
    let Some((head, query)) = url.split_once('?') else {
        return url.to_string();
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name @ ("db" | "user" | "username"), v)) => format!("{name}={v}"),
            Some((name, _)) => format!("{name}=***"),
            None => pair.to_string(),
        })
        .collect();
    format!("{head}?{}", pairs.join("&"))
}

fn bad(url: &str, why: &str) -> RemoteError {
    RemoteError::Config(format!("url {:?}: {why}; {ALLOWED}", mask(url)))
}

/// `%XX` escapes, so passwords may hold `@`, `:` or `/`.
fn decode(url: &str, s: &str) -> Result<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| bad(url, "bad %-escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad(url, "credentials are not UTF-8"))
}

fn parse_db(url: &str, s: &str) -> Result<u32> {
    s.parse::<u32>()
        .ok()
        .filter(|&d| d < 1 << 16)
        .ok_or_else(|| {
            bad(
                url,
                &format!("database {s:?} is not an integer in 0..65536"),
            )
        })
}

impl std::fmt::Debug for ServerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerUrl")
            .field("endpoint", &self.endpoint)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("db", &self.db)
            .field("tls", &self.tls)
            .field("seeds", &self.seeds)
            .finish()
    }
}

pub fn parse(url: &str) -> Result<ServerUrl> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(bad(url, "unknown scheme"));
    };
    match scheme {
        "redis" | "valkey" => parse_tcp(url, rest, false),
        "rediss" | "valkeys" => parse_tcp(url, rest, true),
        "unix" => parse_unix(url, rest),
        _ => Err(bad(url, "unknown scheme")),
    }
}

fn parse_tcp(url: &str, rest: &str, tls: bool) -> Result<ServerUrl> {
    if rest.contains('?') || rest.contains('#') {
        return Err(bad(
            url,
            "query strings are only supported for unix:// URLs",
        ));
    }
    let (auth, hostpart) = match rest.rsplit_once('@') {
        Some((a, h)) => (Some(a), h),
        None => (None, rest),
    };
    let (username, password) = match auth {
        None => (None, None),
        Some(a) => {
            let (u, p) = a.split_once(':').unwrap_or((a, ""));
            let u = decode(url, u)?;
            let p = decode(url, p)?;
            if p.is_empty() && u.is_empty() {
                return Err(bad(url, "credentials given without a user or a password"));
            }
            // A user alone: its password comes from password_file or password_env.
            ((!u.is_empty()).then_some(u), (!p.is_empty()).then_some(p))
        }
    };
    let (hostport, db) = match hostpart.split_once('/') {
        Some((hp, "")) => (hp, 0),
        Some((hp, d)) => (hp, parse_db(url, d)?),
        None => (hostpart, 0),
    };
    let seeds = hostport
        .split(',')
        .map(|hp| host_port(url, hp))
        .collect::<Result<Vec<_>>>()?;
    let (host, port) = seeds[0].clone();
    Ok(ServerUrl {
        endpoint: Endpoint::Tcp { host, port },
        username,
        password,
        db,
        tls,
        seeds,
    })
}

fn host_port(url: &str, hostport: &str) -> Result<(String, u16)> {
    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let (h, after) = v6
            .split_once(']')
            .ok_or_else(|| bad(url, "unclosed '[' in IPv6 host"))?;
        (h, after.strip_prefix(':'))
    } else {
        match hostport.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return Err(bad(url, "no host"));
    }
    let port = match port {
        None => 6379,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| bad(url, &format!("port {p:?} is not an integer in 1..=65535")))?,
    };
    Ok((host.to_string(), port))
}

fn parse_unix(url: &str, rest: &str) -> Result<ServerUrl> {
    let (path, query) = match rest.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (rest, None),
    };
    if path.is_empty() {
        return Err(bad(url, "no socket path"));
    }
    let mut out = ServerUrl {
        endpoint: Endpoint::Unix(PathBuf::from(path)),
        username: None,
        password: None,
        db: 0,
        tls: false,
        seeds: Vec::new(),
    };
    for pair in query.into_iter().flat_map(|q| q.split('&')) {
        match pair.split_once('=') {
            Some(("db", v)) => out.db = parse_db(url, v)?,
            Some(("password", v)) if !v.is_empty() => out.password = Some(decode(url, v)?),
            Some(("user" | "username", v)) if !v.is_empty() => out.username = Some(decode(url, v)?),
            _ => {
                return Err(bad(
                    url,
                    &format!(
                        "unknown query parameter {:?} (allowed: db, password, user)",
                        // Its name only: a misspelt password parameter holds a password.
                        pair.split_once('=').map_or(pair, |(name, _)| name)
                    ),
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16) -> Endpoint {
        Endpoint::Tcp {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn tcp_forms() {
        let u = parse("redis://localhost").unwrap();
        assert_eq!(
            (u.endpoint, u.db, u.password),
            (tcp("localhost", 6379), 0, None)
        );
        let u = parse("redis://127.0.0.1:7000/3").unwrap();
        assert_eq!((u.endpoint, u.db), (tcp("127.0.0.1", 7000), 3));
        let u = parse("redis://:s%40cret@h:1/").unwrap();
        assert_eq!((u.username, u.password.as_deref()), (None, Some("s@cret")));
        let u = parse("redis://bob:pw@[::1]:6380/2").unwrap();
        assert_eq!(u.endpoint, tcp("::1", 6380));
        assert_eq!(
            (u.username.as_deref(), u.password.as_deref(), u.db),
            (Some("bob"), Some("pw"), 2)
        );
    }

    #[test]
    fn tls_schemes() {
        for url in ["rediss://u:p@h:6380/0", "valkeys://u:p@h:6380"] {
            let u = parse(url).unwrap();
            assert!(u.tls, "{url}");
            assert_eq!((u.endpoint, u.db), (tcp("h", 6380), 0));
            assert!(mask(url).contains("***"), "{url}");
        }
        assert!(!parse("redis://h").unwrap().tls);
        assert!(!parse("valkey://h").unwrap().tls);
    }

    #[test]
    fn seed_lists() {
        let u = parse("rediss://:pw@h1:7000,h2,[::1]:7002").unwrap();
        assert_eq!(u.endpoint, tcp("h1", 7000));
        assert_eq!(
            u.seeds,
            vec![
                ("h1".into(), 7000),
                ("h2".into(), 6379),
                ("::1".into(), 7002)
            ]
        );
        assert!(u.tls);
        assert_eq!(parse("redis://h").unwrap().seeds, vec![("h".into(), 6379)]);
        for bad in ["redis://h1,", "redis://h1,:7", "redis://h1,h2:0"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn unix_forms() {
        let u = parse("unix:///tmp/r.sock?db=4&password=x").unwrap();
        assert_eq!(u.endpoint, Endpoint::Unix("/tmp/r.sock".into()));
        assert_eq!((u.db, u.password.as_deref()), (4, Some("x")));
        let u = parse("unix://rel/r.sock").unwrap();
        assert_eq!(u.endpoint, Endpoint::Unix("rel/r.sock".into()));
    }

    #[test]
    fn errors_name_the_url_and_hide_the_password() {
        for (url, needle) in [
            ("http://h", "unknown scheme"),
            ("redis+tls://h", "unknown scheme"),
            ("redis://h:0", "port"),
            ("redis://h:99999", "port"),
            ("redis://h/x", "database"),
            ("redis://:hunter2@h:x", "port"),
            ("redis://", "no host"),
            ("unix://", "no socket path"),
            ("unix:///s?foo=1", "unknown query parameter"),
            ("redis://h?db=1", "query"),
        ] {
            let msg = parse(url).unwrap_err().to_string();
            assert!(msg.contains(needle), "{url}: {msg}");
            assert!(msg.contains("allowed"), "{url}: {msg}");
            assert!(!msg.contains("hunter2"), "{url}: {msg}");
        }
        assert_eq!(
            mask("unix:///s?password=abc&db=1"),
            "unix:///s?password=***&db=1"
        );
    }

    #[test]
    fn mask_splits_credentials_at_the_last_at_like_the_parser() {
        let url = "redis://u:p@ss@127.0.0.1:1/0";
        let u = parse(url).unwrap();
        assert_eq!(u.password.as_deref(), Some("p@ss"));
        assert_eq!(mask(url), "redis://u:***@127.0.0.1:1/0");
        assert_eq!(mask("redis://:a@b@c@h"), "redis://:***@h");
        assert_eq!(mask("valkey://h:1"), "valkey://h:1");
        // A user alone (its password in a file): shown as it is.
        assert_eq!(
            mask("rediss://kvoffload@h:6380"),
            "rediss://kvoffload@h:6380"
        );
        let u = parse("rediss://kvoffload@h:6380").unwrap();
        assert_eq!(
            (u.username.as_deref(), u.password),
            (Some("kvoffload"), None)
        );
        assert!(parse("redis://@h:1").is_err());
        // Debug of a parsed url never shows the password.
        let u = parse("redis://u:s3cret@h:1").unwrap();
        assert!(!format!("{u:?}").contains("s3cret"));
        // A misspelt password parameter is named, never echoed.
        let e = parse("unix:///s?pass=s3cret").unwrap_err().to_string();
        assert!(e.contains("\"pass\"") && !e.contains("s3cret"), "{e}");
        let msg = parse("redis://u:p@ss@h:x").unwrap_err().to_string();
        assert!(!msg.contains("ss@"), "{msg}");
    }

    #[test]
    fn mask_hides_every_unix_query_password() {
        assert_eq!(
            mask("unix:///tmp/a@b.sock?password=s3cret"),
            "unix:///tmp/a@b.sock?password=***"
        );
        assert_eq!(
            mask("unix:///s?db=1&password=x&password=y&user=u"),
            "unix:///s?db=1&password=***&password=***&user=u"
        );
        assert_eq!(mask("unix:///s?db=1"), "unix:///s?db=1");
    }
}
