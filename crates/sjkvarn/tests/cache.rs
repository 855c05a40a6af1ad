//! Journal behaviour: exactness, the reference seal rule, schedules, truncation, snapshots, pool
//! exhaustion and concurrent use.

use proptest::prelude::*;
use sjkvarn::attention::attend;
use sjkvarn::backend::{LayerImage, Sequence};
use sjkvarn::codec::extension::body::{BodyCoding, TrellisAxis};
use sjkvarn::codec::rotation::rotate_heads;
use sjkvarn::error::CacheError;
use sjkvarn::journal::{CacheConfig, LayerCoding, Staging, SINK};
use sjkvarn::rng::SplitMix64;
use sjkvarn::Journal;
use std::sync::Arc;

const D: usize = 64;

fn small_config(staging: Staging, coding: LayerCoding) -> CacheConfig {
    let mut c = CacheConfig::uniform(2, 4, 2, D, coding, 2048);
    c.min_tail = 128;
    c.max_tail = 384;
    c.max_chunk = 96;
    (c.k_staging, c.v_staging) = (staging, staging);
    c
}

fn trellis(k: u32, v: u32) -> LayerCoding {
    let t = BodyCoding::Trellis(TrellisAxis::Token);
    LayerCoding {
        k_bits: k,
        v_bits: v,
        k_coding: t,
        v_coding: t,
    }
}

fn kv(rng: &mut SplitMix64, tokens: usize, heads: usize) -> Vec<f32> {
    // fp16-representable values, so fp16 regions are exact
    rng.gaussians(tokens * heads * D)
        .into_iter()
        .map(|x| half::f16::from_f32(x).to_f32())
        .collect()
}

/// Every byte a sequence holds, layer by layer (works when layers differ in length).
fn images(seq: &Sequence) -> Vec<LayerImage> {
    (0..seq.config().layers)
        .map(|l| seq.layer_image(l).unwrap())
        .collect()
}

/// The `SJKVSEQ` payload (sink, records, tail rows) without the header, whose `B_prev` and
/// draining flag depend on the append schedule.
fn payload(seq: &Sequence) -> (usize, usize, Vec<u8>) {
    let s = seq.state_bytes().unwrap();
    (
        seq.len(0).unwrap(),
        seq.sealed_groups(0).unwrap(),
        s[128..s.len() - 8].to_vec(),
    )
}

fn new_seq(cfg: CacheConfig) -> Sequence {
    let pool = Sequence::pool_for(&cfg, 4);
    Sequence::new(Arc::new(cfg), pool).unwrap()
}

/// Straightforward f64 causal attention with GQA over full K/V `[len][kv][D]`.
fn reference(k: &[f32], v: &[f32], q: &[f32], len: usize, qh: usize, kvh: usize) -> Vec<f32> {
    let n = q.len() / (qh * D);
    let mut out = vec![0.0f32; q.len()];
    for i in 0..n {
        let pos = len - n + i;
        for head in 0..qh {
            let h = head / (qh / kvh);
            let qv = &q[(i * qh + head) * D..(i * qh + head + 1) * D];
            let logits: Vec<f64> = (0..=pos)
                .map(|t| {
                    let kr = &k[(t * kvh + h) * D..(t * kvh + h + 1) * D];
                    qv.iter()
                        .zip(kr)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        / (D as f64).sqrt()
                })
                .collect();
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
            let s: f64 = w.iter().sum();
            for c in 0..D {
                let acc: f64 = (0..=pos)
                    .map(|t| w[t] * v[(t * kvh + h) * D + c] as f64)
                    .sum();
                out[(i * qh + head) * D + c] = (acc / s) as f32;
            }
        }
    }
    out
}

#[test]
fn exact_regions_match_reference_attention() {
    let mut cfg = small_config(Staging::F16, LayerCoding::scalar(4, 4));
    cfg.max_tail = 4096; // never seals: sink + fp16 ring only
    let mut seq = new_seq(cfg);
    let mut rng = SplitMix64::new(1);
    let (k, v) = (kv(&mut rng, 300, 2), kv(&mut rng, 300, 2));
    seq.append(0, &k[..200 * 2 * D], &v[..200 * 2 * D]).unwrap();
    seq.append(0, &k[200 * 2 * D..], &v[200 * 2 * D..]).unwrap();
    // What the cache holds: the rotated rows rounded to fp16, un-rotated for the comparison.
    let stored = |x: &[f32]| {
        let mut r = x.to_vec();
        rotate_heads(&mut r, D).unwrap();
        let mut r: Vec<f32> = r.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
        rotate_heads(&mut r, D).unwrap();
        r
    };
    let (ks, vs) = (stored(&k), stored(&v));
    for n in [1usize, 7, 300] {
        let q = rng.gaussians(n * 4 * D);
        let got = attend(&seq, 0, &q, None).unwrap();
        let want = reference(&ks, &vs, &q, 300, 4, 2);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}

/// The reference seal rule, restated: at the start of each ubatch `[pos0, pos0 + n)`, once the
/// unsealed span `pos0 - B` has reached `max_tail`, seal every complete group older than the
/// newest `min_tail` positions.
fn expected_b(cfg: &CacheConfig, b: usize, pos0: usize) -> usize {
    if pos0 > b && pos0 - b >= cfg.max_tail && pos0 > SINK + cfg.min_tail {
        b.max(SINK + (pos0 - cfg.min_tail - SINK) / 128 * 128)
    } else {
        b
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn regions_follow_the_seal_rule(sizes in proptest::collection::vec(1usize..=512, 1..12)) {
        let cfg = small_config(Staging::Tq6, LayerCoding::scalar(2, 2));
        let mut seq = new_seq(cfg.clone());
        let mut rng = SplitMix64::new(3);
        let (mut len, mut b) = (0usize, SINK);
        for n in sizes {
            let n = n.min(cfg.max_tokens - len);
            if n == 0 { break; }
            let (k, v) = (kv(&mut rng, n, 2), kv(&mut rng, n, 2));
            seq.append(0, &k, &v).unwrap();
            // an append longer than max_chunk runs as several ubatches
            let mut at = len;
            while at < len + n {
                b = expected_b(&cfg, b, at);
                at += cfg.max_chunk.min(len + n - at);
            }
            len += n;
            prop_assert_eq!(SINK + 128 * seq.sealed_groups(0).unwrap(), b);
            let [sink, body, ring] = seq.regions(0).unwrap();
            prop_assert_eq!(sink.len() + body.len() + ring.len(), len);
            prop_assert!(ring.len() < cfg.max_tail + cfg.max_chunk);
        }
    }
}

#[test]
fn schedules_differ_but_records_and_idle_flush_agree() {
    // The seal points depend on the ubatch schedule (they are decided at ubatch starts), but a
    // record is a function of its own 128 rows: after an idle flush, token-by-token decoding and
    // chunked prefill hold the same bytes.
    for coding in [LayerCoding::scalar(3, 2), trellis(3, 2)] {
        let cfg = small_config(Staging::Tq6, coding);
        let total = 1100; // several seals at max_tail 384
        let mut rng = SplitMix64::new(7);
        let (k, v) = (kv(&mut rng, total, 2), kv(&mut rng, total, 2));
        let row = |x: &[f32], a: usize, b: usize, w: usize| x[a * w..b * w].to_vec();
        let mut one = new_seq(cfg.clone());
        let mut chunked = new_seq(cfg.clone());
        for layer in 0..2 {
            for t in 0..total {
                one.append(layer, &row(&k, t, t + 1, 2 * D), &row(&v, t, t + 1, 2 * D))
                    .unwrap();
            }
            let mut t = 0;
            while t < total {
                let take = (total - t).min(77);
                chunked
                    .append(
                        layer,
                        &row(&k, t, t + take, 2 * D),
                        &row(&v, t, t + take, 2 * D),
                    )
                    .unwrap();
                t += take;
            }
        }
        assert!(one.sealed_groups(1).unwrap() >= 4);
        one.seal_idle(0).unwrap();
        chunked.seal_idle(0).unwrap();
        assert_eq!(payload(&one), payload(&chunked), "{coding:?}");
        let q = rng.gaussians(4 * D);
        assert_eq!(
            attend(&one, 1, &q, None).unwrap(),
            attend(&chunked, 1, &q, None).unwrap()
        );
    }
}

/// Appends `k`/`v` (`[tokens][2][D]`) to both layers in the ubatches the journal allows.
fn append_all(seq: &mut Sequence, k: &[f32], v: &[f32]) {
    let w = 2 * D;
    for layer in 0..2 {
        let (mut t, n) = (0, k.len() / w);
        while t < n {
            let take = seq.chunk_limit(layer).unwrap().min(n - t);
            seq.append(layer, &k[t * w..(t + take) * w], &v[t * w..(t + take) * w])
                .unwrap();
            t += take;
        }
    }
}

/// A sequence fed `k`, cut at `cut`, fed again from where truncation asked and then `k2`, next
/// to one fed `k[..cut]` and `k2` only; both sealed idle. Returns them and the resume point.
fn cut_and_reappend(
    cfg: &CacheConfig,
    (k, v): (&[f32], &[f32]),
    (k2, v2): (&[f32], &[f32]),
    cut: usize,
) -> (Sequence, Sequence, usize) {
    let w = 2 * D;
    let mut a = new_seq(cfg.clone());
    append_all(&mut a, k, v);
    let back = a.truncate(cut).unwrap();
    append_all(&mut a, &k[back * w..cut * w], &v[back * w..cut * w]);
    append_all(&mut a, k2, v2);
    let mut b = new_seq(cfg.clone());
    append_all(&mut b, &k[..cut * w], &v[..cut * w]);
    append_all(&mut b, k2, v2);
    a.seal_idle(0).unwrap();
    b.seal_idle(0).unwrap();
    (a, b, back)
}

#[test]
fn truncate_then_reappend_equals_never_appending() {
    let cfg = small_config(Staging::Tq6, LayerCoding::scalar(4, 4));
    let mut rng = SplitMix64::new(11);
    let (k, v) = (kv(&mut rng, 900, 2), kv(&mut rng, 900, 2));
    let (k2, v2) = (kv(&mut rng, 400, 2), kv(&mut rng, 400, 2));
    let w = 2 * D;
    let mut full = new_seq(cfg.clone());
    append_all(&mut full, &k, &v);
    let b_end = SINK + 128 * full.sealed_groups(0).unwrap();
    for cut in [850usize, 600, 300, 100] {
        // re-append what truncation asked for, then the rejected continuation is gone
        let (a, b, back) = cut_and_reappend(&cfg, (&k, &v), (&k2, &v2), cut);
        let floor = if cut >= b_end || cut <= SINK {
            cut
        } else {
            SINK + (cut - SINK) / 128 * 128
        };
        assert_eq!(back, floor, "cut at {cut} (sealed end {b_end})");
        assert_eq!(payload(&a), payload(&b), "cut at {cut}");
    }
    // rejecting the last tokens (in the ring) is free and exact
    let mut s = new_seq(cfg.clone());
    append_all(&mut s, &k[..700 * w], &v[..700 * w]);
    let sealed = s.sealed_groups(0).unwrap();
    assert!(SINK + 128 * sealed <= 697);
    assert_eq!(s.truncate(697).unwrap(), 697);
    assert_eq!(s.sealed_groups(0).unwrap(), sealed);
}

#[test]
fn snapshots_round_trip_and_refuse_damage() {
    let cfg = small_config(Staging::Q8_0, trellis(3, 3));
    let mut seq = new_seq(cfg.clone());
    let mut rng = SplitMix64::new(5);
    for layer in 0..2 {
        let mut t = 0;
        while t < 700 {
            let take = seq.chunk_limit(layer).unwrap().min(700 - t);
            seq.append(layer, &kv(&mut rng, take, 2), &kv(&mut rng, take, 2))
                .unwrap();
            t += take;
        }
    }
    let dir = std::env::temp_dir().join(format!("sjkvarn-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("seq.sjkv");
    seq.save(&path).unwrap();
    let loaded = Sequence::load(&path, None, Some(&cfg)).unwrap();
    assert!(loaded.snapshot_bytes().unwrap() == seq.snapshot_bytes().unwrap());
    assert_eq!(
        loaded.config(),
        &cfg,
        "a load restores the full configuration"
    );
    let q = rng.gaussians(3 * 4 * D);
    assert_eq!(
        attend(&seq, 1, &q, None).unwrap(),
        attend(&loaded, 1, &q, None).unwrap()
    );

    let bytes = std::fs::read(&path).unwrap();
    for at in [0usize, 9, 30, bytes.len() / 2, bytes.len() - 1] {
        let mut bad = bytes.clone();
        bad[at] ^= 0x20;
        assert!(
            matches!(
                Sequence::from_snapshot(&bad, None, None),
                Err(CacheError::Snapshot(_))
            ),
            "flip at {at}"
        );
    }
    for cut in [0usize, 10, 100, bytes.len() - 1] {
        assert!(matches!(
            Sequence::from_snapshot(&bytes[..cut], None, None),
            Err(CacheError::Snapshot(_))
        ));
    }
    let mut other = cfg.clone();
    other.max_tokens = 4096;
    assert!(matches!(
        Sequence::from_snapshot(&bytes, None, Some(&other)),
        Err(CacheError::Snapshot(_))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pool_exhaustion_during_a_seal_loses_nothing() {
    let cfg = small_config(Staging::Tq6, LayerCoding::scalar(4, 4));
    let pool = sjkvarn::backend::RecordPool::new(cfg.slot_bytes(), 2);
    let mut seq = Sequence::new(Arc::new(cfg.clone()), pool).unwrap();
    let mut rng = SplitMix64::new(9);
    let mut len = 0;
    let q = rng.gaussians(4 * D);
    loop {
        let take = seq.chunk_limit(0).unwrap().min(50);
        let (k, v) = (kv(&mut rng, take, 2), kv(&mut rng, take, 2));
        let before = images(&seq);
        let out_before = attend(&seq, 0, &q, None).ok();
        match seq.append(0, &k, &v) {
            Ok(()) => len += take,
            Err(CacheError::PoolExhausted { .. }) => {
                assert!(images(&seq) == before, "failed append changed the cache");
                assert_eq!(seq.len(0).unwrap(), len);
                assert_eq!(attend(&seq, 0, &q, None).ok(), out_before);
                break;
            }
            Err(e) => panic!("{e}"),
        }
        assert!(len < 2000, "pool never ran out");
    }
    assert!(matches!(
        seq.seal_idle(0),
        Ok(()) | Err(CacheError::PoolExhausted { .. })
    ));
}

#[test]
fn bad_input_is_refused_without_change() {
    let cfg = small_config(Staging::Tq6, LayerCoding::scalar(4, 4));
    let mut seq = new_seq(cfg.clone());
    let mut rng = SplitMix64::new(2);
    seq.append(0, &kv(&mut rng, 10, 2), &kv(&mut rng, 10, 2))
        .unwrap();
    let before = images(&seq);
    let mut bad = kv(&mut rng, 3, 2);
    bad[5] = f32::NAN;
    assert!(seq.append(0, &bad, &kv(&mut rng, 3, 2)).is_err());
    assert!(seq
        .append(0, &kv(&mut rng, 3, 2)[1..], &kv(&mut rng, 3, 2)[1..])
        .is_err());
    assert!(matches!(
        seq.append(5, &kv(&mut rng, 1, 2), &kv(&mut rng, 1, 2)),
        Err(CacheError::LayerOutOfRange { .. })
    ));
    let mut big = kv(&mut rng, 1, 2);
    big[0] = 1e6; // not representable in the fp16 sink
    assert!(seq.append(0, &big, &kv(&mut rng, 1, 2)).is_err());
    assert!(attend(&seq, 0, &rng.gaussians(11 * 4 * D), None).is_err()); // more queries than tokens
    assert!(images(&seq) == before);
    let mut bad_cfg = cfg.clone();
    bad_cfg.q_heads = 3;
    assert!(matches!(
        bad_cfg.validate(),
        Err(CacheError::InvalidConfig(_))
    ));
    bad_cfg = cfg;
    bad_cfg.max_tail = 100; // below min_tail (and not 0, the fixed tail)
    assert!(bad_cfg.validate().is_err());
}

#[test]
fn many_sequences_from_threads_with_forks_and_truncates() {
    let cfg = Arc::new(small_config(Staging::Tq6, LayerCoding::scalar(3, 3)));
    let pool = Sequence::pool_for(&cfg, 16);
    let run = |seed: u64,
               pool: Arc<sjkvarn::backend::RecordPool>|
     -> (Vec<LayerImage>, Vec<LayerImage>) {
        let mut rng = SplitMix64::new(seed);
        let mut seq = Sequence::new(cfg.clone(), pool).unwrap();
        let mut t = 0;
        while t < 600 {
            let take = seq.chunk_limit(0).unwrap().min(600 - t).min(40);
            seq.append(0, &kv(&mut rng, take, 2), &kv(&mut rng, take, 2))
                .unwrap();
            t += take;
        }
        let mut child = seq.fork();
        let back = child.truncate(450).unwrap();
        let mut t = back;
        while t < 650 {
            let take = child.chunk_limit(0).unwrap().min(650 - t).min(40);
            child
                .append(0, &kv(&mut rng, take, 2), &kv(&mut rng, take, 2))
                .unwrap();
            t += take;
        }
        (images(&seq), images(&child))
    };
    let serial: Vec<_> = (0..6)
        .map(|s| run(s, Sequence::pool_for(&cfg, 4)))
        .collect();
    let parallel: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|s| {
                let pool = pool.clone();
                scope.spawn(move || run(s, pool))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(serial == parallel);
    assert_eq!(
        pool.stats().used,
        0,
        "every slot is released when the sequences drop"
    );
}

#[test]
fn fork_shares_sealed_records() {
    let cfg = small_config(Staging::Tq6, LayerCoding::scalar(4, 4));
    let mut seq = new_seq(cfg);
    let mut rng = SplitMix64::new(4);
    let mut t = 0;
    while t < 800 {
        let take = seq.chunk_limit(0).unwrap().min(800 - t);
        seq.append(0, &kv(&mut rng, take, 2), &kv(&mut rng, take, 2))
            .unwrap();
        t += take;
    }
    let used = seq.pool().stats().used;
    assert!(used > 0);
    let child = seq.fork();
    assert_eq!(seq.pool().stats().used, used, "a fork copies no records");
    let q = rng.gaussians(4 * D);
    assert_eq!(
        attend(&seq, 0, &q, None).unwrap(),
        attend(&child, 0, &q, None).unwrap()
    );
    drop(seq);
    assert_eq!(
        child.pool().stats().used,
        used,
        "records stay while the child holds them"
    );
    let m = child.memory();
    assert_eq!(m.sink_tokens + m.sealed_tokens + m.ring_tokens, 800);
    assert!(m.effective_bits > 4.0 && m.effective_bits < 16.0);
}

#[test]
fn layer_images_rebuild_the_same_sequence() {
    // The bytes a device backend copies in and out: a sequence rebuilt from its layer images
    // has the same snapshot, and a mismatched image is refused.
    let mut config = CacheConfig::uniform(2, 4, 2, 64, LayerCoding::scalar(3, 2), 4096);
    config.min_tail = 256;
    config.max_tail = 512;
    config.max_chunk = 128;
    let config = Arc::new(config);
    let mut seq = Sequence::new(config.clone(), Sequence::pool_for(&config, 1)).unwrap();
    let mut rng = sjkvarn::rng::SplitMix64::new(5);
    for n in [300usize, 450, 7] {
        for layer in 0..2 {
            let k = rng.gaussians(n * 2 * 64);
            let v = rng.gaussians(n * 2 * 64);
            seq.append(layer, &k, &v).unwrap();
        }
    }
    let images: Vec<_> = (0..2).map(|l| seq.layer_image(l).unwrap()).collect();
    assert!(images[0].sealed > 0);
    let back =
        Sequence::from_images(config.clone(), Sequence::pool_for(&config, 1), &images).unwrap();
    assert_eq!(
        back.snapshot_bytes().unwrap(),
        seq.snapshot_bytes().unwrap()
    );
    let mut bad = images.clone();
    bad[1].sealed += 10;
    assert!(Sequence::from_images(config.clone(), Sequence::pool_for(&config, 1), &bad).is_err());
    let mut bad = images.clone();
    bad[0].ring.pop();
    assert!(Sequence::from_images(config.clone(), Sequence::pool_for(&config, 1), &bad).is_err());
}

#[test]
fn configurations_too_large_for_the_machine_are_errors_not_aborts() {
    let mut config =
        CacheConfig::uniform(4096, 1024, 1024, 512, LayerCoding::scalar(4, 4), 1 << 24);
    config.max_tail = 4_000_000;
    config.max_chunk = 65_536;
    let config = Arc::new(config);
    config.validate().unwrap();
    let pool = Sequence::pool_for(&config, 4);
    assert!(matches!(
        Sequence::new(config, pool),
        Err(CacheError::OutOfMemory { .. })
    ));
}

#[test]
fn the_sink_length_is_configurable_as_the_reference_allows() {
    for sink in [64usize, 256] {
        let mut cfg = small_config(Staging::Tq6, LayerCoding::scalar(4, 4));
        cfg.sink = sink;
        let mut seq = new_seq(cfg.clone());
        let mut rng = SplitMix64::new(21);
        for layer in 0..2 {
            seq.append(layer, &kv(&mut rng, 900, 2), &kv(&mut rng, 900, 2))
                .unwrap();
        }
        let [s, body, ring] = seq.regions(0).unwrap();
        assert_eq!(s, 0..sink);
        assert_eq!(body.start, sink);
        assert_eq!((body.end - sink) % 128, 0);
        assert!(body.end > sink && ring.end == 900);
        // a cut in the body resumes at the group floor counted from the sink
        let cut = body.end - 5;
        let mut child = seq.fork();
        assert_eq!(child.truncate(cut).unwrap(), body.end - 128);
        // the state stream carries the sink and restores it
        let stream = seq.state_bytes().unwrap();
        assert_eq!(
            u32::from_le_bytes(stream[32..36].try_into().unwrap()),
            sink as u32
        );
        let back = Sequence::from_state(Arc::new(cfg.clone()), None, &stream).unwrap();
        assert_eq!(back.state_bytes().unwrap(), stream);
        let q = rng.gaussians(4 * D);
        assert_eq!(
            attend(&seq, 1, &q, None).unwrap(),
            attend(&back, 1, &q, None).unwrap()
        );
        // a stream of another sink length is refused by name
        let mut other = cfg.clone();
        other.sink = 128;
        assert!(matches!(
            Sequence::from_state(Arc::new(other), None, &stream),
            Err(CacheError::State(sjkvarn::journal::StateError::Sink { .. }))
        ));
    }
    let mut bad = small_config(Staging::Tq6, LayerCoding::scalar(4, 4));
    for sink in [0usize, 100] {
        bad.sink = sink;
        assert!(bad.validate().is_err());
    }
}

/// Attention of `rows` random query rows (4 heads, 2 KV heads) over layer 0 of `seq`, against
/// the f64 reference over `k` and `v`: `|got - want| / |want|` over the whole output, and the
/// kernel bound's measure, the largest over heads of `max |got - want| / max |want|`.
fn error_against_reference(
    seq: &Sequence,
    k: &[f32],
    v: &[f32],
    rows: usize,
    rng: &mut SplitMix64,
) -> (f32, f32) {
    let (qh, kvh) = (4, 2);
    let q: Vec<f32> = rng
        .gaussians(rows * qh * D)
        .iter()
        .map(|x| 3.0 * x)
        .collect();
    let got = attend(seq, 0, &q, None).unwrap();
    let want = reference(k, v, &q, seq.len(0).unwrap(), qh, kvh);
    let norm = want.iter().map(|x| x * x).sum::<f32>().sqrt();
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f32>();
    let by_head = (0..qh)
        .map(|h| {
            let (mut diff, mut top) = (0f32, 0f32);
            for r in 0..rows {
                let at = (r * qh + h) * D;
                for (a, b) in got[at..at + D].iter().zip(&want[at..at + D]) {
                    diff = diff.max((a - b).abs());
                    top = top.max(b.abs());
                }
            }
            diff / top
        })
        .fold(0f32, f32::max);
    (err.sqrt() / norm, by_head)
}

/// What the exact regions hold of `x`: the rotated rows rounded to fp16, back in the model
/// frame.
fn stored_rows(x: &[f32]) -> Vec<f32> {
    let mut r = x.to_vec();
    rotate_heads(&mut r, D).unwrap();
    let mut r: Vec<f32> = r.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
    rotate_heads(&mut r, D).unwrap();
    r
}

/// Attention over sealed records equals attention over the rows those records decode to (f64
/// reference), for scalar and trellis bodies: within the kernel's bound, 1e-3 of each head's
/// largest output entry, and within 3e-4 of the output's norm (operands rounded to 16-bit
/// fixed point for exact integer sums, trellis values summed in f32: 1.3-1.8e-4 of the norm,
/// at most 3.3e-4 of a head's largest entry here; float units about 1e-6).
#[test]
fn sealed_records_attend_as_their_decoded_rows() {
    for coding in [
        LayerCoding::scalar(4, 4),
        LayerCoding::scalar(4, 2),
        trellis(3, 2),
    ] {
        let cfg = small_config(Staging::F16, coding);
        let codec = cfg.body_codec(0).unwrap();
        let (rb, kvh) = (codec.record_bytes(), 2);
        let mut seq = new_seq(cfg);
        let mut rng = SplitMix64::new(21);
        let n = 1000;
        let (k, v) = (kv(&mut rng, n, kvh), kv(&mut rng, n, kvh));
        for (a, b) in [(0, 300), (300, 700), (700, n)] {
            let (ks, vs) = (&k[a * kvh * D..b * kvh * D], &v[a * kvh * D..b * kvh * D]);
            seq.append(0, ks, vs).unwrap();
        }
        let image = seq.layer_image(0).unwrap();
        assert!(image.sealed >= 4, "{} groups sealed", image.sealed);
        let (mut kd, mut vd) = (stored_rows(&k), stored_rows(&v));
        let slot = image.records.len() / image.sealed;
        for g in 0..image.sealed {
            for h in 0..kvh {
                let rec = &image.records[g * slot + h * rb..g * slot + (h + 1) * rb];
                let (rk, rv) = codec.decode_model_frame(rec).unwrap();
                for t in 0..128 {
                    let at = ((SINK + 128 * g + t) * kvh + h) * D;
                    kd[at..at + D].copy_from_slice(&rk[t * D..(t + 1) * D]);
                    vd[at..at + D].copy_from_slice(&rv[t * D..(t + 1) * D]);
                }
            }
        }
        for rows in [1usize, 9, 40, 600] {
            let (err, by_head) = error_against_reference(&seq, &kd, &vd, rows, &mut rng);
            eprintln!("{coding:?}, {rows} rows: {err:.2e} of the norm, {by_head:.2e} by head");
            assert!(
                by_head <= 1e-3,
                "{coding:?}: {by_head:.2e} of a head's largest entry"
            );
            assert!(err <= 3e-4, "{coding:?}: error {err:.2e} of the norm");
        }
    }
}

/// Attention over a `tq6_0` ring equals attention over the rows the ring decodes to (f64
/// reference): keys are scored from their 6-bit codes in fixed point, which costs at most 3e-4
/// of the output's size (about 1e-5 here); values are decoded as the format defines.
#[test]
fn tq6_ring_rows_attend_as_their_decoded_rows() {
    let mut cfg = small_config(Staging::Tq6, LayerCoding::scalar(4, 4));
    cfg.max_tail = 4096; // never seals: sink + ring only
    let (kvh, n) = (2, 700);
    let mut seq = new_seq(cfg);
    let mut rng = SplitMix64::new(22);
    let (k, v) = (kv(&mut rng, n, kvh), kv(&mut rng, n, kvh));
    for (a, b) in [(0, 250), (250, n)] {
        let (ks, vs) = (&k[a * kvh * D..b * kvh * D], &v[a * kvh * D..b * kvh * D]);
        seq.append(0, ks, vs).unwrap();
    }
    let image = seq.layer_image(0).unwrap();
    assert_eq!(image.sealed, 0);
    let row_bytes = sjkvarn::codec::tq6::row_bytes(D);
    let (mut kd, mut vd) = (stored_rows(&k), stored_rows(&v));
    for pos in SINK..n {
        for h in 0..kvh {
            let entry = ((pos - SINK) * kvh + h) * 2 * row_bytes;
            let at = (pos * kvh + h) * D;
            for (side, out) in [(0, &mut kd), (1, &mut vd)] {
                let bytes = &image.ring[entry + side * row_bytes..][..row_bytes];
                let row = &mut out[at..at + D];
                sjkvarn::codec::tq6::decode_row(bytes, row);
                rotate_heads(row, D).unwrap();
            }
        }
    }
    for rows in [1usize, 7, 40, 600] {
        let (err, _) = error_against_reference(&seq, &kd, &vd, rows, &mut rng);
        eprintln!("{rows} rows: error {err:.2e} of the norm");
        assert!(err <= 3e-4, "error {err:.2e} of the norm");
    }
}

#[test]
fn a_state_stream_with_bytes_after_its_end_is_refused() {
    let mut rng = SplitMix64::new(41);
    let cfg = small_config(Staging::Tq6, LayerCoding::scalar(4, 4));
    let mut seq = new_seq(cfg.clone());
    for layer in 0..2 {
        seq.append(layer, &kv(&mut rng, 500, 2), &kv(&mut rng, 500, 2))
            .unwrap();
    }
    let mut stream = seq.state_bytes().unwrap();
    assert!(Sequence::from_state(Arc::new(cfg.clone()), None, &stream).is_ok());
    stream.push(1);
    assert!(matches!(
        Sequence::from_state(Arc::new(cfg), None, &stream),
        Err(CacheError::State(sjkvarn::journal::StateError::Corrupt(_)))
    ));
}

#[test]
fn overflowing_scores_are_an_error_not_nan() {
    let mut rng = SplitMix64::new(43);
    let cfg = small_config(Staging::Tq6, LayerCoding::scalar(4, 4));
    let mut seq = new_seq(cfg);
    for layer in 0..2 {
        seq.append(layer, &kv(&mut rng, 700, 2), &kv(&mut rng, 700, 2))
            .unwrap();
    }
    let q = rng.gaussians(4 * D);
    // Large but in range: the result is finite.
    let big: Vec<f32> = q.iter().map(|x| x * 1e30).collect();
    assert!(attend(&seq, 0, &big, None)
        .unwrap()
        .iter()
        .all(|x| x.is_finite()));
    let huge: Vec<f32> = q.iter().map(|x| x * 3e37).collect();
    match attend(&seq, 0, &huge, None) {
        Err(CacheError::ScoreOverflow { scaled_query }) => assert!(scaled_query > 1e37),
        other => panic!("expected ScoreOverflow, got {other:?}"),
    }
    // The same through `scale`.
    assert!(matches!(
        attend(&seq, 0, &q, Some(1e38)),
        Err(CacheError::ScoreOverflow { .. })
    ));
}

#[test]
fn the_recommended_journal_is_the_default_and_the_reference_stays_reachable() {
    use sjkvarn::journal::{DEFAULT_JOURNAL, REFERENCE_JOURNAL};
    let coding = LayerCoding::scalar(4, 4);
    let rec = CacheConfig::recommended(2, 4, 2, 128, coding, 8192);
    let reference = CacheConfig::uniform(2, 4, 2, 128, coding, 8192);
    assert_eq!(
        (
            rec.min_tail,
            rec.max_tail,
            rec.k_staging,
            rec.v_staging,
            rec.centre_keys
        ),
        (2048, 3072, Staging::Q8_0, Staging::Q8_0, true)
    );
    assert!(!reference.centre_keys);
    assert_eq!(
        (
            reference.min_tail,
            reference.max_tail,
            reference.k_staging,
            reference.v_staging
        ),
        (4096, 8192, Staging::Tq6, Staging::Tq6)
    );
    assert_eq!(rec.clone().with_journal(REFERENCE_JOURNAL), reference);
    assert_eq!(reference.clone().with_journal(DEFAULT_JOURNAL), rec);
    assert!(reference.is_reference() && !rec.is_reference());
}

#[test]
fn the_recommended_journal_round_trips_and_truncates() {
    // Small tails of the same shape (q8_0 rows, centred keys), so seals happen in a short test.
    let mut rng = SplitMix64::new(47);
    let mut cfg = CacheConfig::recommended(2, 4, 2, D, LayerCoding::scalar(4, 4), 2048);
    (cfg.min_tail, cfg.max_tail, cfg.max_chunk) = (256, 384, 96);
    let (k, v) = (kv(&mut rng, 1500, 2), kv(&mut rng, 1500, 2));
    let mut seq = new_seq(cfg.clone());
    for layer in 0..2 {
        for at in (0..1500).step_by(96) {
            let n = 96.min(1500 - at);
            let r = at * 2 * D..(at + n) * 2 * D;
            seq.append(layer, &k[r.clone()], &v[r]).unwrap();
        }
    }
    assert!(seq.sealed_groups(0).unwrap() > 0);
    let q = rng.gaussians(4 * D);
    let stream = seq.state_bytes().unwrap();
    let back = Sequence::from_state(Arc::new(cfg.clone()), None, &stream).unwrap();
    assert_eq!(back.state_bytes().unwrap(), stream);
    assert_eq!(
        attend(&seq, 1, &q, None).unwrap(),
        attend(&back, 1, &q, None).unwrap()
    );
    let snap = seq.snapshot_bytes().unwrap();
    let restored = Sequence::from_snapshot(&snap, None, None).unwrap();
    assert_eq!(restored.config(), seq.config());
    assert_eq!(
        attend(&seq, 0, &q, None).unwrap(),
        attend(&restored, 0, &q, None).unwrap()
    );
    // Every truncated prefix of the stream is refused.
    for cut in [0, 100, stream.len() / 2, stream.len() - 1] {
        assert!(Sequence::from_state(Arc::new(cfg.clone()), None, &stream[..cut]).is_err());
    }
    // A cut in the body, then re-appending what the journal asks for, equals never appending; a
    // cut inside the sink clears the key offset and refilling the sink fixes the new one.
    let (k2, v2) = (kv(&mut rng, 400, 2), kv(&mut rng, 400, 2));
    for cut in [700, 100] {
        let (a, b, back) = cut_and_reappend(&cfg, (&k, &v), (&k2, &v2), cut);
        assert!(back <= cut && cut - back < 128);
        assert_eq!(payload(&a), payload(&b), "cut at {cut}");
        assert_eq!(
            attend(&a, 0, &q, None).unwrap(),
            attend(&b, 0, &q, None).unwrap()
        );
    }
}

/// Keys with a large offset shared by every position (as small models' keys have).
fn offset_keys(rng: &mut SplitMix64, tokens: usize, offset: f32) -> Vec<f32> {
    let shared: Vec<f32> = rng.gaussians(2 * D).iter().map(|x| offset * x).collect();
    let mut k = kv(rng, tokens, 2);
    for (i, x) in k.iter_mut().enumerate() {
        *x = half::f16::from_f32(*x + shared[i % (2 * D)]).to_f32();
    }
    k
}

#[test]
fn centred_keys_leave_exact_attention_unchanged() {
    // An fp16 ring that never seals: the only difference centring makes is where fp16 rounds.
    let mut rng = SplitMix64::new(53);
    let (k, v) = (offset_keys(&mut rng, 600, 4.0), kv(&mut rng, 600, 2));
    let mut cfg = small_config(Staging::F16, LayerCoding::scalar(4, 4));
    cfg.max_tail = 4096;
    cfg.centre_keys = true;
    let mut seq = new_seq(cfg);
    for at in (0..600).step_by(90) {
        let r = at * 2 * D..(at + 90).min(600) * 2 * D;
        seq.append(0, &k[r.clone()], &v[r]).unwrap();
    }
    let (err, _) = error_against_reference(&seq, &stored_rows(&k), &stored_rows(&v), 5, &mut rng);
    assert!(err < 2e-3, "centred fp16 cache errs {err}");
}

#[test]
fn centred_keys_cut_the_coded_key_error() {
    // A q8_0 ring over keys with a shared offset (its per-32 scale is set by the offset): the
    // same cache with and without centring, against exact attention.
    let mut rng = SplitMix64::new(59);
    let (k, v) = (offset_keys(&mut rng, 1400, 6.0), kv(&mut rng, 1400, 2));
    let mut errs = Vec::new();
    for centre in [false, true] {
        let mut cfg = small_config(Staging::Q8_0, LayerCoding::scalar(4, 4));
        cfg.centre_keys = centre;
        cfg.max_tail = 4096;
        let mut seq = new_seq(cfg);
        for at in (0..1400).step_by(96) {
            let r = at * 2 * D..(at + 96).min(1400) * 2 * D;
            seq.append(0, &k[r.clone()], &v[r]).unwrap();
        }
        let (err, _) = error_against_reference(&seq, &k, &v, 8, &mut SplitMix64::new(61));
        errs.push(err);
    }
    assert!(
        errs[1] < 0.5 * errs[0],
        "centred {} vs as appended {}",
        errs[1],
        errs[0]
    );
}

#[test]
fn centred_states_carry_their_rotation_id_and_old_snapshots_still_load() {
    use sjkvarn::backend::cpu::snapshot::ROTATION_CENTRED_KEYS;
    let mut rng = SplitMix64::new(67);
    let mut cfg = small_config(Staging::Q8_0, LayerCoding::scalar(4, 4));
    cfg.centre_keys = true;
    let (k, v) = (offset_keys(&mut rng, 700, 3.0), kv(&mut rng, 700, 2));
    let mut seq = new_seq(cfg.clone());
    for layer in 0..2 {
        for at in (0..700).step_by(96) {
            let r = at * 2 * D..(at + 96).min(700) * 2 * D;
            seq.append(layer, &k[r.clone()], &v[r]).unwrap();
        }
    }
    let stream = seq.state_bytes().unwrap();
    assert_eq!(
        u32::from_le_bytes(stream[72..76].try_into().unwrap()),
        ROTATION_CENTRED_KEYS
    );
    // A cache that stores keys as appended refuses the stream by its rotation id.
    let plain = CacheConfig {
        centre_keys: false,
        ..cfg.clone()
    };
    let e = Sequence::from_state(Arc::new(plain.clone()), None, &stream).unwrap_err();
    assert!(e.to_string().contains("rotation"), "{e}");
    // A version-2 snapshot (no flags byte) of a plain cache still loads.
    let mut old = new_seq(plain.clone());
    old.append(0, &k[..300 * 2 * D], &v[..300 * 2 * D]).unwrap();
    old.append(1, &k[..300 * 2 * D], &v[..300 * 2 * D]).unwrap();
    let v4 = old.snapshot_bytes().unwrap();
    // configuration block: 4 u32, 5 u64, sink type u8, sink u64, then the flags byte (version
    // 3 on), `exact_recent: u32` (version 4 on) and the staging byte (numbered `tq6_0` 0,
    // `q8_0` 1, `f16` 2 before version 5)
    let flags_at = 20 + 4 * 4 + 5 * 8 + 1 + 8;
    assert_eq!(v4[flags_at], 0);
    assert_eq!(v4[flags_at + 5], plain.k_staging.code());
    let legacy = [Staging::Tq6, Staging::Q8_0, Staging::F16]
        .iter()
        .position(|&s| s == plain.k_staging)
        .unwrap() as u8;
    let q = rng.gaussians(4 * D);
    for (version, cut) in [
        (2u32, flags_at..flags_at + 5),
        (3, flags_at + 1..flags_at + 5),
        (4, flags_at + 5..flags_at + 5),
    ] {
        let mut old_file = v4[..cut.start].to_vec();
        old_file.extend_from_slice(&v4[cut.end..v4.len() - 8]);
        old_file[cut.start] = legacy;
        old_file[8..12].copy_from_slice(&version.to_le_bytes());
        let payload_len = (old_file.len() - 20) as u64;
        old_file[12..20].copy_from_slice(&payload_len.to_le_bytes());
        let sum = sjkvarn::backend::cpu::snapshot::fnv1a64(&old_file);
        old_file.extend_from_slice(&sum.to_le_bytes());
        let back = Sequence::from_snapshot(&old_file, None, None).unwrap();
        assert_eq!(back.config(), &plain, "version {version}");
        assert_eq!(
            attend(&back, 1, &q, None).unwrap(),
            attend(&old, 1, &q, None).unwrap()
        );
    }
    // An unknown flag is refused.
    let mut bad = v4.clone();
    bad[flags_at] = 2;
    let n = bad.len();
    let sum = sjkvarn::backend::cpu::snapshot::fnv1a64(&bad[..n - 8]);
    bad[n - 8..].copy_from_slice(&sum.to_le_bytes());
    assert!(Sequence::from_snapshot(&bad, None, None).is_err());
}
