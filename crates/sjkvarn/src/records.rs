//! Many body records at once: one record per (K tile, V tile) pair, tiles in parallel.
//!
//! Each tile is balanced and rounded on its own with sequential reductions, so the bytes do not
//! depend on the thread count.

use crate::balance::BalanceConfig;
use crate::body::{BodySpec, GROUP};
use crate::error::{check_finite, CodecError, Result};
use crate::format::with_threads;
use rayon::prelude::*;

fn tile_count(spec: &BodySpec, what: &'static str, len: usize) -> Result<usize> {
    let tile = GROUP * spec.head_dim;
    if len == 0 || len % tile != 0 {
        return Err(CodecError::NotBlockMultiple {
            what,
            len,
            block: tile,
        });
    }
    Ok(len / tile)
}

/// Encodes `k` and `v` (each `[n][G][head_dim]`, model frame unless `rotated`) into `n` records.
pub fn encode_records(
    spec: &BodySpec,
    config: &BalanceConfig,
    k: &[f32],
    v: &[f32],
    rotated: bool,
    threads: Option<usize>,
) -> Result<Vec<u8>> {
    let n = tile_count(spec, "K tiles", k.len())?;
    if v.len() != k.len() {
        return Err(CodecError::LengthMismatch {
            what: "V tiles",
            expected: k.len(),
            got: v.len(),
        });
    }
    check_finite(k)?;
    check_finite(v).map_err(|e| match e {
        CodecError::NonFinite { index } => CodecError::NonFinite {
            index: k.len() + index,
        },
        other => other,
    })?;
    config.validate()?;
    let tile = GROUP * spec.head_dim;
    let rb = spec.record_bytes();
    let mut out = vec![0u8; n * rb];
    with_threads(threads, || {
        out.par_chunks_mut(rb)
            .zip(k.par_chunks(tile).zip(v.par_chunks(tile)))
            .try_for_each(|(rec, (kt, vt))| {
                if rotated {
                    spec.encode_rotated(kt, vt, config, rec)
                } else {
                    spec.encode(kt, vt, config, rec)
                }
            })
    })??;
    Ok(out)
}

/// Decodes `n` records into `k` and `v` (each `[n][G][head_dim]`).
pub fn decode_records(
    spec: &BodySpec,
    records: &[u8],
    k: &mut [f32],
    v: &mut [f32],
    rotated: bool,
    threads: Option<usize>,
) -> Result<()> {
    let n = tile_count(spec, "K output", k.len())?;
    if v.len() != k.len() {
        return Err(CodecError::LengthMismatch {
            what: "V output",
            expected: k.len(),
            got: v.len(),
        });
    }
    let rb = spec.record_bytes();
    if records.len() != n * rb {
        return Err(CodecError::LengthMismatch {
            what: "record bytes",
            expected: n * rb,
            got: records.len(),
        });
    }
    let tile = GROUP * spec.head_dim;
    with_threads(threads, || {
        records
            .par_chunks(rb)
            .zip(k.par_chunks_mut(tile).zip(v.par_chunks_mut(tile)))
            .try_for_each(|(rec, (kt, vt))| {
                if rotated {
                    spec.decode_rotated(rec, kt, vt)
                } else {
                    spec.decode(rec, kt, vt)
                }
            })
    })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::{BalanceMode, BalanceStat};

    fn tiles(n: usize, d: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n * GROUP * d)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                if i % d == 3 {
                    u * 40.0 // an outlier channel
                } else {
                    u
                }
            })
            .collect()
    }

    #[test]
    fn bytes_do_not_depend_on_thread_count() {
        let (k, v) = (tiles(5, 128, 1), tiles(5, 128, 2));
        for mode in [BalanceMode::Final, BalanceMode::Best] {
            for stat in [BalanceStat::Std, BalanceStat::Rms] {
                let cfg = BalanceConfig {
                    passes: 12,
                    mode,
                    stat,
                };
                let spec = BodySpec::new(128, 3, 2).unwrap();
                let one = encode_records(&spec, &cfg, &k, &v, false, Some(1)).unwrap();
                let two = encode_records(&spec, &cfg, &k, &v, false, Some(2)).unwrap();
                let again = encode_records(&spec, &cfg, &k, &v, false, Some(2)).unwrap();
                assert_eq!(one, two);
                assert_eq!(two, again);
            }
        }
    }

    #[test]
    fn round_trip_and_errors() {
        let spec = BodySpec::new(512, 4, 4).unwrap();
        let (k, v) = (tiles(2, 512, 3), tiles(2, 512, 4));
        let cfg = BalanceConfig::default();
        let recs = encode_records(&spec, &cfg, &k, &v, false, None).unwrap();
        assert_eq!(recs.len(), 2 * spec.record_bytes());
        let (mut kk, mut vv) = (vec![0.0; k.len()], vec![0.0; v.len()]);
        decode_records(&spec, &recs, &mut kk, &mut vv, false, None).unwrap();
        let rel = |a: &[f32], b: &[f32]| {
            let e: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            e / a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>()
        };
        assert!(rel(&k, &kk) < 0.02 && rel(&v, &vv) < 0.02);
        assert!(encode_records(&spec, &cfg, &k, &v[1..], false, None).is_err());
        assert!(encode_records(&spec, &cfg, &k[1..], &v[1..], false, None).is_err());
        assert!(decode_records(&spec, &recs[1..], &mut kk, &mut vv, false, None).is_err());
        let mut bad = v.clone();
        bad[10] = f32::INFINITY;
        assert_eq!(
            encode_records(&spec, &cfg, &k, &bad, false, None),
            Err(CodecError::NonFinite {
                index: k.len() + 10
            })
        );
    }
}
