//! The password a tier authenticates with: in its URL, or (so that it is not in the
//! configuration vLLM logs) read from a file (`password_file`, as Kubernetes mounts a secret) or
//! an environment variable (`password_env`). A file or a variable is read at start-up, and again
//! when the server refuses the password at a connect, so a rotated secret is taken without a
//! restart. No message here ever holds a password: only where it was looked for.

use crate::config::Config;
use crate::error::{RemoteError, Result};
use crate::url::ServerUrl;
use std::path::PathBuf;
use std::sync::Mutex;

enum Source {
    Url,
    File(PathBuf),
    Env(String),
}

pub(crate) struct Credentials {
    username: Option<String>,
    source: Source,
    password: Mutex<Option<String>>,
}

impl Credentials {
    pub fn new(url: &ServerUrl, cfg: &Config) -> Result<Credentials> {
        let source = match (&cfg.password_file, &cfg.password_env) {
            (Some(_), Some(_)) => {
                return Err(RemoteError::Config(
                    "password_file and password_env are both set; allowed: one of them".into(),
                ))
            }
            (Some(path), None) => Source::File(path.clone()),
            (None, Some(name)) => Source::Env(name.clone()),
            (None, None) => Source::Url,
        };
        if !matches!(source, Source::Url) && url.password.is_some() {
            return Err(RemoteError::Config(
                "the url holds a password and password_file or password_env is set too; \
                 allowed: the password in one place (password_file or password_env: the url \
                 is in the configuration vLLM logs)"
                    .into(),
            ));
        }
        let password = match &source {
            Source::Url => url.password.clone(),
            other => Some(read(other)?),
        };
        if url.username.is_some() && password.is_none() {
            return Err(RemoteError::Config(
                "the url names a user without a password; allowed: a password with it \
                 (password_file or password_env)"
                    .into(),
            ));
        }
        Ok(Credentials {
            username: url.username.clone(),
            source,
            password: Mutex::new(password),
        })
    }

    pub fn username(&self) -> Option<&str> {
        self.username.as_deref()
    }

    pub fn password(&self) -> Option<String> {
        self.password
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Reads the file or the variable again (the server refused the password). One that
    /// cannot be read leaves the last.
    pub fn reread(&self) {
        if matches!(self.source, Source::Url) {
            return;
        }
        if let Ok(new) = read(&self.source) {
            *self.password.lock().unwrap_or_else(|p| p.into_inner()) = Some(new);
        }
    }

    /// Where the password comes from, for messages (never the password).
    pub fn origin(&self) -> String {
        match &self.source {
            Source::Url => "of the url".into(),
            Source::File(p) => format!("of password_file={}", p.display()),
            Source::Env(name) => format!("of password_env={name}"),
        }
    }
}

fn read(source: &Source) -> Result<String> {
    let (text, what) = match source {
        Source::Url => unreachable!("a url's password is not read"),
        Source::File(path) => {
            let what = format!("password_file={}", path.display());
            let text = std::fs::read_to_string(path)
                .map_err(|e| RemoteError::Config(format!("{what}: cannot read it: {e}")))?;
            (text, what)
        }
        Source::Env(name) => {
            let what = format!("password_env={name}");
            let text = std::env::var(name).map_err(|_| {
                RemoteError::Config(format!(
                    "{what}: the environment variable is not set (or not UTF-8)"
                ))
            })?;
            (text, what)
        }
    };
    // A file written by `echo` ends in a newline that is not the password's (trailing newlines
    // and carriage returns are never part of it).
    let password = text.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(RemoteError::Config(format!("{what}: it is empty")));
    }
    Ok(password.to_owned())
}
