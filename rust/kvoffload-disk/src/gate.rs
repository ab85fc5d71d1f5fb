//! Whether stores are written now: a full filesystem or a read-only directory drops them at once,
//! with no I/O, instead of failing each one against the disk; reads go on. Writing resumes by
//! itself: on a full filesystem as soon as it has room for a file again (blocks and an inode,
//! looked up with statvfs, no write; and one store tried every `FULL_RETRY`, for blocks reserved
//! to root), over a quota (which statvfs does not see) by one store tried every `FULL_RETRY`, on
//! a read-only one when the directory is writable again (access(2), checked every
//! `READ_ONLY_RECHECK`: never a write tried in a loop).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const FULL_RETRY: Duration = Duration::from_secs(5);
const READ_ONLY_RECHECK: Duration = Duration::from_secs(30);

/// What stores do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writes {
    Open,
    /// The filesystem is full (or over quota): stores are dropped until it has room.
    Full,
    /// The directory cannot be written (read-only, or no permission): stores are dropped.
    ReadOnly,
}

impl Writes {
    pub fn name(self) -> &'static str {
        match self {
            Writes::Open => "ok",
            Writes::Full => "full",
            Writes::ReadOnly => "read-only",
        }
    }
}

/// Why a store was not let through, or shut writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shut {
    /// `ENOSPC` (the filesystem) or `EDQUOT` (this user's quota: statvfs cannot tell).
    Full {
        quota: bool,
    },
    ReadOnly,
}

struct State {
    writes: Writes,
    quota: bool,
    /// When a store may next be tried (full) or the directory checked again (read-only).
    next: Instant,
}

pub(crate) struct Gate {
    state: Mutex<State>,
    /// `read_only: true`: never written, never checked.
    configured_read_only: bool,
    /// The tier's directory, and the bytes of one file.
    dir: PathBuf,
    file_bytes: u64,
}

impl Gate {
    pub fn new(dir: PathBuf, file_bytes: u64, read_only: bool) -> Gate {
        Gate {
            state: Mutex::new(State {
                writes: if read_only {
                    Writes::ReadOnly
                } else {
                    Writes::Open
                },
                quota: false,
                next: Instant::now(),
            }),
            configured_read_only: read_only,
            dir,
            file_bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn writes(&self) -> Writes {
        self.lock().writes
    }

    /// Whether a store is to be written now (`Ok`), or dropped, and why.
    pub fn admit(&self, now: Instant) -> Result<(), Shut> {
        let mut s = self.lock();
        match s.writes {
            Writes::Open => Ok(()),
            Writes::ReadOnly if self.configured_read_only => Err(Shut::ReadOnly),
            Writes::ReadOnly => {
                if now < s.next {
                    return Err(Shut::ReadOnly);
                }
                if writable(&self.dir) {
                    s.writes = Writes::Open;
                    return Ok(());
                }
                s.next = now + READ_ONLY_RECHECK;
                Err(Shut::ReadOnly)
            }
            Writes::Full => {
                // A store goes once there is room for its file, or as a trial every FULL_RETRY
                // (a quota, or blocks reserved for root, are not in statvfs's free count). It
                // reopens the gate only when it is written.
                let room = !s.quota && has_room(&self.dir, self.file_bytes);
                if now >= s.next || room {
                    s.next = now + FULL_RETRY;
                    return Ok(());
                }
                Err(Shut::Full { quota: s.quota })
            }
        }
    }

    /// A store was written: the filesystem takes writes again.
    pub fn written(&self) {
        let mut s = self.lock();
        if s.writes == Writes::Full {
            s.writes = Writes::Open;
        }
    }

    /// A store failed because the filesystem is full (`Full`) or refuses writes (`ReadOnly`).
    pub fn shut(&self, why: Shut, now: Instant) {
        let mut s = self.lock();
        (s.writes, s.quota, s.next) = match why {
            Shut::Full { quota } => (Writes::Full, quota, now + FULL_RETRY),
            Shut::ReadOnly => (Writes::ReadOnly, false, now + READ_ONLY_RECHECK),
        };
    }
}

fn c_path(path: &Path) -> Option<CString> {
    CString::new(path.as_os_str().as_bytes()).ok()
}

/// The directory, or the nearest parent that exists (the tier's own may not be created yet).
fn existing(dir: &Path) -> Option<&Path> {
    dir.ancestors().find(|p| p.exists())
}

/// Whether this process may create files in `dir` (the filesystem mounted read-write, and the
/// permission), asked of the kernel without writing.
fn writable(dir: &Path) -> bool {
    let Some(path) = existing(dir).and_then(c_path) else {
        return false;
    };
    // SAFETY: a NUL-terminated path; access(2) only reads it.
    unsafe { libc::access(path.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

/// Whether `dir`'s filesystem has room for a file of `bytes` for an unprivileged writer: the
/// blocks, and an inode (where it counts them: some report none at all).
fn has_room(dir: &Path, bytes: u64) -> bool {
    let Some(path) = existing(dir).and_then(c_path) else {
        return false;
    };
    // SAFETY: a zeroed statvfs is a valid out-parameter; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return false;
    }
    let blocks = st.f_bavail as u64 * st.f_frsize as u64 >= bytes;
    blocks && (st.f_files == 0 || st.f_favail > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_filesystem_lets_a_store_through_when_there_is_room_or_after_the_retry() {
        let dir = std::env::temp_dir();
        // Room for a byte: statvfs lets the next store through at once.
        let g = Gate::new(dir.clone(), 1, false);
        let t = Instant::now();
        g.shut(Shut::Full { quota: false }, t);
        assert_eq!(g.writes(), Writes::Full);
        assert_eq!(g.admit(t), Ok(()));
        assert_eq!(g.writes(), Writes::Full); // until one is written
        g.written();
        assert_eq!(g.writes(), Writes::Open);
        // No filesystem has room for this file: one trial every FULL_RETRY, the rest dropped.
        let full = Err(Shut::Full { quota: false });
        let g = Gate::new(dir.clone(), u64::MAX, false);
        g.shut(Shut::Full { quota: false }, t);
        assert_eq!(g.admit(t), full);
        assert_eq!(g.admit(t + FULL_RETRY), Ok(()));
        assert_eq!(g.admit(t + FULL_RETRY), full);
        // Over a quota statvfs shows room that is not ours: only the timed trial goes.
        let g = Gate::new(dir, 1, false);
        g.shut(Shut::Full { quota: true }, t);
        assert_eq!(g.admit(t), Err(Shut::Full { quota: true }));
        assert_eq!(g.admit(t + FULL_RETRY), Ok(()));
    }

    #[test]
    fn read_only_is_checked_again_only_after_the_recheck_and_never_when_configured() {
        let t = Instant::now();
        let g = Gate::new(std::env::temp_dir(), 1, false);
        g.shut(Shut::ReadOnly, t);
        assert_eq!(g.admit(t), Err(Shut::ReadOnly));
        // The directory is writable (the temporary directory): open again at the recheck.
        assert_eq!(g.admit(t + READ_ONLY_RECHECK), Ok(()));
        assert_eq!(g.writes(), Writes::Open);
        let g = Gate::new(std::env::temp_dir(), 1, true);
        assert_eq!(g.admit(t + READ_ONLY_RECHECK * 10), Err(Shut::ReadOnly));
    }
}
