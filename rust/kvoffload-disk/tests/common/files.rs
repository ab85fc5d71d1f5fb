//! Looking at what the tier left on disk: modes and the whole tree.

use super::jobs::CHUNK;
use kvoffload_disk::DiskConfig;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The permission bits of `p` itself (not a symlink's target), set-ID bits included.
pub fn mode(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

/// Every file and directory under `root`, itself included.
pub fn tree(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.to_path_buf()];
    for entry in fs::read_dir(root).unwrap().flatten() {
        let p = entry.path();
        if entry.file_type().unwrap().is_dir() {
            out.extend(tree(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The shipped defaults, with files of `file_mode`.
pub fn config(path: &Path, file_mode: u32) -> DiskConfig {
    let mut cfg = DiskConfig::new(path, CHUNK);
    cfg.file_mode = file_mode;
    cfg
}
