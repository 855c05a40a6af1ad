//! The exact window (`exact_recent`): what each query reads from the fp16 copies, chunked
//! prefill against decoding, truncation, forks, and the state section that carries the copies.

use sjkvarn::attention::attend;
use sjkvarn::backend::Sequence;
use sjkvarn::journal::{CacheConfig, LayerCoding, Staging};
use sjkvarn::rng::SplitMix64;
use sjkvarn::Journal;
use std::sync::Arc;

const D: usize = 64;
const QH: usize = 4;
const KVH: usize = 2;

fn config(staging: Staging, exact_recent: usize) -> CacheConfig {
    let mut c = CacheConfig::uniform(1, QH, KVH, D, LayerCoding::scalar(4, 4), 4096);
    c.min_tail = 256;
    c.max_tail = 512;
    c.max_chunk = 96;
    (c.k_staging, c.v_staging) = (staging, staging);
    c.centre_keys = true;
    c.exact_recent = exact_recent;
    c
}

fn new_seq(cfg: &CacheConfig) -> Sequence {
    let pool = Sequence::pool_for(cfg, 4);
    Sequence::new(Arc::new(cfg.clone()), pool).unwrap()
}

/// Keys with a shared offset (as real keys carry) and values, `[tokens][KVH][D]`.
fn rows(seed: u64, tokens: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix64::new(seed);
    let shared: Vec<f32> = rng.gaussians(KVH * D).iter().map(|x| 3.0 * x).collect();
    let k: Vec<f32> = rng
        .gaussians(tokens * KVH * D)
        .iter()
        .enumerate()
        .map(|(i, x)| x + shared[i % (KVH * D)])
        .collect();
    (k, rng.gaussians(tokens * KVH * D))
}

fn span(x: &[f32], from: usize, to: usize) -> &[f32] {
    &x[from * KVH * D..to * KVH * D]
}

fn queries(seed: u64, n: usize) -> Vec<f32> {
    SplitMix64::new(seed)
        .gaussians(n * QH * D)
        .iter()
        .map(|x| 2.0 * x)
        .collect()
}

/// Appends `k`/`v` to layer 0 in chunks of `chunk` and returns the outputs of every chunk's
/// queries (the rows of `q` at the chunk's positions).
fn run(cfg: &CacheConfig, k: &[f32], v: &[f32], q: &[f32], chunk: usize) -> (Sequence, Vec<f32>) {
    let tokens = k.len() / (KVH * D);
    let mut seq = new_seq(cfg);
    let mut out = Vec::new();
    let mut at = 0;
    while at < tokens {
        let n = chunk
            .min(tokens - at)
            .min(seq.chunk_limit(0).unwrap().max(1));
        seq.append(0, span(k, at, at + n), span(v, at, at + n))
            .unwrap();
        out.extend(attend(&seq, 0, &q[at * QH * D..(at + n) * QH * D], None).unwrap());
        at += n;
    }
    (seq, out)
}

fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|&b| (b as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn chunked_prefill_reads_what_decoding_reads() {
    // A ring that never seals (where chunks meet seals, decoding and prefill differ anyway).
    let (k, v) = rows(1, 1100);
    let q = queries(2, 1100);
    for width in [0, 1, 7, 128, 300] {
        let mut cfg = config(Staging::Q8_0, width);
        (cfg.min_tail, cfg.max_tail) = (4096, 4096);
        let (_, decoded) = run(&cfg, &k, &v, &q, 1);
        for chunk in [5, 96] {
            let (_, chunked) = run(&cfg, &k, &v, &q, chunk);
            // From position 200 on: a chunk that completes the sink centres the sink keys its
            // own earlier queries score (the same softmax, other fp16 roundings).
            let from = 200 * QH * D;
            if width == 0 && chunk >= 32 {
                // Without a window, chunks of 32 rows or more run as matrix products
                // (attention/prefill.rs): the same positions, other f32 roundings. A position
                // read or missed wrongly moves an output by ~1e-3; the sums' order, ~1e-7.
                for (p, (a, b)) in decoded[from..]
                    .chunks(QH * D)
                    .zip(chunked[from..].chunks(QH * D))
                    .enumerate()
                {
                    let err = relative_error(b, a);
                    assert!(
                        err <= 1e-5,
                        "chunks of {chunk}, position {}: {err:.2e}",
                        200 + p
                    );
                }
                continue;
            }
            let differ = decoded[from..]
                .iter()
                .zip(&chunked[from..])
                .position(|(a, b)| a != b);
            assert_eq!(
                differ.map(|i| 200 + i / (QH * D)),
                None,
                "width {width}, chunks of {chunk}: first position that differs"
            );
        }
    }
}

#[test]
fn a_window_over_every_position_reads_fp16_rows() {
    // An fp16 ring that never seals holds what the copies hold: a window wider than the
    // sequence must give the same attention (up to the order of the sums).
    let (k, v) = rows(3, 700);
    let q = queries(4, 700);
    let mut plain = config(Staging::F16, 0);
    plain.max_tail = 4096;
    plain.min_tail = 4096;
    let mut windowed = config(Staging::Q8_0, 1024);
    windowed.max_tail = 4096;
    windowed.min_tail = 4096;
    let (_, want) = run(&plain, &k, &v, &q, 64);
    let (_, got) = run(&windowed, &k, &v, &q, 64);
    let err = relative_error(&got, &want);
    assert!(err < 1e-5, "window against an fp16 ring: {err}");
}

#[test]
fn the_window_cuts_the_error_of_a_coded_ring() {
    // Queries that attend mostly to the newest positions (each is its own position's key,
    // scaled): a q8_0 ring with a 32-position window errs less than without, against an fp16
    // ring.
    let (k, v) = rows(5, 900);
    let q: Vec<f32> = (0..900 * QH)
        .flat_map(|i| {
            let (pos, head) = (i / QH, i % QH / (QH / KVH));
            let at = (pos * KVH + head) * D;
            k[at..at + D].iter().map(|x| 0.5 * x).collect::<Vec<f32>>()
        })
        .collect();
    let mut exact = config(Staging::F16, 0);
    exact.max_tail = 4096;
    exact.min_tail = 4096;
    let (_, want) = run(&exact, &k, &v, &q, 96);
    let errs: Vec<f64> = [0, 32]
        .iter()
        .map(|&w| {
            let mut c = config(Staging::Q8_0, w);
            c.max_tail = 4096;
            c.min_tail = 4096;
            relative_error(&run(&c, &k, &v, &q, 96).1, &want)
        })
        .collect();
    assert!(
        errs[1] < 0.9 * errs[0],
        "with window {} vs without {}",
        errs[1],
        errs[0]
    );
}

#[test]
fn states_snapshots_and_forks_carry_the_copies() {
    let mut cfg = config(Staging::Q8_0, 64);
    (cfg.layers, cfg.layer_coding) = (2, vec![cfg.layer_coding[0]; 2]);
    let (k, v) = rows(7, 800);
    let q = queries(8, 3);
    let mut seq = new_seq(&cfg);
    for layer in 0..2 {
        for at in (0..800).step_by(96) {
            let to = (at + 96).min(800);
            seq.append(layer, span(&k, at, to), span(&v, at, to))
                .unwrap();
        }
    }
    assert!(seq.sealed_groups(0).unwrap() > 0);
    let want = attend(&seq, 0, &q, None).unwrap();
    let state = seq.state_bytes().unwrap();
    let back = Sequence::from_state(Arc::new(cfg.clone()), None, &state).unwrap();
    assert_eq!(attend(&back, 0, &q, None).unwrap(), want);
    let snap = Sequence::from_snapshot(&seq.snapshot_bytes().unwrap(), None, None).unwrap();
    assert_eq!(snap.config(), &cfg);
    assert_eq!(attend(&snap, 0, &q, None).unwrap(), want);
    assert_eq!(attend(&seq.fork(), 0, &q, None).unwrap(), want);
    // The copies sit after the stream: every cut of the state, and one extra byte, is refused,
    // as is a state written without a window and one read without.
    let stream_end = state.len() - (8 + 4 + 2 * (8 + 8 + 2 * 64 * KVH * D * 2) + 8);
    for cut in [stream_end, stream_end + 1, stream_end + 20, state.len() - 1] {
        let e = Sequence::from_state(Arc::new(cfg.clone()), None, &state[..cut]);
        assert!(e.is_err(), "a state cut at {cut} of {} loaded", state.len());
    }
    let mut longer = state.clone();
    longer.push(1);
    assert!(Sequence::from_state(Arc::new(cfg.clone()), None, &longer).is_err());
    let plain = CacheConfig {
        exact_recent: 0,
        ..cfg.clone()
    };
    let e = Sequence::from_state(Arc::new(plain.clone()), None, &state).unwrap_err();
    assert!(e.to_string().contains("after the end"), "{e}");
    let e = Sequence::from_state(Arc::new(cfg.clone()), None, &state[..stream_end]).unwrap_err();
    assert!(e.to_string().contains("exact-window"), "{e}");
    let other = CacheConfig {
        exact_recent: 32,
        ..cfg.clone()
    };
    assert!(Sequence::from_state(Arc::new(other), None, &state).is_err());
    // A flipped byte inside a copy breaks the section's checksum.
    let mut flipped = state.clone();
    flipped[stream_end + 40] ^= 1;
    assert!(Sequence::from_state(Arc::new(cfg.clone()), None, &flipped).is_err());
}

#[test]
fn truncation_keeps_the_copies_before_the_cut() {
    let cfg = config(Staging::Q8_0, 48);
    let (k, v) = rows(9, 700);
    let q = queries(10, 700);
    let (_, want) = run(&cfg, &k, &v, &q, 1);
    // A cut inside the last append (which holds the copies every later query reads), then the
    // same rows again: the same outputs as decoding straight through.
    let (mut seq, _) = run(&cfg, span(&k, 0, 640), span(&v, 0, 640), &q, 32);
    seq.append(0, span(&k, 640, 656), span(&v, 640, 656))
        .unwrap();
    let resume = seq.truncate(648).unwrap();
    assert_eq!(resume, 648);
    let mut again = Vec::new();
    for pos in resume..700 {
        seq.append(0, span(&k, pos, pos + 1), span(&v, pos, pos + 1))
            .unwrap();
        again.extend(attend(&seq, 0, &q[pos * QH * D..(pos + 1) * QH * D], None).unwrap());
    }
    assert!(again == want[648 * QH * D..]);
}

#[test]
fn memory_reports_count_the_window() {
    let (k, v) = rows(11, 400);
    let with = {
        let mut s = new_seq(&config(Staging::Q8_0, 64));
        s.append(0, &k, &v).unwrap();
        s.memory()
    };
    let without = {
        let mut s = new_seq(&config(Staging::Q8_0, 0));
        s.append(0, &k, &v).unwrap();
        s.memory()
    };
    assert_eq!(with.in_use_bytes - without.in_use_bytes, 64 * KVH * D * 4);
    assert_eq!(with.ring_bytes - without.ring_bytes, 64 * KVH * D * 4);
    let extra = with.effective_bits - without.effective_bits;
    assert!((extra - 16.0 * 64.0 / 400.0).abs() < 1e-9, "{extra}");
}

#[test]
fn bad_windows_are_refused_and_windows_are_not_reference() {
    let mut cfg = CacheConfig::uniform(2, QH, KVH, 128, LayerCoding::scalar(4, 4), 4096);
    assert!(cfg.is_reference());
    cfg.exact_recent = 16;
    assert!(!cfg.is_reference());
    cfg.exact_recent = sjkvarn::journal::MAX_EXACT_RECENT + 1;
    let e = cfg.validate().unwrap_err();
    assert!(e.to_string().contains("exact_recent"), "{e}");
}
