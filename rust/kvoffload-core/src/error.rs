use std::fmt;

/// Every way a store or chunk call can refuse its input. A call that returns an error has changed
/// nothing. A variant carries all its message needs, so this module depends on no other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// `keys[index]` has a length outside `1..=max` (`MAX_KEY_LEN`).
    InvalidKeyLength {
        index: usize,
        len: usize,
        max: usize,
    },
    /// A numeric argument is outside its allowed range.
    InvalidArgument {
        name: &'static str,
        value: String,
        allowed: &'static str,
    },
    /// An eviction policy name that is not one of `allowed` (`POLICY_NAMES`).
    UnknownPolicy {
        name: String,
        allowed: &'static [&'static str],
    },
    /// Memory for `what` (about `bytes` bytes) could not be allocated; nothing changed.
    OutOfMemory { what: &'static str, bytes: usize },
    /// `check_invariants` found the store inconsistent (a bug): what is broken.
    BrokenInvariant(String),
    /// `keys[index]` is not in the state the call needs (e.g. loading a key that is not ready,
    /// unpinning a key that is not pinned, completing a store that is not pending).
    InvalidState {
        op: &'static str,
        index: usize,
        key: Vec<u8>,
        state: &'static str,
        needed: &'static str,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidKeyLength { index, len, max } => write!(
                f,
                "keys[{index}] has length {len}; keys must be 1..={max} bytes"
            ),
            Error::InvalidArgument {
                name,
                value,
                allowed,
            } => {
                write!(f, "{name}={value} is invalid; allowed: {allowed}")
            }
            Error::UnknownPolicy { name, allowed } => write!(
                f,
                "eviction_policy={name:?} is unknown; valid policies: {}",
                allowed.join(", ")
            ),
            Error::OutOfMemory { what, bytes } => {
                write!(
                    f,
                    "out of memory: could not grow {what} to about {bytes} bytes"
                )
            }
            Error::BrokenInvariant(what) => write!(f, "store invariant broken: {what}"),
            Error::InvalidState {
                op,
                index,
                key,
                state,
                needed,
            } => write!(
                f,
                "{op}: keys[{index}] (0x{}) is {state}, needs to be {needed}",
                hex(key)
            ),
        }
    }
}

impl std::error::Error for Error {}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub type Result<T> = std::result::Result<T, Error>;
