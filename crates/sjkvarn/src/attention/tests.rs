use super::driver::{attend_at, thread_limit, CHUNK, PARALLEL_MIN_WORK};
use super::*;
use crate::backend::Journal;
use crate::codec::extension::body::{BodyCoding, TrellisAxis};
use crate::error::CacheError;
use crate::journal::{CacheConfig, LayerCoding};
use crate::rng::SplitMix64;
use crate::simd::detected_level;
use crate::simd::SimdLevel;
use crate::Sequence;
use std::sync::Arc;

/// One layer of `q_heads` over `kv_heads` of `d` under `coding`, a 256/512 tail, filled
/// with `tokens` Gaussian positions in the journal's own ubatches.
fn filled(
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    coding: LayerCoding,
    tokens: usize,
    rng: &mut SplitMix64,
) -> Sequence {
    let mut c = CacheConfig::uniform(1, q_heads, kv_heads, d, coding, tokens + 1000);
    (c.min_tail, c.max_tail) = (256, 512);
    let cfg = Arc::new(c);
    let mut seq = Sequence::new(cfg.clone(), Sequence::pool_for(&cfg, 1)).unwrap();
    let per_pos = kv_heads * d;
    while seq.len(0).unwrap() < tokens {
        let n = seq
            .chunk_limit(0)
            .unwrap()
            .min(tokens - seq.len(0).unwrap());
        seq.append(0, &rng.gaussians(n * per_pos), &rng.gaussians(n * per_pos))
            .unwrap();
    }
    seq
}

/// 3-bit keys and 2-bit values, both trellis-coded along tokens.
fn trellis_3_2() -> LayerCoding {
    LayerCoding {
        k_coding: BodyCoding::Trellis(TrellisAxis::Token),
        v_coding: BodyCoding::Trellis(TrellisAxis::Token),
        ..LayerCoding::scalar(3, 2)
    }
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Every instruction-set level this CPU has gives the same bits, for decode and prefill
/// rows, over sink, scalar or trellis records and the ring.
#[test]
fn every_simd_level_gives_the_same_bits() {
    let levels: Vec<SimdLevel> = [SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512]
        .into_iter()
        .filter(|&l| l <= detected_level())
        .collect();
    eprintln!("levels compared: {levels:?}");
    let trellis = trellis_3_2();
    for coding in [LayerCoding::scalar(4, 4), trellis] {
        let mut rng = SplitMix64::new(5);
        let seq = filled(8, 2, 128, coding, 5000, &mut rng);
        assert!(seq.memory().sealed_tokens > 2 * CHUNK);
        for rows in [1usize, 37] {
            let q = rng.gaussians(rows * 8 * 128);
            let want = attend_at(SimdLevel::Portable, &seq, 0, &q, None, None).unwrap();
            for &level in &levels {
                let got = attend_at(level, &seq, 0, &q, None, None).unwrap();
                assert!(same_bits(&want, &got), "{level:?}, {rows} rows");
            }
        }
    }
}

/// A thread's kept workspace serves later calls as a fresh one would: calls on two caches
/// of different geometry and body, interleaved on one thread (so each finds the other's
/// workspace, or its own), give the bits of the first call on each.
#[test]
fn kept_workspaces_give_the_same_bits() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let trellis = trellis_3_2();
    let mut rng = SplitMix64::new(17);
    let mut cases = Vec::new();
    for (d, coding) in [(128, LayerCoding::scalar(4, 4)), (64, trellis)] {
        let seq = filled(4, 2, d, coding, 2500, &mut rng);
        assert!(seq.memory().sealed_tokens > 0);
        let q = rng.gaussians(3 * 4 * d);
        cases.push((seq, q));
    }
    pool.install(|| {
        let first: Vec<Vec<f32>> = cases
            .iter()
            .map(|(seq, q)| attend(seq, 0, q, None).unwrap())
            .collect();
        for round in 0..3 {
            for ((seq, q), want) in cases.iter().zip(&first).rev() {
                let got = attend(seq, 0, q, None).unwrap();
                assert!(same_bits(want, &got), "round {round}");
            }
        }
    });
}

/// Prefill items that share decoded key tiles give the bits of items that each decode
/// their own, for scalar and trellis records, the sink and the ring.
#[test]
fn shared_prefill_tiles_give_the_same_bits() {
    use std::sync::atomic::Ordering;
    let trellis = trellis_3_2();
    for coding in [LayerCoding::scalar(4, 4), trellis] {
        let mut rng = SplitMix64::new(29);
        let seq = filled(6, 3, 64, coding, 5000, &mut rng);
        assert!(seq.memory().sealed_tokens > 0);
        // Three items per KV head, on two threads.
        let q = rng.gaussians(2100 * 6 * 64);
        let shared = attend_with_threads(&seq, 0, &q, None, Some(2)).unwrap();
        prefill::SHARE_TILES.store(false, Ordering::Relaxed);
        let own = attend_with_threads(&seq, 0, &q, None, Some(2));
        prefill::SHARE_TILES.store(true, Ordering::Relaxed);
        assert!(same_bits(&shared, &own.unwrap()));
    }
}

/// Calls below the work threshold run on the caller alone, whatever the limit.
#[test]
fn small_calls_run_on_the_caller_alone() {
    assert_eq!(thread_limit(PARALLEL_MIN_WORK - 1, None), Some(1));
    assert_eq!(thread_limit(PARALLEL_MIN_WORK - 1, Some(2)), Some(1));
    assert_eq!(thread_limit(PARALLEL_MIN_WORK, None), None);
    assert_eq!(thread_limit(PARALLEL_MIN_WORK, Some(2)), Some(2));
    // SmolLM2's geometry (9 query heads of 64): one decode row over 2,048 positions is
    // small, over 3,072 it is not.
    assert_eq!(thread_limit(2048 * 9 * 64, None), Some(1));
    assert_eq!(thread_limit(3072 * 9 * 64, None), None);
}

/// Any thread limit gives the bits of the unlimited call, and a limit of zero is refused.
#[test]
fn every_thread_limit_gives_the_same_bits() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let mut rng = SplitMix64::new(23);
    let seq = filled(6, 3, 64, LayerCoding::scalar(4, 4), 5000, &mut rng);
    // Decode calls, and prefill chunks of one and of several work items.
    for rows in [1usize, 9, 40, 2100] {
        let q = rng.gaussians(rows * 6 * 64);
        let want = attend(&seq, 0, &q, None).unwrap();
        for threads in [1, 2, 3, 5] {
            // From inside the pool and from the calling thread outside it.
            let inside = pool
                .install(|| attend_with_threads(&seq, 0, &q, None, Some(threads)))
                .unwrap();
            let outside = attend_with_threads(&seq, 0, &q, None, Some(threads)).unwrap();
            for got in [inside, outside] {
                assert!(same_bits(&want, &got), "{threads} threads, {rows} rows");
            }
        }
    }
    let q = rng.gaussians(6 * 64);
    assert!(matches!(
        attend_with_threads(&seq, 0, &q, None, Some(0)),
        Err(CacheError::Codec(crate::CodecError::InvalidSetting(_)))
    ));
}
