//! Where a chunk's file lives, and opening files with or without `O_DIRECT`.

use crate::aligned::ALIGN;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// The header's block: the 64-byte header, zero-padded, so the payload starts aligned.
pub const HEADER_BLOCK: usize = ALIGN;
/// The directory of one namespace: `kvo1-` + its digest in hex. A new file layout gets a new
/// prefix, so files of another layout or namespace are never read, nor removed.
pub const DIR_PREFIX: &str = "kvo1-";
/// Files being written: invisible to readers until renamed.
pub const TMP_PREFIX: &str = ".tmp-";
/// Keys longer than this are refused: a file name holds two hex digits a byte, 255 at most.
pub const MAX_KEY_BYTES: usize = 120;

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * bytes.len());
    for &b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
    out
}

/// The bytes of a name `hex` wrote (lowercase digits only: any other spelling is not a chunk's
/// file name).
pub fn unhex(name: &str) -> Option<Vec<u8>> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    let raw = name.as_bytes();
    if raw.len() % 2 != 0 {
        return None;
    }
    raw.chunks_exact(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

/// The subdirectory of `key`'s file: `fan_name(key_digest(key)[0])`.
pub fn fan_of(key: &[u8]) -> u8 {
    kvoffload_tier::key_digest(key)[0]
}

/// `dir/<2 hex digits of the key's digest>/<key in hex>`: 256 subdirectories, so none grows to
/// millions of entries.
pub fn chunk_path(dir: &Path, key: &[u8]) -> PathBuf {
    dir.join(hex(&[fan_of(key)])).join(hex(key))
}

/// Bytes of a chunk's file: the header block and the payload, padded to a whole block.
pub fn file_len(chunk_bytes: usize) -> u64 {
    (HEADER_BLOCK + crate::aligned::round_up(chunk_bytes)) as u64
}

/// The mode of the tier's directories for files of `file_mode`: search where read is given.
pub fn dir_mode(file_mode: u32) -> u32 {
    file_mode | ((file_mode & 0o444) >> 2)
}

/// A new file of `mode`, never through a symlink. The umask may only have taken bits away: they
/// are put back, where the filesystem lets modes be set at all (vfat, some FUSE and CIFS mounts
/// refuse: their own modes stand).
pub fn create(path: &Path, direct: bool, mode: u32) -> io::Result<File> {
    let mut o = OpenOptions::new();
    let flags = libc::O_NOFOLLOW | if direct { libc::O_DIRECT } else { 0 };
    o.write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(flags);
    let f = o.open(path)?;
    let now = f.metadata().map(|m| m.permissions().mode() & 0o777);
    if now.is_ok_and(|m| m != mode) {
        if let Err(e) = f.set_permissions(std::fs::Permissions::from_mode(mode)) {
            if !modes_unsupported(&e) {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        }
    }
    Ok(f)
}

/// A filesystem that does not keep Unix modes.
fn modes_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EPERM | libc::ENOTSUP | libc::ENOSYS)
    )
}

/// Sets `path`'s permission bits to `mode`, keeping its set-group-ID bit (a directory of a
/// group-shared cache passes its group on to what is created in it). Best effort where the
/// filesystem keeps no modes.
pub fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
    let now = std::fs::symlink_metadata(path)?.permissions().mode();
    if now & 0o777 == mode {
        return Ok(());
    }
    let keep = now & libc::S_ISGID;
    match std::fs::set_permissions(path, std::fs::Permissions::from_mode(keep | mode)) {
        Err(e) if modes_unsupported(&e) => Ok(()),
        other => other,
    }
}

/// Opens a chunk's file to read, never through a symlink (`ELOOP`: see [`is_symlink_error`]).
pub fn open(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    let flags = libc::O_NOFOLLOW | if direct { libc::O_DIRECT } else { 0 };
    o.read(true).custom_flags(flags);
    o.open(path)
}

/// The error of opening a symlink with `O_NOFOLLOW`.
pub fn is_symlink_error(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ELOOP)
}

/// Whether `dir` is a directory itself, not a symlink to one (`None`: it is not there).
pub fn real_dir(dir: &Path) -> io::Result<Option<bool>> {
    match std::fs::symlink_metadata(dir) {
        Ok(m) => Ok(Some(m.file_type().is_dir())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Creates `dir` and the directories above it that are missing, each of exactly `mode`.
pub fn make_dirs(dir: &Path, mode: u32) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        make_dirs(parent, mode)?;
    }
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => set_mode(dir, mode),
        // Another engine made it meanwhile.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(e),
    }
}

/// Tells the kernel the file's cached pages are not wanted again (buffered I/O: the tier's bytes
/// must not push the engine's own out of the page cache). Best effort.
pub fn drop_cache(f: &File) {
    // SAFETY: a valid descriptor; the call only advises the kernel.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// Reads `bufs` in order from `offset`, in one `preadv` where the kernel gives it all (a header
/// block and its payload: one I/O, not two); a short read is finished buffer by buffer. The end
/// of the file before the last byte: `UnexpectedEof`.
pub fn read_all_at(f: &File, bufs: &mut [&mut [u8]], offset: u64) -> io::Result<()> {
    let iov: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: each iovec is a live, exclusively borrowed buffer of its length.
    let n = retry(|| unsafe {
        libc::preadv(
            f.as_raw_fd(),
            iov.as_ptr(),
            iov.len() as libc::c_int,
            offset as libc::off_t,
        )
    })?;
    let mut got = n;
    let mut at = offset;
    for b in bufs.iter_mut() {
        let len = b.len();
        if got < len {
            f.read_exact_at(&mut b[got..], at + got as u64)?;
        }
        got = got.saturating_sub(len);
        at += len as u64;
    }
    Ok(())
}

/// Writes `bufs` in order from `offset`, in one `pwritev` where the kernel takes it all; a
/// short write is finished buffer by buffer.
pub fn write_all_at(f: &File, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
    let iov: Vec<libc::iovec> = bufs
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: each iovec is a live buffer of its length, only read by the call.
    let n = retry(|| unsafe {
        libc::pwritev(
            f.as_raw_fd(),
            iov.as_ptr(),
            iov.len() as libc::c_int,
            offset as libc::off_t,
        )
    })?;
    let mut put = n;
    let mut at = offset;
    for b in bufs {
        if put < b.len() {
            f.write_all_at(&b[put..], at + put as u64)?;
        }
        put = put.saturating_sub(b.len());
        at += b.len() as u64;
    }
    Ok(())
}

/// A system call's byte count, again after `EINTR`.
fn retry(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
