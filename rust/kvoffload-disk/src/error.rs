//! What can go wrong on the disk tier.

use crate::gate::Shut;
use std::fmt;
use std::io;

#[derive(Debug)]
pub enum DiskError {
    /// A setting that cannot work; the message names the key and the value.
    Config(String),
    /// The filesystem failed: what was being done, and the error.
    Io(String, io::Error),
}

pub type Result<T> = std::result::Result<T, DiskError>;

impl DiskError {
    pub(crate) fn io(what: impl Into<String>, e: io::Error) -> DiskError {
        DiskError::Io(what.into(), e)
    }

    /// The filesystem is full (or over quota): a store is dropped, the tier keeps serving.
    pub fn is_full(&self) -> bool {
        matches!(self, DiskError::Io(_, e) if is_full(e))
    }

    /// The directory refuses writes (`EROFS`, `EACCES`, `EPERM`): the tier serves reads.
    pub fn is_read_only(&self) -> bool {
        matches!(self, DiskError::Io(_, e) if is_read_only(e))
    }

    /// A symlink met where a chunk's file or subdirectory should be: a miss, not a fault.
    pub fn is_symlink(&self) -> bool {
        matches!(self, DiskError::Io(_, e) if e.raw_os_error() == Some(libc::ELOOP))
    }

    /// Whether a store that failed so shuts writes (a full or read-only filesystem), and why.
    pub(crate) fn shut(&self) -> Option<Shut> {
        let DiskError::Io(_, e) = self else {
            return None;
        };
        match e.raw_os_error() {
            Some(libc::EDQUOT) => Some(Shut::Full { quota: true }),
            Some(libc::ENOSPC) => Some(Shut::Full { quota: false }),
            _ if is_read_only(e) => Some(Shut::ReadOnly),
            _ => None,
        }
    }
}

/// The filesystem refuses writes to the tier's directory (mounted read-only, or no permission):
/// stores are dropped, reads go on.
pub(crate) fn is_read_only(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EROFS | libc::EACCES | libc::EPERM)
    )
}

/// The filesystem has no room (or the quota is spent).
pub(crate) fn is_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

impl fmt::Display for DiskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiskError::Config(m) => write!(f, "disk tier: {m}"),
            DiskError::Io(what, e) => write!(f, "disk tier: {what}: {e}"),
        }
    }
}

impl std::error::Error for DiskError {}
