//! In-repo fuzzer for everything that reads untrusted bytes or arguments (cargo fuzz needs a
//! nightly toolchain; this runs on stable, in CI, for a bounded time).
//!
//! Targets:
//! - `records`: decoding of every flat format, body records (reference scalar and trellis, extensions)
//!   and trellis runs from arbitrary bytes;
//! - `snapshot`: `Sequence::from_snapshot` on mutated snapshots (checksum fixed up half the
//!   time, so the parser behind it is reached);
//! - `api`: the argument validation the Python layer relies on: arbitrary configurations, then
//!   appends, attention, truncation, seals, forks and snapshots with arbitrary shapes, layers,
//!   positions and values (NaN, Inf, huge). Every call must return Ok or an error, and a call
//!   that errs must leave the sequence byte-identical;
//! - `files`: concurrent saves to paths sharing a stem or to one path, with loads of the files
//!   being replaced: every file holds one whole snapshot, its own writer's where paths differ.
//!
//! A blind mutational fuzzer (no coverage feedback): inputs come from the committed corpus
//! (`fuzz/corpus/<target>/`) and are mutated by bit flips, byte writes, truncation, splicing and
//! insertion; inputs that reach an outcome not seen before join the in-memory corpus. A panic
//! or a broken invariant writes the input to `fuzz/crashes/` and exits 1.
//!
//! `sjkvarn-fuzz [--seconds N] [--write-corpus] [records|snapshot|api|files ...]`

use sjkvarn::backend::cpu::snapshot::fnv1a64;
use sjkvarn::fuzz::{seed_corpus, Outcome};
use sjkvarn::rng::SplitMix64;
use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn mutate(rng: &mut SplitMix64, corpus: &[Vec<u8>], input: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.next_u64() % 4 {
        let n = out.len();
        match rng.next_u64() % 7 {
            0 if n > 0 => {
                let i = (rng.next_u64() as usize) % n;
                out[i] ^= 1 << (rng.next_u64() % 8);
            }
            1 if n > 0 => {
                let i = (rng.next_u64() as usize) % n;
                out[i] = rng.next_u64() as u8;
            }
            2 if n > 0 => out.truncate((rng.next_u64() as usize) % n),
            3 => {
                let i = if n == 0 {
                    0
                } else {
                    (rng.next_u64() as usize) % (n + 1)
                };
                let extra: Vec<u8> = (0..1 + rng.next_u64() % 16)
                    .map(|_| rng.next_u64() as u8)
                    .collect();
                out.splice(i..i, extra);
            }
            4 if !corpus.is_empty() => {
                let other = &corpus[(rng.next_u64() as usize) % corpus.len()];
                if !other.is_empty() && n > 0 {
                    let cut = (rng.next_u64() as usize) % n;
                    let from = (rng.next_u64() as usize) % other.len();
                    out.truncate(cut);
                    out.extend_from_slice(&other[from..]);
                }
            }
            5 if n > 4 => {
                // Interesting integers at a random offset (lengths, counts).
                let i = (rng.next_u64() as usize) % (n - 4);
                let v: u32 = *[0u32, 1, 0xff, 0xffff, 0x7fff_ffff, 0xffff_ffff]
                    .get((rng.next_u64() % 6) as usize)
                    .unwrap_or(&0);
                out[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => {}
        }
    }
    out
}

fn corpus_dir(root: &Path, target: &str) -> PathBuf {
    root.join("fuzz").join("corpus").join(target)
}

fn load_corpus(root: &Path, target: &str) -> Vec<Vec<u8>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir(root, target))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    files
        .into_iter()
        .filter_map(|p| std::fs::read(p).ok())
        .collect()
}

fn run(target: &str, root: &Path, budget: Duration, seed: u64) -> Result<(u64, usize), String> {
    let f = sjkvarn::fuzz::target(target).ok_or_else(|| format!("unknown target {target}"))?;
    let mut corpus = load_corpus(root, target);
    if corpus.is_empty() {
        corpus = seed_corpus(target);
    }
    let mut seen: HashSet<Outcome> = HashSet::new();
    let mut rng = SplitMix64::new(seed);
    let start = Instant::now();
    let mut execs = 0u64;
    let check = |input: &[u8], execs: &mut u64| -> Result<Option<Outcome>, String> {
        *execs += 1;
        match catch_unwind(AssertUnwindSafe(|| f(input))) {
            Ok(Ok(outcome)) => Ok(Some(outcome)),
            Ok(Err(broken)) => Err(broken),
            Err(_) => Err("panic".into()),
        }
    };
    let fail = |input: &[u8], why: &str| -> String {
        let dir = root.join("fuzz").join("crashes");
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join(format!("{target}-{:016x}.bin", fnv1a64(input)));
        let _ = std::fs::write(&path, input);
        format!("{target}: {why}; input saved to {}", path.display())
    };
    for input in corpus.clone() {
        match check(&input, &mut execs) {
            Ok(Some(o)) => {
                seen.insert(o);
            }
            Ok(None) => {}
            Err(why) => return Err(fail(&input, &why)),
        }
    }
    while start.elapsed() < budget {
        let parent = &corpus[(rng.next_u64() as usize) % corpus.len()];
        let input = mutate(&mut rng, &corpus, parent);
        match check(&input, &mut execs) {
            Ok(Some(o)) => {
                if seen.insert(o) {
                    corpus.push(input);
                }
            }
            Ok(None) => {}
            Err(why) => return Err(fail(&input, &why)),
        }
    }
    Ok((execs, seen.len()))
}

fn main() {
    let mut args = std::env::args().skip(1).peekable();
    let mut seconds = 10u64;
    let mut write_corpus = false;
    let mut targets = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seconds" => {
                seconds = args.next().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
                    eprintln!("--seconds needs a number");
                    std::process::exit(2)
                })
            }
            "--write-corpus" => write_corpus = true,
            "-h" | "--help" => {
                println!(
                    "sjkvarn-fuzz [--seconds N] [--write-corpus] [records|snapshot|api|files ...]"
                );
                return;
            }
            t => targets.push(t.to_string()),
        }
    }
    if targets.is_empty() {
        targets = ["records", "snapshot", "api", "files"]
            .map(String::from)
            .to_vec();
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    // Panics are caught and reported per input; keep their messages off the terminal.
    std::panic::set_hook(Box::new(|_| {}));
    if write_corpus {
        for t in &targets {
            let dir = corpus_dir(&root, t);
            std::fs::create_dir_all(&dir).expect("corpus folder");
            for (i, input) in seed_corpus(t).iter().enumerate() {
                std::fs::write(dir.join(format!("seed-{i:02}.bin")), input).expect("write seed");
            }
            println!("{t}: wrote {}", dir.display());
        }
        return;
    }
    let mut failed = false;
    for (i, t) in targets.iter().enumerate() {
        match run(t, &root, Duration::from_secs(seconds), 0x5eed + i as u64) {
            Ok((execs, outcomes)) => println!(
                "{t}: {execs} executions in {seconds} s, {outcomes} distinct outcomes, no crash"
            ),
            Err(msg) => {
                eprintln!("FAIL {msg}");
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
