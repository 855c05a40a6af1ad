//! Many body records at once: one record per (K tile, V tile) pair, tiles in parallel, through
//! the layer codec ([`BodyCodec`]) the cache uses.
//!
//! The seal input is what the cache seals: the tile in the Hadamard frame, rounded to fp16 (a
//! model-frame tile is rotated first, head by head). Each tile is balanced and rounded on its
//! own with sequential reductions, so the bytes do not depend on the thread count.

use crate::codec::extension::body::GROUP;
use crate::codec::format::with_threads;
use crate::codec::fp16::f32_to_f16;
use crate::codec::rotation::rotate_heads;
use crate::codec::BodyCodec;
use crate::error::{check_finite, CodecError, Result};
use rayon::prelude::*;

fn tile_count(d: usize, what: &'static str, len: usize) -> Result<usize> {
    let tile = GROUP * d;
    if len == 0 || !len.is_multiple_of(tile) {
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
    codec: &BodyCodec,
    k: &[f32],
    v: &[f32],
    rotated: bool,
    threads: Option<usize>,
) -> Result<Vec<u8>> {
    let d = codec.head_dim();
    let n = tile_count(d, "K tiles", k.len())?;
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
    let tile = GROUP * d;
    let rb = codec.record_bytes();
    let mut out = vec![0u8; n * rb];
    let seal_input = |x: &[f32]| -> Result<Vec<u16>> {
        let mut r = x.to_vec();
        if !rotated {
            rotate_heads(&mut r, d)?;
        }
        r.iter()
            .map(|&x| {
                let h = f32_to_f16(x);
                if half::f16::from_bits(h).is_finite() {
                    Ok(h)
                } else {
                    Err(CodecError::ScaleOverflow {
                        what: "fp16 seal input",
                        value: x,
                    })
                }
            })
            .collect()
    };
    with_threads(threads, || {
        out.par_chunks_mut(rb)
            .zip(k.par_chunks(tile).zip(v.par_chunks(tile)))
            .try_for_each_init(
                || codec.sealer(),
                |sealer, (rec, (kt, vt))| sealer.seal(&seal_input(kt)?, &seal_input(vt)?, rec),
            )
    })??;
    Ok(out)
}

/// Decodes `n` records into `k` and `v` (each `[n][G][head_dim]`, model frame unless
/// `rotated`).
pub fn decode_records(
    codec: &BodyCodec,
    records: &[u8],
    k: &mut [f32],
    v: &mut [f32],
    rotated: bool,
    threads: Option<usize>,
) -> Result<()> {
    let d = codec.head_dim();
    let n = tile_count(d, "K output", k.len())?;
    if v.len() != k.len() {
        return Err(CodecError::LengthMismatch {
            what: "V output",
            expected: k.len(),
            got: v.len(),
        });
    }
    let rb = codec.record_bytes();
    if records.len() != n * rb {
        return Err(CodecError::LengthMismatch {
            what: "record bytes",
            expected: n * rb,
            got: records.len(),
        });
    }
    let tile = GROUP * d;
    with_threads(threads, || {
        records
            .par_chunks(rb)
            .zip(k.par_chunks_mut(tile).zip(v.par_chunks_mut(tile)))
            .try_for_each(|(rec, (kt, vt))| {
                let (kk, vv) = if rotated {
                    codec.decode_rotated(rec)?
                } else {
                    codec.decode_model_frame(rec)?
                };
                kt.copy_from_slice(&kk);
                vt.copy_from_slice(&vv);
                Ok(())
            })
    })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::extension::balance::{BalanceConfig, BalanceMode, BalanceStat};
    use crate::codec::extension::body::BodyCoding;

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

    fn codec(d: usize, k: u32, v: u32, balance: BalanceConfig) -> BodyCodec {
        BodyCodec::for_layer(d, k, v, BodyCoding::Scalar, BodyCoding::Scalar, balance).unwrap()
    }

    #[test]
    fn bytes_do_not_depend_on_thread_count() {
        let (k, v) = (tiles(5, 128, 1), tiles(5, 128, 2));
        for mode in [BalanceMode::Final, BalanceMode::Best] {
            for stat in [BalanceStat::Std, BalanceStat::Rms] {
                let c = codec(
                    128,
                    3,
                    2,
                    BalanceConfig {
                        passes: 12,
                        mode,
                        stat,
                    },
                );
                let one = encode_records(&c, &k, &v, false, Some(1)).unwrap();
                let two = encode_records(&c, &k, &v, false, Some(2)).unwrap();
                let again = encode_records(&c, &k, &v, false, Some(2)).unwrap();
                assert_eq!(one, two);
                assert_eq!(two, again);
            }
        }
    }

    #[test]
    fn round_trip_and_errors() {
        let c = codec(512, 4, 4, BalanceConfig::default());
        assert!(c.is_reference());
        let (k, v) = (tiles(2, 512, 3), tiles(2, 512, 4));
        let recs = encode_records(&c, &k, &v, false, None).unwrap();
        assert_eq!(recs.len(), 2 * c.record_bytes());
        let (mut kk, mut vv) = (vec![0.0; k.len()], vec![0.0; v.len()]);
        decode_records(&c, &recs, &mut kk, &mut vv, false, None).unwrap();
        let rel = |a: &[f32], b: &[f32]| {
            let e: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            e / a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>()
        };
        assert!(rel(&k, &kk) < 0.02 && rel(&v, &vv) < 0.02);
        assert!(encode_records(&c, &k, &v[1..], false, None).is_err());
        assert!(encode_records(&c, &k[1..], &v[1..], false, None).is_err());
        assert!(decode_records(&c, &recs[1..], &mut kk, &mut vv, false, None).is_err());
        let mut bad = v.clone();
        bad[10] = f32::INFINITY;
        assert_eq!(
            encode_records(&c, &k, &bad, false, None),
            Err(CodecError::NonFinite {
                index: k.len() + 10
            })
        );
    }
}
