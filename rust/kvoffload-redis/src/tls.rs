//! TLS for `rediss://` URLs, with rustls (ring): the client configuration built once per tier
//! from [`TlsConfig`], shared by every connection. The server's certificate is always verified,
//! against `ca_file` or the system's roots, for `server_name` or the host connected to (each
//! node of a cluster its own).

use crate::config::TlsConfig;
use crate::error::{RemoteError, Result};
use crate::url::{Endpoint, ServerUrl};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ConfigBuilder, RootCertStore, WantsVerifier};
use std::path::Path;
use std::sync::Arc;

/// What every TLS connection of a tier starts from.
#[derive(Clone)]
pub struct TlsClient {
    pub config: Arc<ClientConfig>,
    /// `tls_server_name`, for every host; `None`: each host's own name.
    pub name: Option<ServerName<'static>>,
}

fn server_name(name: &str, what: &str) -> Result<ServerName<'static>> {
    ServerName::try_from(name.to_string()).map_err(|e| {
        RemoteError::Config(format!(
            "{what} {name:?} is not a DNS name or IP address a certificate can hold: {e}"
        ))
    })
}

impl TlsClient {
    /// The name the certificate of `endpoint` must hold.
    pub fn name_for(&self, endpoint: &Endpoint) -> Result<ServerName<'static>> {
        match (&self.name, endpoint) {
            (Some(name), _) => Ok(name.clone()),
            (None, Endpoint::Tcp { host, .. }) => server_name(host, "tls host"),
            (None, Endpoint::Unix(_)) => Err(RemoteError::Config(
                "TLS over a unix socket; allowed: rediss:// to a TCP host".into(),
            )),
        }
    }
}

fn config_err(key: &str, path: &Path, why: impl std::fmt::Display) -> RemoteError {
    RemoteError::Config(format!("{key}={:?}: {why}", path.display().to_string()))
}

fn certs(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| config_err(key, path, format!("cannot read it: {e}")))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| config_err(key, path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(config_err(key, path, "holds no PEM certificate"));
    }
    Ok(certs)
}

fn roots(tls: &TlsConfig) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    match &tls.ca_file {
        Some(path) => {
            let (_, ignored) = roots.add_parsable_certificates(certs("tls_ca_file", path)?);
            if roots.is_empty() {
                return Err(config_err(
                    "tls_ca_file",
                    path,
                    format!("none of its certificates is a usable CA ({ignored} refused)"),
                ));
            }
        }
        None => {
            // SSL_CERT_FILE / SSL_CERT_DIR are honoured, as OpenSSL does.
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(RemoteError::Config(format!(
                    "rediss:// without tls_ca_file uses the system's CA certificates, and none \
                     were found ({:?}); set tls_ca_file to the PEM file of the server's CA",
                    found.errors.first().map(|e| e.to_string())
                )));
            }
        }
    }
    Ok(roots)
}

/// A client configuration with our crypto provider and protocol versions, roots still to come.
pub(crate) fn builder() -> Result<ConfigBuilder<ClientConfig, WantsVerifier>> {
    // ring, not aws-lc-rs: it builds with a C compiler alone, as the zig-linked wheel needs.
    // Its only lack (why rustls deprecates it) is post-quantum key exchange.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| RemoteError::Config(format!("TLS set-up: {e}")))
}

/// The tier's TLS client for `url`, or `None` for a plain URL (whose `tls` must then be empty).
pub fn client(url: &ServerUrl, tls: &TlsConfig) -> Result<Option<TlsClient>> {
    if !url.tls {
        let set = tls.set_fields();
        if set.is_empty() {
            return Ok(None);
        }
        return Err(RemoteError::Config(format!(
            "{} set, but the url is not a TLS URL; allowed: rediss://... or valkeys://... with \
             the TLS options, or no TLS option",
            set.join(", ")
        )));
    }
    let name = match &tls.server_name {
        Some(n) => Some(server_name(n, "tls_server_name")?),
        None => {
            // Each seed's host must be a name a certificate can hold: found out here, not at
            // the first connection.
            for (host, _) in &url.seeds {
                server_name(host, "the url's host")?;
            }
            None
        }
    };
    let builder = builder()?.with_root_certificates(roots(tls)?);
    let config = match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => {
            let chain = certs("tls_cert_file", cert)?;
            let key_der = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| config_err("tls_key_file", key, format!("no PEM private key: {e}")))?;
            builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                config_err(
                    "tls_key_file",
                    key,
                    format!("does not go with tls_cert_file: {e}"),
                )
            })?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(Some(TlsClient {
        config: Arc::new(config),
        name,
    }))
}
