//! Replays every committed fuzz input (`fuzz/corpus/*`, and `fuzz/regressions/*` where crashes
//! found by `sjkvarn-fuzz` are kept as regression tests) through its target: no panic, no broken
//! invariant.

use std::path::PathBuf;

fn inputs(folder: &str, target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz")
        .join(folder)
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).expect("read fuzz input");
            (p, bytes)
        })
        .collect()
}

#[test]
fn committed_fuzz_inputs_pass() {
    let mut total = 0;
    for name in ["records", "snapshot", "api", "files"] {
        let f = sjkvarn::fuzz::target(name).expect("known target");
        let corpus = inputs("corpus", name);
        assert!(!corpus.is_empty(), "fuzz/corpus/{name} is committed");
        for (path, bytes) in corpus.into_iter().chain(inputs("regressions", name)) {
            if let Err(why) = f(&bytes) {
                panic!("{}: {why}", path.display());
            }
            total += 1;
        }
    }
    assert!(total >= 10);
}
