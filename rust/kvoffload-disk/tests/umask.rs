//! Every file and directory the disk tier creates has the mode of `file_mode` whatever the
//! process's umask (a test binary of its own: the umask is process-wide).

mod common;

use common::files::{config, mode, tree};
use common::jobs::{open_cfg, store};
use common::TempDir;
use kvoffload_tier::status::OK;

#[test]
fn files_and_directories_get_file_modes_mode_under_a_permissive_umask() {
    // SAFETY: umask only sets the process's mask (this binary's one test).
    let old = unsafe { libc::umask(0) };
    let d = TempDir::new("modes");
    for (file_mode, dir_mode) in [(0o600, 0o700), (0o640, 0o750), (0o660, 0o770)] {
        let root = d.0.join(format!("m{file_mode:o}")).join("cache");
        let jobs = open_cfg(config(&root, file_mode), 100, 2);
        assert_eq!(store(&jobs, &[0, 1, 2, 3]), vec![OK; 4]);
        jobs.close();
        let all = tree(&d.0.join(format!("m{file_mode:o}")));
        assert!(all.len() >= 4 + 3, "{all:?}");
        for p in all {
            let want = if p.is_dir() { dir_mode } else { file_mode };
            assert_eq!(mode(&p), want, "{}", p.display());
        }
    }
    unsafe { libc::umask(old) };
}
