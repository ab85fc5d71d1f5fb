//! The disk tier on this machine's real filesystems: a directory under the system's temporary
//! directory, and a small tmpfs mounted by the test for a full filesystem.

mod common;

use common::mount::Mount;
use common::TempDir;
use kvoffload_disk::{ChunkFiles, DirectIo, DiskConfig, Loaded, Stored};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const NS: [u8; 16] = *b"disk-tier-tests!";

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn tier(dir: &Path, chunk: usize, direct: DirectIo) -> ChunkFiles {
    let mut cfg = DiskConfig::new(dir, chunk);
    cfg.direct = direct;
    ChunkFiles::open(cfg, NS).unwrap()
}

fn load(t: &ChunkFiles, key: &[u8], chunk: usize) -> (Loaded, Vec<u8>) {
    let mut buf = vec![0u8; chunk];
    let got = t.load(key, &mut buf);
    (got, buf)
}

fn file_of(t: &ChunkFiles, key: &[u8]) -> PathBuf {
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut found = None;
    for sub in fs::read_dir(t.dir()).unwrap().flatten() {
        let p = sub.path().join(&hex);
        if p.exists() {
            found = Some(p);
        }
    }
    found.expect("the chunk has a file")
}

#[test]
fn chunks_come_back_byte_for_byte_direct_or_buffered_aligned_or_not() {
    let d = TempDir::new("round-trip");
    // 64 KiB (whole blocks), 12 KiB + 1 (not a whole block), 100 bytes (smaller than a block).
    for (i, chunk) in [64 * 1024, 12 * 1024 + 1, 100].into_iter().enumerate() {
        for direct in [DirectIo::Auto, DirectIo::Off] {
            let t = tier(&d.0.join(format!("{i}-{direct:?}")), chunk, direct);
            let keys: Vec<Vec<u8>> = (0..8u8).map(|k| vec![k; 36]).collect();
            for (k, key) in keys.iter().enumerate() {
                assert!(matches!(
                    t.store(key, &pattern(k as u64, chunk)),
                    Stored::Written
                ));
            }
            for (k, key) in keys.iter().enumerate() {
                let (got, buf) = load(&t, key, chunk);
                assert!(matches!(got, Loaded::Ok), "{chunk} {direct:?}: {got:?}");
                assert!(
                    buf == pattern(k as u64, chunk),
                    "{chunk} {direct:?}: bytes differ"
                );
            }
            assert!(matches!(
                t.store(&keys[0], &pattern(0, chunk)),
                Stored::Exists
            ));
            assert!(matches!(load(&t, &[9; 36], chunk).0, Loaded::Missing));
            let s = t.stats();
            assert_eq!(
                (
                    s.stored_chunks,
                    s.store_exists,
                    s.loaded_chunks,
                    s.load_missing
                ),
                (8, 1, 8, 1)
            );
            assert_eq!(s.bytes_written, 8 * chunk as u64);
            assert_eq!(t.scan().unwrap().0.len(), 8);
        }
    }
}

#[test]
fn this_machines_temporary_directory_takes_o_direct() {
    // ext4 and xfs do; the probe must find it, or every read and write goes through the cache.
    let d = TempDir::new("probe");
    let t = tier(&d.0, 4096, DirectIo::Auto);
    let fs_type = Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(&d.0)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    if fs_type.starts_with("ext") || fs_type == "xfs" {
        assert!(t.direct(), "{fs_type}");
    }
    assert!(!tier(&d.0.join("off"), 4096, DirectIo::Off).direct());
}

#[test]
fn damage_of_every_kind_is_never_served_and_is_removed() {
    let d = TempDir::new("damage");
    let chunk = 3 * 4096;
    let t = tier(&d.0, chunk, DirectIo::Auto);
    let other_ns = {
        let mut cfg = DiskConfig::new(&d.0, chunk);
        cfg.direct = DirectIo::Auto;
        ChunkFiles::open(cfg, *b"another-namespac").unwrap()
    };
    type Damage = fn(&Path, &Path);
    let cases: [(&str, Damage); 7] = [
        ("truncated", |p, _| {
            let f = fs::OpenOptions::new().write(true).open(p).unwrap();
            f.set_len(4096 + 100).unwrap();
        }),
        ("empty", |p, _| {
            fs::write(p, b"").unwrap();
        }),
        ("header byte flipped", |p, _| flip(p, 20)),
        ("payload byte flipped", |p, _| flip(p, 4096 + 5000)),
        ("padding grown", |p, _| {
            let f = fs::OpenOptions::new().write(true).open(p).unwrap();
            f.set_len(4096 + 3 * 4096 + 1).unwrap();
        }),
        ("another key's file", |p, other| {
            fs::copy(other, p).unwrap();
        }),
        ("another namespace's file", |p, foreign| {
            fs::copy(foreign, p).unwrap();
        }),
    ];
    for (i, (what, damage)) in cases.iter().enumerate() {
        let key = vec![i as u8; 36];
        assert!(matches!(
            t.store(&key, &pattern(i as u64, chunk)),
            Stored::Written
        ));
        let path = file_of(&t, &key);
        let source = if *what == "another namespace's file" {
            assert!(matches!(
                other_ns.store(&key, &pattern(99, chunk)),
                Stored::Written
            ));
            file_of(&other_ns, &key)
        } else {
            let other = vec![200u8; 36];
            let _ = t.store(&other, &pattern(200, chunk));
            file_of(&t, &other)
        };
        damage(&path, &source);
        let (got, _) = load(&t, &key, chunk);
        assert!(matches!(got, Loaded::Corrupt(_)), "{what}: {got:?}");
        assert!(!path.exists(), "{what}: the damaged file is still there");
        assert!(matches!(load(&t, &key, chunk).0, Loaded::Missing), "{what}");
        // Stored again, it is served again.
        assert!(matches!(
            t.store(&key, &pattern(i as u64, chunk)),
            Stored::Written
        ));
        assert!(matches!(load(&t, &key, chunk).0, Loaded::Ok), "{what}");
    }
    assert_eq!(t.stats().corrupt, 7);
}

fn flip(p: &Path, at: usize) {
    let mut bytes = fs::read(p).unwrap();
    bytes[at] ^= 0x10;
    fs::write(p, bytes).unwrap();
}

#[test]
fn concurrent_writers_of_one_chunk_never_show_a_reader_half_of_it() {
    let d = TempDir::new("writers");
    let chunk = 256 * 1024;
    let t = tier(&d.0, chunk, DirectIo::Auto);
    let key = vec![7u8; 36];
    // Each writer its own bytes: a reader must see one writer's chunk whole, never a mix (nor
    // a file another writer's failure removed).
    let payloads: Vec<Vec<u8>> = (0..4).map(|w| pattern(70 + w, chunk)).collect();
    std::thread::scope(|s| {
        for want in &payloads {
            let (t, key) = (&t, &key);
            s.spawn(move || {
                for _ in 0..20 {
                    let _ = t.remove(key);
                    assert!(!matches!(t.store(key, want), Stored::Failed(_)));
                }
            });
        }
        for _ in 0..2 {
            s.spawn(|| {
                let mut buf = vec![0u8; chunk];
                for _ in 0..200 {
                    match t.load(&key, &mut buf) {
                        Loaded::Ok => assert!(payloads.contains(&buf), "a reader saw a mix"),
                        Loaded::Missing => {}
                        other => panic!("a reader saw {other:?}"),
                    }
                }
            });
        }
    });
    assert_eq!(t.stats().corrupt, 0);
    // No temporary file is left behind.
    let leftovers: Vec<_> = fs::read_dir(d.0.join(t.dir().file_name().unwrap()))
        .unwrap()
        .flatten()
        .flat_map(|sub| fs::read_dir(sub.path()).into_iter().flatten().flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_directory_removed_under_a_running_tier_is_recreated_by_the_next_store() {
    let d = TempDir::new("removed");
    let t = tier(&d.0, 8192, DirectIo::Auto);
    assert!(matches!(
        t.store(&[1; 36], &pattern(1, 8192)),
        Stored::Written
    ));
    fs::remove_dir_all(&d.0).unwrap();
    assert!(matches!(load(&t, &[1; 36], 8192).0, Loaded::Missing));
    assert!(matches!(
        t.store(&[2; 36], &pattern(2, 8192)),
        Stored::Written
    ));
    assert!(matches!(load(&t, &[2; 36], 8192).0, Loaded::Ok));
}

#[test]
fn a_full_filesystem_drops_the_store_and_keeps_serving() {
    let d = TempDir::new("full");
    let Some(_mount) = Mount::tmpfs(&d.0, "64k") else {
        return;
    };
    let chunk = 16 * 1024;
    let t = tier(&d.0, chunk, DirectIo::Auto);
    let mut written = Vec::new();
    let mut full = 0;
    for k in 0..8u8 {
        match t.store(&[k; 36], &pattern(u64::from(k), chunk)) {
            Stored::Written => written.push(k),
            Stored::Failed(e) => {
                assert!(e.is_full(), "{e}");
                full += 1;
            }
            Stored::Exists => unreachable!(),
        }
    }
    assert!(
        !written.is_empty() && full > 0,
        "written {written:?}, full {full}"
    );
    assert_eq!(t.stats().stores_full, full);
    // What fitted is served whole; a dropped store left no file, not even a partial one.
    for k in 0..8u8 {
        let (got, buf) = load(&t, &[k; 36], chunk);
        if written.contains(&k) {
            assert!(matches!(got, Loaded::Ok) && buf == pattern(u64::from(k), chunk));
        } else {
            assert!(matches!(got, Loaded::Missing), "{k}: {got:?}");
        }
    }
    // Room made (an eviction), the next store fits.
    t.remove(&[written[0]; 36]).unwrap();
    assert!(matches!(
        t.store(&[100; 36], &pattern(100, chunk)),
        Stored::Written
    ));
}

#[test]
fn scan_finds_every_chunk_and_leaves_other_files_alone() {
    let d = TempDir::new("scan");
    let t = tier(&d.0, 4096, DirectIo::Auto);
    for k in 0..20u8 {
        let _ = t.store(&[k; 36], &pattern(u64::from(k), 4096));
    }
    let sub = file_of(&t, &[0; 36]).parent().unwrap().to_path_buf();
    fs::write(sub.join(".tmp-1-1"), b"half").unwrap();
    fs::write(sub.join("not-hex"), b"x").unwrap();
    fs::write(t.dir().join("stray"), b"x").unwrap();
    // A chunk's file under another spelling of its name, or in another key's subdirectory: a
    // copy, not a chunk this tier wrote (it would never be found there by a load).
    let chunk = file_of(&t, &[0; 36]);
    let name = chunk.file_name().unwrap().to_str().unwrap().to_uppercase();
    fs::copy(&chunk, sub.join(format!("{name}A0"))).unwrap();
    let other_fan = file_of(&t, &[1; 36]).parent().unwrap().to_path_buf();
    assert_ne!(other_fan, sub);
    fs::copy(&chunk, other_fan.join(chunk.file_name().unwrap())).unwrap();
    fs::create_dir_all(t.dir().join("xyz")).unwrap();
    fs::copy(&chunk, t.dir().join("xyz").join(chunk.file_name().unwrap())).unwrap();
    let mut keys: Vec<Vec<u8>> = t.scan().unwrap().0.into_iter().map(|(k, _)| k).collect();
    keys.sort();
    assert_eq!(keys, (0..20u8).map(|k| vec![k; 36]).collect::<Vec<_>>());
    // Another namespace's directory beside it is not this tier's.
    let mut cfg = DiskConfig::new(&d.0, 4096);
    cfg.direct = DirectIo::Off;
    let other = ChunkFiles::open(cfg, *b"another-namespac").unwrap();
    assert!(other.scan().unwrap().0.is_empty());
}

#[test]
fn bad_settings_and_inputs_are_refused_naming_them() {
    let d = TempDir::new("bad");
    let err = ChunkFiles::open(DiskConfig::new(&d.0, 0), NS)
        .err()
        .unwrap();
    assert!(err.to_string().contains("chunk_bytes=0"), "{err}");
    let t = tier(&d.0, 4096, DirectIo::Auto);
    let Stored::Failed(e) = t.store(&[1; 200], &[0; 4096]) else {
        panic!("a 200-byte key was taken")
    };
    assert!(e.to_string().contains("a key of 200 bytes"), "{e}");
    let Stored::Failed(e) = t.store(&[1; 36], &[0; 100]) else {
        panic!("a short payload was taken")
    };
    assert!(e.to_string().contains("a payload of 100 bytes"), "{e}");
    assert!(!t.exists(&[1; 36]));
    // A path that cannot be a directory (a file is there).
    let file = d.0.join("a-file");
    fs::write(&file, b"x").unwrap();
    let err = ChunkFiles::open(DiskConfig::new(&file, 4096), NS)
        .err()
        .unwrap();
    assert!(err.to_string().contains("path="), "{err}");
}
