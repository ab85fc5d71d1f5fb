//! Filesystems mounted by a test (root only: a test without them says so and passes).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A mount, unmounted when dropped.
pub struct Mount(PathBuf);

fn run(args: &[&str], at: &Path) -> bool {
    Command::new("mount")
        .args(args)
        .arg(at)
        .status()
        .is_ok_and(|s| s.success())
}

impl Mount {
    /// A tmpfs of `size` (as mount takes it: "64k") at `at`.
    pub fn tmpfs(at: &Path, size: &str) -> Option<Mount> {
        let opts = format!("size={size},mode=0700");
        if !run(&["-t", "tmpfs", "-o", &opts, "tmpfs"], at) {
            eprintln!("skipped: this test mounts a tmpfs, which needs root (CAP_SYS_ADMIN)");
            return None;
        }
        Some(Mount(at.to_path_buf()))
    }

    /// `src` again at `at`, read-only (a bind mount, then remounted read-only).
    pub fn read_only(src: &Path, at: &Path) -> Option<Mount> {
        if !run(&["--bind", &src.to_string_lossy()], at) {
            eprintln!("skipped: this test bind-mounts a directory, which needs root");
            return None;
        }
        let mount = Mount(at.to_path_buf());
        if !run(&["-o", "remount,bind,ro"], at) {
            eprintln!("skipped: this machine cannot remount a bind mount read-only");
            return None;
        }
        Some(mount)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}
