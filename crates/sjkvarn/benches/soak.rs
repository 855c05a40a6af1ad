//! Soak test: many sequences sharing one record pool under random appends, decodes, forks,
//! truncations, idle seals, snapshots and drops, with the invariants checked after every step.
//!
//! `cargo bench -p sjkvarn --bench soak -- [--tokens N] [--sequences N] [--seed N] [--json F]`
//!
//! Token content is a pure function of (content stream, position), so an exact model of every
//! sequence is just its stream id and length. After every step the touched sequence must have:
//! - the model's length in every layer, and regions that add up (sink = min(len, 128), body =
//!   whole groups, ring <= max_tail + max_chunk);
//! - its fp16 sink equal to fp16(rotated content), its newest ring rows within the 6-bit staging error of
//!   the content, and sealed records that decode close to the content (no lost or misplaced data);
//! - attention bit-identical to the same state restored from its snapshot.
//!
//! Now and then up to four live sequences save at once from their own threads, to files whose
//! names share a stem and two of them to one shared file; every file must load as its own
//! sequence's whole snapshot (the shared one as one of its writers') with no temporary left.
//!
//! The pool's used slots must equal the distinct slots referenced by live sequences, each with a
//! reference count equal to the number of sequences holding it. Any violation panics.
//! Reports tokens/s, operation counts, pool high-water mark and RSS (start, middle, end, peak).

use sjkvarn::attention::attend;
use sjkvarn::backend::{RecordPool, Sequence};
use sjkvarn::codec::extension::body::BodyCoding;
use sjkvarn::error::CacheError;
use sjkvarn::journal::RingRows;
use sjkvarn::journal::{CacheConfig, LayerCoding, SINK};
use sjkvarn::rng::SplitMix64;
use sjkvarn::Journal;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

const LAYERS: usize = 2;
const KV: usize = 2;
const Q: usize = 4;
const D: usize = 64;

/// K and V of `n` tokens from position `from` of content stream `stream` (all layers alike
/// but for a per-layer offset), `[n][KV][D]` each.
/// Every byte a sequence holds, layer by layer.
fn images(seq: &Sequence) -> Vec<sjkvarn::backend::LayerImage> {
    (0..seq.config().layers)
        .map(|l| seq.layer_image(l).unwrap())
        .collect()
}

fn content(stream: u64, layer: usize, from: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut k, mut v) = (
        Vec::with_capacity(n * KV * D),
        Vec::with_capacity(n * KV * D),
    );
    for pos in from..from + n {
        let mut rng = SplitMix64::new(stream * 1_000_003 + pos as u64 * 7919 + layer as u64);
        for _ in 0..KV {
            let row = rng.gaussians(2 * D);
            k.extend(
                row[..D]
                    .iter()
                    .enumerate()
                    .map(|(c, x)| if c == 3 { x * 8.0 } else { *x }),
            );
            v.extend_from_slice(&row[D..]);
        }
    }
    (k, v)
}

struct Live {
    seq: Sequence,
    stream: u64,
}

fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn config() -> Arc<CacheConfig> {
    let mut c = CacheConfig::uniform(LAYERS, Q, KV, D, LayerCoding::scalar(4, 4), 6144);
    c.min_tail = 256;
    c.max_tail = 512;
    c.max_chunk = 128;
    // Layer 1: the reference 3/2 trellis body (layer 0 stays 4/4 scalar).
    let t = BodyCoding::Trellis(sjkvarn::codec::extension::body::TrellisAxis::Token);
    c.layer_coding[1] = LayerCoding {
        k_bits: 3,
        v_bits: 2,
        k_coding: t,
        v_coding: t,
    };
    c.validate().expect("valid soak configuration");
    Arc::new(c)
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum::<f32>().max(1e-12);
    (num / den).sqrt()
}

/// Data checks of one sequence against its content stream (sampled positions).
fn check_data(live: &Live, cfg: &CacheConfig, rng: &mut SplitMix64) {
    let rows = RingRows::new(cfg.k_staging, cfg.v_staging, D);
    for layer in 0..LAYERS {
        let img = live.seq.layer_image(layer).expect("image");
        let len = img.len;
        assert_eq!(len, live.seq.len(0).unwrap(), "layers disagree on length");
        let [sink, body, ring] = live.seq.regions(layer).unwrap();
        assert_eq!(sink.end, len.min(SINK));
        assert_eq!(body.len(), img.sealed * 128);
        assert_eq!(sink.len() + body.len() + ring.len(), len);
        assert!(
            ring.len() <= cfg.max_tail + cfg.max_chunk,
            "ring holds {}",
            ring.len()
        );
        if len == 0 {
            continue;
        }
        // Sink: fp16 of the rotated content, exactly.
        let p = rng.next_u64() as usize % len.min(SINK);
        let (mut k, _) = content(live.stream, layer, p, 1);
        sjkvarn::codec::rotation::rotate_heads(&mut k, D).unwrap();
        for h in 0..KV {
            for c in 0..D {
                let got = half::f16::from_bits(img.sink_k[(p * KV + h) * D + c]);
                assert_eq!(got, half::f16::from_f32(k[h * D + c]), "sink position {p}");
            }
        }
        // Ring: the newest row, within the staging error.
        if !ring.is_empty() {
            let p = ring.end - 1;
            let (k, v) = content(live.stream, layer, p, 1);
            let idx = (p - SINK) % cfg.ring_rows();
            for h in 0..KV {
                for (value, want) in [(false, &k), (true, &v)] {
                    let mut row = vec![0.0f32; D];
                    let bytes = &img.ring[rows.range(idx * KV + h, value)];
                    rows.side(value).decode(bytes, &mut row);
                    sjkvarn::codec::rotation::rotate_heads(&mut row, D).unwrap();
                    let e = rel_err(&row, &want[h * D..(h + 1) * D]);
                    assert!(e < 0.2, "ring position {p}: relative error {e}");
                }
            }
        }
        // Body: one random sealed group decodes close to its content.
        if img.sealed > 0 {
            let g = rng.next_u64() as usize % img.sealed;
            let codec = cfg.body_codec(layer).expect("a validated configuration");
            let rb = codec.record_bytes();
            let h = rng.next_u64() as usize % KV;
            let rec = &img.records[g * cfg.slot_bytes() + h * rb..][..rb];
            let (kk, vv) = codec.decode_model_frame(rec).unwrap();
            let (k, v) = content(live.stream, layer, SINK + g * 128, 128);
            let pick = |x: &[f32]| -> Vec<f32> {
                (0..128)
                    .flat_map(|t| x[(t * KV + h) * D..(t * KV + h + 1) * D].to_vec())
                    .collect()
            };
            let (ek, ev) = (rel_err(&kk, &pick(&k)), rel_err(&vv, &pick(&v)));
            // 2-bit values are ~0.5 off (min/max rounding of Gaussian data); data from another
            // position or stream would be ~1.4 off.
            assert!(
                ek < 0.75 && ev < 0.75,
                "group {g} head {h}: key error {ek}, value error {ev}"
            );
        }
    }
}

fn check_pool(pool: &RecordPool, live: &[Option<Live>]) {
    let mut holders: HashMap<u32, u32> = HashMap::new();
    for l in live.iter().flatten() {
        for id in l.seq.slots() {
            *holders.entry(id).or_default() += 1;
        }
    }
    assert_eq!(
        pool.stats().used,
        holders.len(),
        "pool used slots vs referenced slots"
    );
    for (id, n) in holders {
        assert_eq!(pool.refs(id), n, "slot {id} reference count");
    }
}

/// Saves up to four live sequences (from `start` on) at once, each from its own thread, to
/// `dir/seq.N` (names sharing a stem), the first two also to `dir/shared.snap`; then checks every
/// file. Returns whether a concurrent save ran (it needs two sequences that can snapshot).
fn save_concurrently(live: &[Option<Live>], start: usize, dir: &Path) -> bool {
    let picked: Vec<(&Sequence, Vec<u8>)> = (0..live.len())
        .filter_map(|i| live[(start + i) % live.len()].as_ref())
        .filter_map(|l| l.seq.snapshot_bytes().ok().map(|b| (&l.seq, b)))
        .take(4)
        .collect();
    if picked.len() < 2 {
        return false;
    }
    let shared = dir.join("shared.snap");
    std::thread::scope(|scope| {
        for (i, (seq, _)) in picked.iter().enumerate() {
            let (own, shared) = (dir.join(format!("seq.{i}")), &shared);
            scope.spawn(move || {
                seq.save(&own).expect("a concurrent save fails");
                if i < 2 {
                    seq.save(shared)
                        .expect("a concurrent save of one path fails");
                }
            });
        }
    });
    for (i, (_, want)) in picked.iter().enumerate() {
        let path = dir.join(format!("seq.{i}"));
        assert!(
            &std::fs::read(&path).unwrap() == want,
            "seq.{i} holds another snapshot"
        );
        let back = Sequence::load(&path, None, None).expect("a saved file loads");
        assert!(
            &back.snapshot_bytes().unwrap() == want,
            "seq.{i} does not round-trip"
        );
    }
    let got = std::fs::read(&shared).unwrap();
    assert!(
        got == picked[0].1 || got == picked[1].1,
        "the shared file mixes writers"
    );
    let left = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .ends_with(sjkvarn::backend::cpu::snapshot::TEMP_SUFFIX)
        })
        .count();
    assert_eq!(left, 0, "temporary files left behind");
    true
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut tokens, mut sequences, mut seed, mut json) = (2_000_000usize, 64usize, 1u64, None);
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> u64 {
            args.next().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
                eprintln!("{what} needs a number");
                std::process::exit(2)
            })
        };
        match a.as_str() {
            "--tokens" => tokens = num("--tokens") as usize,
            "--sequences" => sequences = num("--sequences") as usize,
            "--seed" => seed = num("--seed"),
            "--json" => json = args.next(),
            "--bench" => {}
            other => {
                eprintln!("unknown argument {other}");
                std::process::exit(2)
            }
        }
    }
    let cfg = config();
    // A pool smaller than every sequence at full length: exhaustion happens and must be clean.
    let pool = RecordPool::new(cfg.slot_bytes(), cfg.slots_per_sequence() * sequences / 8);
    let mut live: Vec<Option<Live>> = (0..sequences).map(|_| None).collect();
    let mut rng = SplitMix64::new(seed);
    let mut next_stream = 0u64;
    let mut counts: HashMap<&'static str, u64> = HashMap::new();
    let (mut appended, mut steps, mut high_water) = (0usize, 0u64, 0usize);
    let start = Instant::now();
    let rss_start = rss_kib("VmRSS:");
    let mut rss_mid = 0u64;
    let files = std::env::temp_dir().join(format!("sjkvarn-soak-{}", std::process::id()));
    std::fs::create_dir_all(&files).expect("a folder for the saved files");
    while appended < tokens {
        steps += 1;
        if appended >= tokens / 2 && rss_mid == 0 {
            rss_mid = rss_kib("VmRSS:");
        }
        let slot = rng.next_u64() as usize % sequences;
        if live[slot].is_none() {
            let stream = next_stream;
            next_stream += 1;
            live[slot] = Some(Live {
                seq: Sequence::new(cfg.clone(), pool.clone()).expect("sequence"),
                stream,
            });
            *counts.entry("create").or_default() += 1;
        }
        let op = rng.next_u64() % 100;
        if op == 96 {
            let start = rng.next_u64() as usize % sequences;
            if save_concurrently(&live, start, &files) {
                *counts.entry("concurrent_save").or_default() += 1;
            }
        }
        let l = live[slot].as_mut().expect("live");
        let len = l.seq.len(0).unwrap();
        match op {
            0..=54 => {
                let n = (1 + rng.next_u64() as usize % 300).min(cfg.max_tokens - len);
                let before = images(&l.seq);
                let mut failed = None;
                for layer in 0..LAYERS {
                    let (k, v) = content(l.stream, layer, len, n);
                    if let Err(e) = l.seq.append(layer, &k, &v) {
                        failed = Some((layer, e));
                        break;
                    }
                }
                match failed {
                    None => {
                        appended += n;
                        *counts.entry("append").or_default() += 1;
                    }
                    Some((0, CacheError::PoolExhausted { .. })) => {
                        assert!(images(&l.seq) == before, "failed append changed it");
                        *counts.entry("pool_exhausted").or_default() += 1;
                        live[slot] = None; // free its slots for the others
                    }
                    Some((failed_layer, CacheError::PoolExhausted { .. })) => {
                        // Earlier layers took the tokens, a later one could not: roll them back.
                        // Truncation restores the state of a `len`-token sequence, which may
                        // have fewer sealed groups than this one had (its seals ran early, in
                        // chunks), so re-append what it asks for, as an engine would.
                        assert_eq!(
                            l.seq.len(failed_layer).unwrap(),
                            len,
                            "failed layer changed"
                        );
                        let from = l.seq.truncate(len).unwrap();
                        let mut restored = true;
                        for layer in 0..failed_layer {
                            let have = l.seq.len(layer).unwrap();
                            assert!(have >= from && have <= len);
                            let (k, v) = content(l.stream, layer, have, len - have);
                            if l.seq.append(layer, &k, &v).is_err() {
                                restored = false;
                                break;
                            }
                        }
                        *counts.entry("pool_exhausted").or_default() += 1;
                        if restored {
                            assert_eq!(l.seq.len(0).unwrap(), len);
                            if from < len {
                                *counts.entry("rollback_reprocessed").or_default() += 1;
                            }
                        } else {
                            live[slot] = None;
                        }
                    }
                    Some((_, e)) if n == 0 => {
                        let _ = e;
                    }
                    Some((_, e)) => panic!("append of {n} at {len} failed: {e}"),
                }
            }
            55..=74 if len > 0 => {
                let layer = rng.next_u64() as usize % LAYERS;
                let q: Vec<f32> = rng.gaussians(Q * D);
                let a = attend(&l.seq, layer, &q, None).expect("attend");
                // A snapshot needs every layer at the same journal state (a rolled-back append
                // can leave them apart until the next seal).
                if let Ok(bytes) = l.seq.snapshot_bytes() {
                    let restored =
                        Sequence::from_snapshot(&bytes, None, None).expect("snapshot restores");
                    let b = attend(&restored, layer, &q, None).expect("attend restored");
                    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
                }
                assert!(a.iter().all(|x| x.is_finite()));
                *counts.entry("decode").or_default() += 1;
            }
            75..=82 if len > 0 => {
                let n = rng.next_u64() as usize % len;
                let from = l.seq.truncate(n).unwrap();
                // Re-run what the journal dropped, as the transformers integration does.
                let mut ok = true;
                if from < n {
                    for layer in 0..LAYERS {
                        let (k, v) = content(l.stream, layer, from, n - from);
                        if l.seq.append(layer, &k, &v).is_err() {
                            ok = false;
                            break;
                        }
                    }
                }
                if ok {
                    assert_eq!(l.seq.len(0).unwrap(), n);
                    *counts.entry("truncate").or_default() += 1;
                } else {
                    live[slot] = None;
                    *counts.entry("pool_exhausted").or_default() += 1;
                }
            }
            83..=88 => {
                let target = rng.next_u64() as usize % sequences;
                if live[target].is_none() {
                    let child = Live {
                        seq: live[slot].as_ref().unwrap().seq.fork(),
                        stream: live[slot].as_ref().unwrap().stream,
                    };
                    live[target] = Some(child);
                    *counts.entry("fork").or_default() += 1;
                }
            }
            89..=93 => {
                if l.seq.seal_idle(0).is_ok() {
                    *counts.entry("seal_idle").or_default() += 1;
                } else {
                    *counts.entry("pool_exhausted").or_default() += 1;
                }
            }
            96 => {}
            94..=95 => {
                let Ok(bytes) = l.seq.snapshot_bytes() else {
                    continue;
                };
                let restored = Sequence::from_snapshot(&bytes, Some(pool.clone()), None);
                if let Ok(seq) = restored {
                    assert_eq!(seq.snapshot_bytes().unwrap(), bytes);
                    l.seq = seq;
                    *counts.entry("snapshot_restore").or_default() += 1;
                }
            }
            _ => {
                live[slot] = None;
                *counts.entry("drop").or_default() += 1;
            }
        }
        if let Some(l) = live[slot].as_ref() {
            check_data(l, &cfg, &mut rng);
        }
        high_water = high_water.max(pool.stats().used);
        if steps % 64 == 0 {
            check_pool(&pool, &live);
        }
    }
    check_pool(&pool, &live);
    let _ = std::fs::remove_dir_all(&files);
    live.clear();
    assert_eq!(pool.stats().used, 0, "every slot returns to the pool");
    let secs = start.elapsed().as_secs_f64();
    let rss_end = rss_kib("VmRSS:");
    let peak = rss_kib("VmHWM:");
    let mut ops: Vec<_> = counts.into_iter().collect();
    ops.sort();
    println!(
        "soak: {appended} tokens appended over {steps} steps in {secs:.1} s ({:.0} tokens/s), \
         {sequences} sequences, pool high-water {high_water} of {} slots",
        appended as f64 / secs,
        pool.stats().capacity
    );
    println!("operations: {ops:?}");
    println!(
        "RSS: start {} MiB, middle {} MiB, end {} MiB, peak {} MiB; zero invariant violations",
        rss_start / 1024,
        rss_mid / 1024,
        rss_end / 1024,
        peak / 1024
    );
    if let Some(path) = json {
        let ops_json: Vec<String> = ops.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
        let text = format!(
            "{{\"tokens\": {appended}, \"steps\": {steps}, \"seconds\": {secs:.2}, \
             \"sequences\": {sequences}, \"pool_high_water\": {high_water}, \
             \"rss_start_kib\": {rss_start}, \"rss_mid_kib\": {rss_mid}, \
             \"rss_end_kib\": {rss_end}, \"rss_peak_kib\": {peak}, \"ops\": {{{}}}}}\n",
            ops_json.join(", ")
        );
        std::fs::write(&path, text).expect("write the JSON");
    }
}
