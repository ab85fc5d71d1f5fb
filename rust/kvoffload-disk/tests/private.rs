//! Cached KV at rest is its owner's: a symlink planted in the directory is never followed (no
//! read, no write, no removal through it), a directory other users may write or own is refused,
//! and a cache left more open (an older version's) is given the tier's modes. The modes of what
//! the tier creates under a permissive umask: `umask.rs` (a binary of its own: the umask is the
//! process's).

mod common;

use common::files::{config, mode, tree};
use common::jobs::{data, key, load, open_cfg, store, FILE, NS};
use common::TempDir;
use kvoffload_disk::{DiskError, Tier};
use kvoffload_tier::status::{MISSING, OK};
use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};

/// Copies chunk `i`'s file (a whole, valid one) out of `jobs`'s directory to `to`.
fn copy_of(jobs: &Tier, i: u32, to: &Path) -> PathBuf {
    let (keys, _) = jobs.files().scan().unwrap();
    assert!(keys.iter().any(|(k, _)| *k == key(i)));
    let name = kvoffload_hex(&key(i));
    let src = tree(jobs.files().dir())
        .into_iter()
        .find(|p| p.file_name().is_some_and(|n| n == name.as_str()))
        .unwrap();
    fs::copy(&src, to).unwrap();
    to.to_path_buf()
}

fn kvoffload_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_symlink_planted_in_the_directory_is_never_followed() {
    let d = TempDir::new("symlinks");
    let elsewhere = d.0.join("elsewhere");
    fs::create_dir_all(&elsewhere).unwrap();
    // A valid chunk file made by another tier of the same namespace, outside this one.
    let other = open_cfg(config(&d.0.join("other"), 0o600), 100, 1);
    assert_eq!(store(&other, &[1, 2]), vec![OK; 2]);
    let target = copy_of(&other, 1, &elsewhere.join("target"));
    let before = fs::read(&target).unwrap();
    let jobs = open_cfg(config(&d.0.join("tier"), 0o600), 100, 1);
    assert_eq!(store(&jobs, &[2]), vec![OK]);
    // Chunk 1's name in its subdirectory, as a symlink to the valid file elsewhere.
    let (keys, _) = other.files().scan().unwrap();
    assert_eq!(keys.len(), 2);
    let ours = jobs.files().dir().to_path_buf();
    let planted = tree(other.files().dir())
        .into_iter()
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n == kvoffload_hex(&key(1)).as_str())
        })
        .unwrap();
    let fan = ours.join(planted.parent().unwrap().file_name().unwrap());
    fs::create_dir_all(&fan).unwrap();
    fs::set_permissions(&fan, fs::Permissions::from_mode(0o700)).unwrap();
    let link = fan.join(planted.file_name().unwrap());
    symlink(&target, &link).unwrap();
    // Not read: a miss, and the file behind it is unchanged and still there.
    assert_eq!(load(&jobs, &[1]).0, vec![MISSING]);
    assert_eq!(jobs.lookup(&[&key(1)[..]], "r"), (0, true));
    jobs.flush();
    while jobs.probes_in_flight() > 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(jobs.lookup(&[&key(1)[..]], "r"), (0, false));
    assert!(jobs
        .files()
        .scan()
        .unwrap()
        .0
        .iter()
        .all(|(k, _)| *k != key(1)));
    assert_eq!(fs::read(&target).unwrap(), before);
    assert!(jobs.files().stats().symlinks >= 2);
    // A subdirectory that is a symlink: nothing is written into it, nor read from it.
    let fan2 = ours.join(
        tree(&ours)
            .into_iter()
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n == kvoffload_hex(&key(2)).as_str())
            })
            .unwrap()
            .parent()
            .unwrap()
            .file_name()
            .unwrap(),
    );
    fs::remove_dir_all(&fan2).unwrap();
    symlink(other.files().dir().join(fan2.file_name().unwrap()), &fan2).unwrap();
    assert_eq!(load(&jobs, &[2]).0, vec![MISSING]);
    let other_files = tree(other.files().dir()).len();
    assert_ne!(store(&jobs, &[2]), vec![OK]);
    assert_eq!(jobs.state(), kvoffload_disk::BreakerState::Up); // a miss, not a failing disk
                                                                // Nor removed through it (an eviction).
    assert!(!jobs.files().remove(&key(2)).unwrap());
    assert_eq!(tree(other.files().dir()).len(), other_files);
    assert_eq!(load(&other, &[2]).1[0], data(2)); // the other tier's file is untouched
}

#[test]
fn a_cache_left_more_open_is_given_the_tiers_modes_and_a_shared_groups_setgid_is_kept() {
    let d = TempDir::new("reclaim");
    let path = d.0.join("cache");
    let jobs = open_cfg(config(&path, 0o600), 100, 1);
    assert_eq!(store(&jobs, &[0]), vec![OK]);
    let dir = jobs.files().dir().to_path_buf();
    jobs.close();
    // As an older version (or another umask) left it: a file 0644, its subdirectory 0777.
    let file = tree(&dir).into_iter().find(|p| p.is_file()).unwrap();
    fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
    fs::set_permissions(file.parent().unwrap(), fs::Permissions::from_mode(0o777)).unwrap();
    let jobs = open_cfg(config(&path, 0o600), 100, 1);
    assert_eq!((mode(&file), mode(file.parent().unwrap())), (0o600, 0o700));
    assert_eq!(load(&jobs, &[0]).1[0], data(0));
    // A group's directory with set-group-ID: what the tier creates in it stays the group's.
    let shared = d.0.join("shared");
    fs::create_dir_all(&shared).unwrap();
    std::os::unix::fs::chown(&shared, None, Some(4321)).unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o2770)).unwrap();
    let jobs = open_cfg(config(&shared, 0o660), 100, 1);
    assert_eq!(store(&jobs, &[1]), vec![OK]);
    use std::os::unix::fs::MetadataExt;
    for p in tree(jobs.files().dir()) {
        let want = if p.is_dir() { 0o2770 } else { 0o660 };
        assert_eq!(
            (mode(&p), fs::metadata(&p).unwrap().gid()),
            (want, 4321),
            "{p:?}"
        );
    }
}

#[test]
fn a_directory_other_users_may_write_is_refused_with_one_clear_line() {
    let d = TempDir::new("open-to");
    let refused = |path: &Path, file_mode: u32| match Tier::open(
        config(path, file_mode),
        NS,
        100 * FILE,
        1,
    ) {
        Err(DiskError::Config(m)) => m,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("{} was taken", path.display()),
    };
    let world = d.0.join("world");
    fs::create_dir_all(&world).unwrap();
    fs::set_permissions(&world, fs::Permissions::from_mode(0o1777)).unwrap();
    let m = refused(&world, 0o600);
    assert!(m.contains("writable by every user (mode 1777)"), "{m}");
    let group = d.0.join("group");
    fs::create_dir_all(&group).unwrap();
    fs::set_permissions(&group, fs::Permissions::from_mode(0o770)).unwrap();
    let m = refused(&group, 0o600);
    assert!(m.contains("writable by its group (mode 0770)") && m.contains("file_mode 0660"));
    // Shared with the group on purpose: taken.
    assert!(Tier::open(config(&group, 0o660), NS, 100 * FILE, 1).is_ok());
    // The namespace's directory replaced by a symlink: refused.
    let linked = d.0.join("linked");
    let jobs = open_cfg(config(&linked, 0o600), 100, 1);
    let ns_dir = jobs.files().dir().to_path_buf();
    jobs.close();
    drop(jobs);
    fs::remove_dir_all(&ns_dir).unwrap();
    symlink(&world, &ns_dir).unwrap();
    assert!(refused(&linked, 0o600).contains("not a directory of its own"));
    // Owned by another user (not root): refused, unless the engines share a group.
    let theirs = d.0.join("theirs");
    fs::create_dir_all(&theirs).unwrap();
    fs::set_permissions(&theirs, fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
    assert!(refused(&theirs, 0o600).contains("is owned by uid 65534"));
    // A read-only mount nobody can write: taken, whatever its modes.
    let ro = d.0.join("ro");
    fs::create_dir_all(&ro).unwrap();
    if let Some(_mount) = common::mount::Mount::read_only(&world, &ro) {
        let mut cfg = config(&ro, 0o600);
        cfg.read_only = true;
        assert!(Tier::open(cfg, NS, 100 * FILE, 1).is_ok());
    }
    // A mode that would give other users the files: refused before anything is made.
    let m = refused(&d.0.join("bad-mode"), 0o644);
    assert!(m.contains("file_mode=0644 is not allowed"), "{m}");
    assert!(!d.0.join("bad-mode").exists());
}
