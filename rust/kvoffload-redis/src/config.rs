//! Tier configuration, its defaults and the allowed range of every field.

use crate::error::{RemoteError, Result};
use std::path::PathBuf;
use std::time::Duration;

/// What a `rediss://` connection verifies the server with, and presents to it. Verification is
/// always on: there is no field that turns it off.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM file of the CA certificates the server's chain must end at; `None`: the system's.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain, for servers that require one (`tls-auth-clients yes`).
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file` (PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<PathBuf>,
    /// The name the server's certificate must hold; `None`: the URL's host.
    pub server_name: Option<String>,
}

impl TlsConfig {
    /// The names of the fields that are set, for "set without rediss://" errors.
    pub fn set_fields(&self) -> Vec<&'static str> {
        [
            ("tls_ca_file", self.ca_file.is_some()),
            ("tls_cert_file", self.cert_file.is_some()),
            ("tls_key_file", self.key_file.is_some()),
            ("tls_server_name", self.server_name.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
    }
}

/// Its `Debug` shows the url with its password masked.
#[derive(Clone)]
pub struct Config {
    /// `redis://...`, `rediss://...` or `unix://...`, see [`crate::url`].
    pub url: String,
    /// The size of every chunk of this tier, so the split layout is known before any I/O.
    pub chunk_bytes: usize,
    pub connect_timeout: Duration,
    /// The fixed part of a job's deadline.
    pub job_timeout: Duration,
    /// Bytes/s a job may assume on top of `job_timeout`: deadline = job_timeout + bytes / this.
    pub min_bandwidth: u64,
    /// Worker threads, one connection each.
    pub connections: usize,
    /// Consecutive failed jobs that open the breaker.
    pub breaker_failures: u32,
    pub breaker_cooldown: Duration,
    /// Expiry of stored chunks (`PX`); `None` keeps them until Redis evicts them.
    pub ttl: Option<Duration>,
    /// Store bytes queued or running beyond which new stores are dropped.
    pub max_store_bytes_in_flight: u64,
    /// Refresh the LRU clock of hit keys (EXISTS does not), so hot prefixes survive eviction.
    pub touch_on_hit: bool,
    /// Used only (and required to be empty otherwise) with a `rediss://` URL.
    pub tls: TlsConfig,
    /// Redis Cluster: `None` asks the first seed that answers (`cluster_enabled`).
    pub cluster: Option<bool>,
    /// Where the password is read from instead of the URL (which vLLM logs): a file, or an
    /// environment variable; read at start-up and again when the server refuses it.
    pub password_file: Option<PathBuf>,
    pub password_env: Option<String>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("url", &crate::url::mask(&self.url))
            .field("chunk_bytes", &self.chunk_bytes)
            .field("connections", &self.connections)
            .field("tls", &self.tls)
            .field("cluster", &self.cluster)
            .field("password_file", &self.password_file)
            .field("password_env", &self.password_env)
            .finish_non_exhaustive()
    }
}

pub const MAX_CHUNK_BYTES: usize = 256 << 20;
pub const TIMEOUT_MIN: Duration = Duration::from_millis(1);
pub const TIMEOUT_MAX: Duration = Duration::from_secs(600);
pub const MIN_BANDWIDTH_RANGE: (u64, u64) = (100_000, 10_000_000_000_000);
pub const MAX_CONNECTIONS: usize = 64;
pub const MAX_BREAKER_FAILURES: u32 = 1000;
pub const TTL_MAX: Duration = Duration::from_secs(10 * 365 * 86400);
pub const MAX_STORE_BYTES_IN_FLIGHT: u64 = 1 << 40;

impl Config {
    pub fn new(url: impl Into<String>, chunk_bytes: usize) -> Config {
        Config {
            url: url.into(),
            chunk_bytes,
            connect_timeout: Duration::from_secs(1),
            job_timeout: Duration::from_secs(2),
            min_bandwidth: 100_000_000,
            connections: 2,
            breaker_failures: 3,
            breaker_cooldown: Duration::from_secs(2),
            ttl: None,
            max_store_bytes_in_flight: 1 << 30,
            touch_on_hit: true,
            tls: TlsConfig::default(),
            cluster: None,
            password_file: None,
            password_env: None,
        }
    }

    pub fn validate(&self) -> Result<()> {
        fn range<T: PartialOrd + std::fmt::Debug>(name: &str, v: T, lo: T, hi: T) -> Result<()> {
            if v < lo || v > hi {
                return Err(RemoteError::Config(format!(
                    "{name}={v:?} is out of range; allowed: {lo:?}..={hi:?}"
                )));
            }
            Ok(())
        }
        range("chunk_bytes", self.chunk_bytes, 1, MAX_CHUNK_BYTES)?;
        range(
            "connect_timeout",
            self.connect_timeout,
            TIMEOUT_MIN,
            TIMEOUT_MAX,
        )?;
        range("job_timeout", self.job_timeout, TIMEOUT_MIN, TIMEOUT_MAX)?;
        let (lo, hi) = MIN_BANDWIDTH_RANGE;
        range("min_bandwidth (bytes/s)", self.min_bandwidth, lo, hi)?;
        range("connections", self.connections, 1, MAX_CONNECTIONS)?;
        range(
            "breaker_failures",
            self.breaker_failures,
            1,
            MAX_BREAKER_FAILURES,
        )?;
        range(
            "breaker_cooldown",
            self.breaker_cooldown,
            TIMEOUT_MIN,
            TIMEOUT_MAX,
        )?;
        if let Some(ttl) = self.ttl {
            range("ttl", ttl, TIMEOUT_MIN, TTL_MAX)?;
        }
        range(
            "max_store_bytes_in_flight",
            self.max_store_bytes_in_flight,
            self.chunk_bytes as u64,
            MAX_STORE_BYTES_IN_FLIGHT,
        )?;
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            return Err(RemoteError::Config(format!(
                "tls_cert_file={:?} and tls_key_file={:?}: a client certificate needs both \
                 (or neither)",
                self.tls.cert_file, self.tls.key_file
            )));
        }
        if let Some(name) = &self.tls.server_name {
            if name.is_empty() || name.len() > 253 {
                return Err(RemoteError::Config(format!(
                    "tls_server_name={name:?} is invalid; allowed: a DNS name or IP address"
                )));
            }
        }
        Ok(())
    }

    /// The deadline budget of a job that moves `bytes` of payload.
    pub fn job_budget(&self, bytes: u64) -> Duration {
        self.job_timeout + Duration::from_secs_f64(bytes as f64 / self.min_bandwidth as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_ranges_named() {
        Config::new("redis://h", 1 << 20).validate().unwrap();
        let mut c = Config::new("redis://h", 1 << 20);
        c.connections = 0;
        let msg = c.validate().unwrap_err().to_string();
        assert!(
            msg.contains("connections=0") && msg.contains("allowed"),
            "{msg}"
        );
        let mut c = Config::new("redis://h", 1 << 20);
        c.max_store_bytes_in_flight = 10;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("max_store_bytes_in_flight"));
        let c = Config::new("redis://h", 0);
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("chunk_bytes"));
        let c = Config::new("redis://h", 1 << 20);
        assert_eq!(c.job_budget(200_000_000), Duration::from_secs(4));
    }
}
