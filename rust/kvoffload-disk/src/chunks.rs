//! `ChunkFiles`: the file I/O of chunks: store, load and remove each one as a file of its own.

use crate::aligned::{is_aligned, round_up, AlignedBuf, ALIGN};
use crate::config::{DirectIo, DiskConfig};
use crate::error::{is_full, is_read_only, DiskError, Result};
use crate::files::{self, HEADER_BLOCK, MAX_KEY_BYTES, TMP_PREFIX};
use crate::stats::{Counters, Stats};
use kvoffload_tier::{crc, Header, Layout, HEADER_LEN};
use std::fs::{self, File};
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// What a store did.
#[derive(Debug)]
pub enum Stored {
    Written,
    /// The chunk's file was there already: nothing written.
    Exists,
    /// Not written (the filesystem full, or failing): the error.
    Failed(DiskError),
}

/// What a load found.
#[derive(Debug)]
pub enum Loaded {
    /// `dest` holds the chunk, every check passed.
    Ok,
    Missing,
    /// A file that failed a check (why): removed, `dest` must not be used.
    Corrupt(&'static str),
    Failed(DiskError),
}

/// A scan of the directory: each chunk's key and its file's time, and whether every
/// subdirectory and file could be read.
pub type Listing = (Vec<(Vec<u8>, std::time::SystemTime)>, bool);

/// Whether reads and writes bypass the page cache: no, yes, or not known yet (buffered).
const DIRECT_NO: u8 = 0;
const DIRECT_YES: u8 = 1;
const DIRECT_UNKNOWN: u8 = 2;

pub struct ChunkFiles {
    dir: PathBuf,
    ns: [u8; 16],
    layout: Layout,
    direct: AtomicU8,
    /// `read_only: true`: nothing is written, removed or touched.
    read_only: bool,
    file_mode: u32,
    notes: Vec<String>,
    /// Temporary names are `.tmp-<nonce>-<seq>`: a nonce random per open, since engines in other
    /// containers or on other hosts sharing the directory may have this process's pid.
    nonce: u64,
    tmp_seq: AtomicU64,
    stats: Counters,
}

impl ChunkFiles {
    /// Opens the directory of namespace `ns` under `cfg.path` (creating it where it can) and
    /// finds out whether its filesystem takes `O_DIRECT`, by reading a chunk's file where there
    /// is one. Neither needs free space nor write permission: a full or read-only filesystem
    /// opens, serves what it holds, and says so in `notes`.
    pub fn open(cfg: DiskConfig, ns: [u8; 16]) -> Result<ChunkFiles> {
        cfg.check()?;
        let dir = cfg
            .path
            .join(format!("{}{}", files::DIR_PREFIX, files::hex(&ns)));
        let mut notes = Vec::new();
        let cannot_be_dir = |e: io::Error| {
            DiskError::io(
                format!(
                    "path={}: cannot create the tier's directory",
                    cfg.path.display()
                ),
                e,
            )
        };
        check_private(&cfg.path, &dir, cfg.file_mode)?;
        if cfg.read_only {
            if cfg.path.exists() && !cfg.path.is_dir() {
                return Err(cannot_be_dir(io::Error::from_raw_os_error(libc::ENOTDIR)));
            }
        } else if let Err(e) = files::make_dirs(&dir, files::dir_mode(cfg.file_mode)) {
            if !(is_read_only(&e) || is_full(&e)) {
                return Err(cannot_be_dir(e));
            }
            notes.push(format!(
                "cannot create {} ({e}): serving what is there, writing once it can",
                dir.display()
            ));
        }
        let direct = match cfg.direct {
            DirectIo::Off => DIRECT_NO,
            DirectIo::Auto | DirectIo::On => {
                match probe_direct(&dir, !cfg.read_only, cfg.file_mode)? {
                    Some(true) => DIRECT_YES,
                    Some(false) if cfg.direct == DirectIo::On => {
                        return Err(DiskError::Config(format!(
                            "direct_io=on: the filesystem of path={} does not take O_DIRECT; use \
                         \"auto\" or \"off\"",
                            cfg.path.display()
                        )))
                    }
                    Some(false) => DIRECT_NO,
                    // Nothing to read and nothing may be written: "on" is taken at its word.
                    None if cfg.direct == DirectIo::On => DIRECT_YES,
                    None => {
                        notes.push(
                            "whether the filesystem takes O_DIRECT is not known yet (no chunk to \
                         read, and no room or permission to write one): buffered I/O until a \
                         chunk's file is read or written"
                                .into(),
                        );
                        DIRECT_UNKNOWN
                    }
                }
            }
        };
        Ok(ChunkFiles {
            dir,
            ns,
            layout: Layout::whole(cfg.chunk_bytes),
            direct: AtomicU8::new(direct),
            read_only: cfg.read_only,
            file_mode: cfg.file_mode,
            notes,
            nonce: random_u64(),
            tmp_seq: AtomicU64::new(0),
            stats: Counters::default(),
        })
    }

    /// Whether reads and writes bypass the page cache (not yet known: buffered).
    pub fn direct(&self) -> bool {
        self.direct.load(Ordering::Relaxed) == DIRECT_YES
    }

    /// What open found worth saying (a directory it could not create, `O_DIRECT` not known).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Settles whether the filesystem takes `O_DIRECT` on a chunk's file just written or read,
    /// where open could not find out.
    fn settle_direct(&self, path: &Path) {
        if self.direct.load(Ordering::Relaxed) != DIRECT_UNKNOWN {
            return;
        }
        if let Ok(yes) = read_probe(path) {
            let v = if yes { DIRECT_YES } else { DIRECT_NO };
            let _ = self.direct.compare_exchange(
                DIRECT_UNKNOWN,
                v,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// The namespace's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn chunk_bytes(&self) -> usize {
        self.layout.chunk_bytes
    }

    pub fn stats(&self) -> Stats {
        self.stats.snapshot()
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.stats
    }

    fn path_of(&self, key: &[u8]) -> Result<PathBuf> {
        if key.is_empty() || key.len() > MAX_KEY_BYTES {
            return Err(DiskError::Config(format!(
                "a key of {} bytes; allowed: 1 to {MAX_KEY_BYTES}",
                key.len()
            )));
        }
        Ok(files::chunk_path(&self.dir, key))
    }

    /// Whether chunk `key` has a file of its own (not a symlink; not checked: a load checks).
    pub fn exists(&self, key: &[u8]) -> bool {
        self.path_of(key)
            .is_ok_and(|p| self.fan_ok(&p) && is_file(&p))
    }

    /// Whether the subdirectory of the chunk's file at `path` is one (or not there yet): not a
    /// symlink planted in its place (counted), nor one other users may write.
    fn fan_ok(&self, path: &Path) -> bool {
        use std::os::unix::fs::PermissionsExt;
        let parent = path.parent().expect("a chunk's file has a directory");
        match fs::symlink_metadata(parent) {
            Ok(m) if m.file_type().is_symlink() => {
                Counters::add(&self.stats.symlinks, 1);
                false
            }
            Ok(m) => m.is_dir() && m.permissions().mode() & self.others_write() == 0,
            Err(_) => true,
        }
    }

    /// The mode bits by which users other than the engines' could write a directory.
    fn others_write(&self) -> u32 {
        0o002
            | if self.file_mode & 0o020 != 0 {
                0
            } else {
                0o020
            }
    }

    /// Writes chunk `key` (`payload`, exactly `chunk_bytes`) unless its file is there. The file
    /// is written under a temporary name and renamed, so it appears whole or not at all.
    pub fn store(&self, key: &[u8], payload: &[u8]) -> Stored {
        let out = self.try_store(key, payload);
        let c = &self.stats;
        match &out {
            Stored::Written => {
                Counters::add(&c.stored_chunks, 1);
                Counters::add(&c.bytes_written, payload.len() as u64);
            }
            Stored::Exists => Counters::add(&c.store_exists, 1),
            Stored::Failed(e) => {
                Counters::add(&c.store_failures, 1);
                if e.is_full() {
                    Counters::add(&c.stores_full, 1);
                } else if e.is_read_only() {
                    Counters::add(&c.stores_read_only, 1);
                }
            }
        }
        out
    }

    fn try_store(&self, key: &[u8], payload: &[u8]) -> Stored {
        if payload.len() != self.layout.chunk_bytes {
            return Stored::Failed(DiskError::Config(format!(
                "a payload of {} bytes; this tier's chunks are {}",
                payload.len(),
                self.layout.chunk_bytes
            )));
        }
        let path = match self.path_of(key) {
            Ok(p) => p,
            Err(e) => return Stored::Failed(e),
        };
        if !self.fan_ok(&path) {
            let e = io::Error::from_raw_os_error(libc::ELOOP);
            let what = format!("{} is a symlink: never written through", path.display());
            return Stored::Failed(DiskError::io(what, e));
        }
        if is_file(&path) {
            return Stored::Exists;
        }
        // Read once: a first file may settle it meanwhile, and one write uses one way.
        let direct = self.direct();
        let parent = path.parent().expect("a chunk's file has a directory");
        let tmp = parent.join(format!(
            "{TMP_PREFIX}{:016x}-{}",
            self.nonce,
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let file = match files::create(&tmp, direct, self.file_mode) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                // First file of its subdirectory, or the directory was removed under us.
                if let Err(e) = files::make_dirs(parent, files::dir_mode(self.file_mode)) {
                    let what = format!("creating {}", parent.display());
                    return Stored::Failed(DiskError::io(what, e));
                }
                files::create(&tmp, direct, self.file_mode)
            }
            other => other,
        };
        // Only a file this call created is removed on failure (never another writer's).
        let file = match file {
            Ok(f) => f,
            Err(e) => {
                return Stored::Failed(DiskError::io(format!("creating {}", tmp.display()), e))
            }
        };
        if let Err(e) = self.write_chunk(&file, key, payload, direct) {
            let _ = fs::remove_file(&tmp);
            return Stored::Failed(DiskError::io(format!("writing {}", tmp.display()), e));
        }
        // rename replaces a file another writer renamed meanwhile: both are whole and hold the
        // same chunk, and a reader sees one or the other.
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            let what = format!("renaming a chunk to {}", path.display());
            return Stored::Failed(DiskError::io(what, e));
        }
        self.settle_direct(&path);
        Stored::Written
    }

    fn write_chunk(&self, f: &File, key: &[u8], payload: &[u8], direct: bool) -> io::Result<()> {
        let header = Header::for_chunk(&self.layout, &self.ns, key, payload).encode();
        let mut block = AlignedBuf::new(HEADER_BLOCK);
        block.as_mut_slice()[..HEADER_LEN].copy_from_slice(&header);
        let padded = round_up(payload.len());
        if !direct || (is_aligned(payload) && padded == payload.len()) {
            files::write_all_at(f, &[block.as_slice(), payload], 0)?;
        } else {
            // O_DIRECT needs aligned memory and whole blocks: through a bounce buffer.
            let mut bounce = AlignedBuf::new(padded);
            bounce.as_mut_slice()[..payload.len()].copy_from_slice(payload);
            files::write_all_at(f, &[block.as_slice(), bounce.as_slice()], 0)?;
        }
        if !direct {
            // The padding; with O_DIRECT the bounce buffer wrote it.
            f.set_len(files::file_len(payload.len()))?;
            files::drop_cache(f);
        }
        Ok(())
    }

    /// Reads chunk `key` into `dest` (exactly `chunk_bytes`), checking its length, header and
    /// CRC32C; a file that fails a check is removed.
    pub fn load(&self, key: &[u8], dest: &mut [u8]) -> Loaded {
        let out = self.try_load(key, dest);
        let c = &self.stats;
        match &out {
            Loaded::Ok => {
                Counters::add(&c.loaded_chunks, 1);
                Counters::add(&c.bytes_read, dest.len() as u64);
            }
            Loaded::Missing => Counters::add(&c.load_missing, 1),
            Loaded::Corrupt(_) => Counters::add(&c.corrupt, 1),
            Loaded::Failed(_) => Counters::add(&c.load_failures, 1),
        }
        out
    }

    fn try_load(&self, key: &[u8], dest: &mut [u8]) -> Loaded {
        if dest.len() != self.layout.chunk_bytes {
            return Loaded::Failed(DiskError::Config(format!(
                "a destination of {} bytes; this tier's chunks are {}",
                dest.len(),
                self.layout.chunk_bytes
            )));
        }
        let path = match self.path_of(key) {
            Ok(p) => p,
            Err(e) => return Loaded::Failed(e),
        };
        let direct = self.direct();
        if !self.fan_ok(&path) {
            return Loaded::Missing;
        }
        let f = match files::open(&path, direct) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Loaded::Missing,
            Err(e) if files::is_symlink_error(&e) => {
                Counters::add(&self.stats.symlinks, 1);
                return Loaded::Missing;
            }
            Err(e) => {
                return Loaded::Failed(DiskError::io(format!("opening {}", path.display()), e))
            }
        };
        let meta = match f.metadata() {
            Ok(m) => m,
            Err(e) => {
                return Loaded::Failed(DiskError::io(format!("reading {}", path.display()), e))
            }
        };
        if meta.len() != files::file_len(dest.len()) {
            self.remove_damaged(&f, &path);
            return Loaded::Corrupt("file has the wrong length");
        }
        let got = match self.read_chunk(&f, key, dest, direct) {
            Ok(got) => got,
            // A file shorter than its header says: cut short (a crash, a full disk elsewhere).
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => Loaded::Corrupt("file is truncated"),
            Err(e) => Loaded::Failed(DiskError::io(format!("reading {}", path.display()), e)),
        };
        match got {
            Loaded::Ok if !self.read_only => {
                // The file's time is the recency every engine sharing the directory (and the
                // next one to open it) orders eviction by: a hit here keeps it for them too.
                let _ = f.set_modified(std::time::SystemTime::now());
                self.settle_direct(&path);
            }
            Loaded::Ok => self.settle_direct(&path),
            Loaded::Corrupt(_) => self.remove_damaged(&f, &path),
            _ => {}
        }
        got
    }

    fn read_chunk(
        &self,
        f: &File,
        key: &[u8],
        dest: &mut [u8],
        direct: bool,
    ) -> io::Result<Loaded> {
        // The header block and the payload in one read: the header is checked after it.
        let mut block = AlignedBuf::new(HEADER_BLOCK);
        let padded = round_up(dest.len());
        let bounce = if !direct || (is_aligned(dest) && padded == dest.len()) {
            files::read_all_at(f, &mut [block.as_mut_slice(), dest], 0)?;
            None
        } else {
            let mut bounce = AlignedBuf::new(padded);
            files::read_all_at(f, &mut [block.as_mut_slice(), bounce.as_mut_slice()], 0)?;
            Some(bounce)
        };
        if !direct {
            files::drop_cache(f);
        }
        let raw: &[u8; HEADER_LEN] = block.as_slice()[..HEADER_LEN]
            .try_into()
            .expect("a header block holds a header");
        let header = match Header::decode_checked(raw, &self.layout, &self.ns, key) {
            Ok(h) => h,
            Err(why) => return Ok(Loaded::Corrupt(why)),
        };
        if let Some(bounce) = bounce {
            dest.copy_from_slice(&bounce.as_slice()[..dest.len()]);
        }
        if crc(dest) != header.payload_crc {
            return Ok(Loaded::Corrupt("payload checksum mismatch"));
        }
        Ok(Loaded::Ok)
    }

    /// A file that failed a check goes (it would fail every load), unless nothing may be removed.
    fn remove_damaged(&self, f: &File, path: &Path) {
        if !self.read_only {
            remove_if_same(f, path);
        }
    }

    /// Whether a subdirectory's chunks may be served: one left more open than `file_mode` (a
    /// cache of an older version, or written under another umask) is given this tier's mode; one
    /// that stays writable by other users is left out (they could have planted its files).
    fn private_fan(&self, fan: &Path) -> bool {
        use std::os::unix::fs::PermissionsExt;
        let want = files::dir_mode(self.file_mode);
        let Ok(mode) = fs::symlink_metadata(fan).map(|m| m.permissions().mode() & 0o777) else {
            return false;
        };
        if mode & !want == 0 {
            return true;
        }
        if !self.read_only && files::set_mode(fan, want).is_ok() {
            return true;
        }
        mode & self.others_write() == 0
    }

    /// Gives a chunk's file this tier's mode, if it is more open (best effort, never when
    /// `read_only`).
    fn own_mode(&self, file: &Path, meta: &fs::Metadata) {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if !self.read_only && mode & !self.file_mode != 0 {
            let _ = files::set_mode(file, self.file_mode);
        }
    }

    /// Whether chunk `key` has a whole file (its length; a load checks the rest): what a probe
    /// looks for.
    pub fn has_file(&self, key: &[u8]) -> bool {
        self.path_of(key).is_ok_and(|p| {
            self.fan_ok(&p)
                && fs::symlink_metadata(p).is_ok_and(|m| {
                    m.is_file() && m.len() == files::file_len(self.layout.chunk_bytes)
                })
        })
    }

    /// Removes chunk `key`'s file, if any (eviction); never through a symlinked subdirectory.
    pub fn remove(&self, key: &[u8]) -> Result<bool> {
        let path = self.path_of(key)?;
        if !self.fan_ok(&path) {
            return Ok(false);
        }
        match fs::remove_file(path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(DiskError::io("removing a chunk", e)),
        }
    }

    /// Every chunk with a file in this namespace's directory (key, last modified), for the
    /// index an engine rebuilds at start-up, and whether the listing is complete (false: some
    /// subdirectory or file could not be read, so an absent chunk may still have its file).
    /// Names that are not a chunk's are left alone, and temporary files an hour old (writes a
    /// crash cut short) are removed.
    pub fn scan(&self) -> Result<Listing> {
        let mut out = Vec::new();
        let mut complete = true;
        // Gone meanwhile (another engine's eviction) is not a gap in the listing.
        let mut seen = |e: &io::Error| complete &= e.kind() == ErrorKind::NotFound;
        let subdirs = fs::read_dir(&self.dir).map_err(|e| DiskError::io("listing the tier", e))?;
        for sub in subdirs {
            let sub = match sub {
                Ok(sub) => sub,
                Err(e) => {
                    seen(&e);
                    continue;
                }
            };
            // Only `<2 hex digits>` subdirectories hold chunks, each the keys of its fan.
            let fan = match sub.file_name().to_str().and_then(files::unhex).as_deref() {
                Some(&[fan]) => fan,
                _ => continue,
            };
            if sub.file_type().is_ok_and(|t| t.is_symlink()) {
                Counters::add(&self.stats.symlinks, 1);
                continue;
            }
            if !self.private_fan(&sub.path()) {
                continue;
            }
            let entries = match fs::read_dir(sub.path()) {
                Ok(entries) => entries,
                Err(e) => {
                    seen(&e);
                    continue;
                }
            };
            for entry in entries {
                let entry = match entry {
                    Ok(entry) => entry,
                    Err(e) => {
                        seen(&e);
                        continue;
                    }
                };
                let name = entry.file_name();
                if entry.file_type().is_ok_and(|t| t.is_symlink()) {
                    Counters::add(&self.stats.symlinks, 1);
                    continue;
                }
                if name.to_string_lossy().starts_with(TMP_PREFIX) {
                    if !self.read_only {
                        remove_if_stale(&entry.path());
                    }
                    continue;
                }
                let Some(key) = name.to_str().and_then(files::unhex) else {
                    continue;
                };
                if key.is_empty() || key.len() > MAX_KEY_BYTES || files::fan_of(&key) != fan {
                    continue;
                }
                match entry.metadata() {
                    Ok(meta) => {
                        self.own_mode(&entry.path(), &meta);
                        match meta.modified() {
                            Ok(modified) => out.push((key, modified)),
                            Err(e) => seen(&e),
                        }
                    }
                    Err(e) => seen(&e),
                }
            }
        }
        Ok((out, complete))
    }
}

/// Whether `dir`'s filesystem takes `O_DIRECT`: a block of a chunk's file read through it, or
/// where there is none and `may_write`, a block written and read back. Only `EINVAL` (the
/// filesystem refuses the flag or the alignment) means no; None: not known (nothing to read, and
/// no room or permission to write); another error is the directory's, and stops open.
fn probe_direct(dir: &Path, may_write: bool, mode: u32) -> Result<Option<bool>> {
    if let Some(yes) = any_chunk_file(dir).and_then(|p| read_probe(&p).ok()) {
        return Ok(Some(yes));
    }
    if !may_write {
        return Ok(None);
    }
    let path = dir.join(format!("{TMP_PREFIX}probe-{:016x}", random_u64()));
    let created = match files::create(&path, true, mode) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(Some(false)),
        Err(e) if is_read_only(&e) || is_full(&e) || e.kind() == ErrorKind::NotFound => {
            return Ok(None)
        }
        Err(e) => return Err(DiskError::io(format!("creating {}", path.display()), e)),
    };
    let tried = (|| -> io::Result<()> {
        let block = AlignedBuf::new(ALIGN);
        created.write_all_at(block.as_slice(), 0)?;
        let r = files::open(&path, true)?;
        let mut back = AlignedBuf::new(ALIGN);
        r.read_exact_at(back.as_mut_slice(), 0)
    })();
    let _ = fs::remove_file(&path);
    match tried {
        Ok(()) => Ok(Some(true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(Some(false)),
        Err(e) if is_full(&e) => Ok(None),
        Err(e) => Err(DiskError::io(
            format!("probing O_DIRECT in {}", dir.display()),
            e,
        )),
    }
}

/// Some chunk's file under `dir`, if there is one (the first found).
fn any_chunk_file(dir: &Path) -> Option<PathBuf> {
    for sub in fs::read_dir(dir).ok()?.flatten() {
        let is_fan = sub
            .file_name()
            .to_str()
            .and_then(files::unhex)
            .is_some_and(|b| b.len() == 1)
            && sub.file_type().is_ok_and(|t| t.is_dir());
        if !is_fan {
            continue;
        }
        let Ok(entries) = fs::read_dir(sub.path()) else {
            continue;
        };
        for entry in entries.flatten() {
            let chunk = entry.file_name().to_str().and_then(files::unhex).is_some();
            if chunk && entry.file_type().is_ok_and(|t| t.is_file()) {
                return Some(entry.path());
            }
        }
    }
    None
}

/// Whether the first block of the file at `path` reads through `O_DIRECT` (false: `EINVAL`).
fn read_probe(path: &Path) -> io::Result<bool> {
    let f = match files::open(path, true) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(false),
        Err(e) => return Err(e),
    };
    let mut block = AlignedBuf::new(ALIGN);
    match f.read_exact_at(block.as_mut_slice(), 0) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// A temporary file an hour old is a write that never ended (a crash): removed. Younger ones
/// may be another engine's write in progress.
fn remove_if_stale(path: &Path) {
    let old = fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age > std::time::Duration::from_secs(3600));
    if old {
        let _ = fs::remove_file(path);
    }
}

/// Removes the file at `path` only if it is still the one `f` read: another writer may have
/// renamed a good file into place since.
fn remove_if_same(f: &File, path: &Path) {
    use std::os::unix::fs::MetadataExt;
    let (Ok(open), Ok(now)) = (f.metadata(), fs::symlink_metadata(path)) else {
        return;
    };
    if (open.dev(), open.ino()) == (now.dev(), now.ino()) {
        let _ = fs::remove_file(path);
    }
}

/// A random 64-bit number (the standard library's per-process hash keys).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    h.finish()
}

/// Whether `path` is a regular file itself (not a symlink to one).
fn is_file(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file())
}

/// Refuses a tier directory that users other than its owner may write (they could plant a
/// chunk file with a good header and checksum, which would be served), one another user owns
/// (root aside), or whose namespace directory is a symlink. Group write, and a group member's
/// ownership, are allowed where `file_mode` shares with the group; on a filesystem mounted
/// read-only nobody can plant anything.
fn check_private(path: &Path, dir: &Path, file_mode: u32) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if files::real_dir(dir).is_ok_and(|d| d == Some(false)) {
        return Err(DiskError::Config(format!(
            "path={}: {} is not a directory of its own (a symlink, or a file): remove it",
            path.display(),
            dir.display()
        )));
    }
    if mounted_read_only(path) {
        return Ok(());
    }
    let group_shared = file_mode & 0o020 != 0;
    // SAFETY: geteuid has no failure mode and touches no memory.
    let me = unsafe { libc::geteuid() };
    for p in [path, dir] {
        let Ok(meta) = fs::metadata(p) else { continue };
        let mode = meta.permissions().mode() & 0o7777;
        if meta.uid() != me && meta.uid() != 0 && !group_shared {
            return Err(DiskError::Config(format!(
                "path={}: {} is owned by uid {}, not by this engine's user (uid {me}) nor root: \
                 its owner could put chunk files there that would be served; give the tier a \
                 directory of its own (or file_mode 0660, for engines of one group)",
                path.display(),
                p.display(),
                meta.uid()
            )));
        }
        let open_to = if mode & 0o002 != 0 {
            "every user"
        } else if mode & 0o020 != 0 && !group_shared {
            "its group"
        } else {
            continue;
        };
        return Err(DiskError::Config(format!(
            "path={}: {} is writable by {open_to} (mode {mode:04o}): another user could put a \
             chunk file there that would be served; give the tier a directory only its engines' \
             user can write (chmod go-w, or a subdirectory of mode 0700), or file_mode 0660 to \
             share it with the group",
            path.display(),
            p.display(),
        )));
    }
    Ok(())
}

/// Whether `path`'s filesystem is mounted read-only (nobody can write it).
fn mounted_read_only(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Some(existing) = path.ancestors().find(|p| p.exists()) else {
        return false;
    };
    let Ok(c) = std::ffi::CString::new(existing.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: a zeroed statvfs is a valid out-parameter; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statvfs(c.as_ptr(), &mut st) == 0 && st.f_flag & libc::ST_RDONLY != 0 }
}
