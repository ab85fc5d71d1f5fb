//! Credentials outside the configuration vLLM logs: the password read from a file or an
//! environment variable, read again when the server refuses it (a rotated secret, taken without a
//! restart), and never in a message.

mod common;

use common::tier::{config, keys, load, lookup, store};
use common::Reply;
use kvoffload_redis::status::OK;
use kvoffload_redis::{CanaryOutcome, RemoteError, Tier};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const NS: [u8; 16] = *b"secrets-tests-ns";
const KB: usize = 1024;

fn secret_file(s: &common::Server, name: &str, password: &str) -> PathBuf {
    let p = s.dir.join(name);
    std::fs::write(&p, format!("{password}\n")).unwrap();
    p
}

fn chunk(seed: u64) -> Vec<u8> {
    common::pattern(seed, 16 * KB)
}

#[test]
fn the_password_comes_from_a_file_or_a_variable_never_from_the_url() {
    let Some(s) = server!("--requirepass", "from-a-file") else {
        return;
    };
    let url = format!("redis://127.0.0.1:{}", s.port);
    let mut c = config(&url, 16 * KB);
    c.password_file = Some(secret_file(&s, "pw", "from-a-file"));
    let t = Tier::connect(c, NS).unwrap();
    let ks = keys("file", 2);
    assert_eq!(store(&t, &ks, &[chunk(1), chunk(2)]), vec![OK; 2]);
    assert_eq!(load(&t, &ks).1, vec![chunk(1), chunk(2)]);
    // From a variable (this process's; a worker inherits the engine's environment).
    std::env::set_var("KVO_TEST_REDIS_PASSWORD", "from-a-file");
    let mut c = config(&url, 16 * KB);
    c.password_env = Some("KVO_TEST_REDIS_PASSWORD".into());
    let t = Tier::connect(c, NS).unwrap();
    assert_eq!(load(&t, &ks).1, vec![chunk(1), chunk(2)]);
    // An ACL user named in the url, its password in a file, with the rights docs/security.md
    // gives it (the tier's keys and commands only): stores, lookups, loads and the canary work.
    let mut raw = s.raw();
    let mut acl: Vec<&[u8]> = vec![b"ACL", b"SETUSER", b"alice", b"on", b">alice-pw"];
    acl.extend([&b"resetkeys"[..], b"~kvo2:*", b"resetchannels", b"-@all"]);
    acl.extend([
        &b"+get"[..],
        b"+set",
        b"+msetnx",
        b"+exists",
        b"+touch",
        b"+del",
    ]);
    acl.extend([&b"+pexpire"[..], b"+ping", b"+info"]);
    assert_eq!(raw.cmd(&acl), Reply::Simple("OK".into()));
    let mut c = config(&format!("redis://alice@127.0.0.1:{}", s.port), 16 * KB);
    c.password_file = Some(secret_file(&s, "alice", "alice-pw"));
    c.ttl = Some(Duration::from_secs(3600));
    let t = Tier::connect(c, NS).unwrap();
    assert_eq!(load(&t, &ks).1, vec![chunk(1), chunk(2)]);
    let more = keys("acl", 2);
    assert_eq!(store(&t, &more, &[chunk(3), chunk(4)]), vec![OK; 2]);
    assert_eq!(lookup(&t, &more), vec![OK; 2]);
    assert!(matches!(
        t.canary(b"c", b"id", Duration::from_secs(5)),
        CanaryOutcome::Written
    ));
    // Outside its keys, a command is refused: the ACL binds.
    assert!(matches!(
        raw.cmd(&[b"AUTH", b"alice", b"alice-pw"]),
        Reply::Simple(_)
    ));
    assert!(matches!(
        raw.cmd(&[b"SET", b"other", b"x"]),
        Reply::Error(_)
    ));
}

#[test]
fn bad_secrets_are_errors_that_name_where_they_were_looked_for_never_the_password() {
    let Some(s) = server!("--requirepass", "right-one") else {
        return;
    };
    let url = format!("redis://127.0.0.1:{}", s.port);
    let err = |c| match Tier::connect(c, NS) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("connected"),
    };
    let mut c = config(&url, 16 * KB);
    c.password_file = Some(secret_file(&s, "wrong", "a-wrong-one"));
    let m = err(c);
    assert!(
        m.contains("refused the credentials of password_file="),
        "{m}"
    );
    assert!(
        !m.contains("a-wrong-one") && !m.contains("right-one"),
        "{m}"
    );
    let mut c = config(&url, 16 * KB);
    c.password_file = Some(s.dir.join("absent"));
    let m = err(c);
    assert!(
        m.contains("password_file=") && m.contains("cannot read it"),
        "{m}"
    );
    let mut c = config(&url, 16 * KB);
    c.password_env = Some("KVO_TEST_UNSET_VARIABLE".into());
    assert!(err(c)
        .contains("password_env=KVO_TEST_UNSET_VARIABLE: the environment variable is not set"));
    let mut c = config(&format!("redis://:right-one@127.0.0.1:{}", s.port), 16 * KB);
    c.password_file = Some(secret_file(&s, "also", "right-one"));
    assert!(matches!(Tier::connect(c, NS), Err(RemoteError::Config(m)) if m.contains("one place")));
    let mut c = config(&format!("redis://bob@127.0.0.1:{}", s.port), 16 * KB);
    c.password_env = None;
    assert!(err(c).contains("a user without a password"));
}

#[test]
fn a_rotated_password_file_is_read_again_when_the_server_refuses_the_old_one() {
    let Some(s) = server!("--requirepass", "first") else {
        return;
    };
    let file = secret_file(&s, "pw", "first");
    let mut c = config(&format!("redis://127.0.0.1:{}", s.port), 16 * KB);
    c.password_file = Some(file.clone());
    let t = Tier::connect(c, NS).unwrap();
    let ks = keys("rotate", 1);
    assert_eq!(store(&t, &ks, &[chunk(7)]), vec![OK]);
    // The secret rotates: the server takes the new one, the mounted file changes, and the
    // open connections are closed (as a restarted or failed-over server would).
    let mut raw = s.raw();
    raw.cmd(&[b"CONFIG", b"SET", b"requirepass", b"second"]);
    std::fs::write(&file, "second\n").unwrap();
    let killed = raw.int(&[b"CLIENT", b"KILL", b"TYPE", b"normal", b"SKIPME", b"yes"]);
    assert!(killed >= 1);
    let start = Instant::now();
    loop {
        let (st, bufs) = load(&t, &ks);
        if st == vec![OK] {
            assert_eq!(bufs[0], chunk(7));
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "never reconnected"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The old password was tried first, refused (the server's log of refused AUTHs), and the
    // new one read from the file then.
    let Reply::Array(refused) = raw.cmd(&[b"ACL", b"LOG"]) else {
        panic!("ACL LOG")
    };
    assert!(!refused.is_empty());
}
