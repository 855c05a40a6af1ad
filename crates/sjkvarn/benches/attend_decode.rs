//! One decode query over one layer of a compressed cache, timed in Rust (no Python, no torch):
//! the quick loop for tuning the CPU attention kernels and for profiling them
//! (`perf record -g target/release/deps/attend_decode-*`). `benches/attention_cpu.py` is the
//! side-by-side comparison with torch SDPA that docs/results/speed.md quotes.
//!
//! Run: `cargo bench -p sjkvarn --bench attend_decode -- [--tokens 65536] [--geometry 24/4/256]
//! [--body 4/4|3/2t] [--repeats 21] [--gap-us 0] [--evict-mb 0] [--paired 2]` (threads:
//! `RAYON_NUM_THREADS`). `--paired N` alternates 1-thread and N-thread calls and prints the
//! median of each round's ratio, so the machine's drift between minutes cancels.
//! `--evict-mb N` writes N MiB between calls (untimed), as a model's other layers would, so
//! each call starts with its cache out of the CPU's caches. The filled cache is kept
//! as a snapshot under `target/` so a rerun skips the seal.

use sjkvarn::attention::{attend, attend_with_threads};
use sjkvarn::backend::Sequence;
use sjkvarn::codec::extension::body::{BodyCoding, TrellisAxis};
use sjkvarn::journal::{CacheConfig, LayerCoding};
use sjkvarn::rng::SplitMix64;
use sjkvarn::Journal;
use std::sync::Arc;
use std::time::Instant;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let tokens: usize = arg(&args, "--tokens", "65536").parse().expect("--tokens");
    let geometry = arg(&args, "--geometry", "24/4/256");
    let body = arg(&args, "--body", "4/4");
    let repeats: usize = arg(&args, "--repeats", "21").parse().expect("--repeats");
    // Idle time between calls, as a model's other layers would leave: long enough for idle
    // worker threads to go to sleep, so each call pays for waking them.
    let gap_us: u64 = arg(&args, "--gap-us", "0").parse().expect("--gap-us");
    let evict_mb: usize = arg(&args, "--evict-mb", "0").parse().expect("--evict-mb");
    let paired: usize = arg(&args, "--paired", "0").parse().expect("--paired");
    let mut evict = vec![0u8; evict_mb << 20];
    let g: Vec<usize> = geometry
        .split('/')
        .map(|x| x.parse().expect("geometry"))
        .collect();
    let (qh, kvh, d) = (g[0], g[1], g[2]);
    let trellis = body.ends_with('t');
    let bits: Vec<u32> = body
        .trim_end_matches('t')
        .split('/')
        .map(|x| x.parse().expect("body"))
        .collect();
    let mut coding = LayerCoding::scalar(bits[0], bits[1]);
    if trellis {
        coding.k_coding = BodyCoding::Trellis(TrellisAxis::Token);
        coding.v_coding = BodyCoding::Trellis(TrellisAxis::Token);
    }
    let cfg = Arc::new(CacheConfig::uniform(1, qh, kvh, d, coding, tokens + 1));
    let path = std::path::PathBuf::from(format!(
        "target/attend_decode_{}_{}_{}.sjkv",
        geometry.replace('/', "-"),
        body.replace('/', "-"),
        tokens
    ));
    let mut rng = SplitMix64::new(tokens as u64);
    let seq = match Sequence::load(&path, None, Some(&cfg)) {
        Ok(seq) => seq,
        Err(_) => {
            let pool = Sequence::pool_for(&cfg, 1);
            let mut seq = Sequence::new(cfg.clone(), pool).expect("sequence");
            let mut appending = std::time::Duration::ZERO;
            while seq.len(0).unwrap() < tokens {
                let n = seq
                    .chunk_limit(0)
                    .unwrap()
                    .min(tokens - seq.len(0).unwrap());
                let (k, v) = (rng.gaussians(n * kvh * d), rng.gaussians(n * kvh * d));
                let start = Instant::now();
                seq.append(0, &k, &v).expect("append");
                appending += start.elapsed();
            }
            eprintln!(
                "filled {tokens} tokens: appends took {:.3} s",
                appending.as_secs_f64()
            );
            let _ = seq.save(&path);
            seq
        }
    };
    let q = rng.gaussians(qh * d);
    let _ = attend(&seq, 0, &q, None).expect("attend");
    let evict_between = |evict: &mut [u8]| {
        if gap_us > 0 {
            std::thread::sleep(std::time::Duration::from_micros(gap_us));
        }
        // Lines in a pseudo-random order: a plain sweep is taken for a stream and leaves
        // much of the cache alone.
        let lines = evict.len() / 64;
        let mut at = 1usize;
        for _ in 0..lines {
            at = at
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let line = (at >> 20) % lines.max(1);
            evict[line * 64] = evict[line * 64].wrapping_add(1);
        }
        std::hint::black_box(&evict);
    };
    let timed = |threads: Option<usize>, evict: &mut [u8]| {
        evict_between(evict);
        let start = Instant::now();
        std::hint::black_box(attend_with_threads(&seq, 0, &q, None, threads).expect("attend"));
        start.elapsed().as_secs_f64() * 1e3
    };
    if paired > 0 {
        let (mut one, mut many, mut ratio) = (vec![], vec![], vec![]);
        for _ in 0..repeats {
            let (a, b) = (timed(Some(1), &mut evict), timed(Some(paired), &mut evict));
            one.push(a);
            many.push(b);
            ratio.push(a / b);
        }
        for v in [&mut one, &mut many, &mut ratio] {
            v.sort_by(f64::total_cmp);
        }
        let (mid, q1, q3) = (repeats / 2, repeats / 4, 3 * repeats / 4);
        println!(
            "{geometry} {body} {tokens} tokens: 1 thread {:.3} ms, {paired} threads {:.3} ms, \
             paired speed-up {:.2} [{:.2}, {:.2}] over {repeats} rounds",
            one[mid], many[mid], ratio[mid], ratio[q1], ratio[q3]
        );
        return;
    }
    let mut times: Vec<f64> = (0..repeats).map(|_| timed(None, &mut evict)).collect();
    times.sort_by(f64::total_cmp);
    let m = seq.memory();
    println!(
        "{geometry} {body} {tokens} tokens, {} sealed: median {:.2} ms (min {:.2}, max {:.2}) over {repeats}",
        m.sealed_tokens,
        times[repeats / 2],
        times[0],
        times[repeats - 1]
    );
}
