//! `attention::attend_paged` (an engine's block table over sealed records and exact rows)
//! against f64 attention over the rows those records decode to.

use sjkvarn::attention::{attend_paged, PagedBlock};
use sjkvarn::codec::extension::records::{decode_records, encode_records};
use sjkvarn::codec::BodyCodec;
use sjkvarn::rng::SplitMix64;
use sjkvarn::{BalanceConfig, BodyCoding, CacheError, GROUP};

const KVH: usize = 2;
const QH: usize = 6;
const D: usize = 64;

fn codec(coding: BodyCoding, k_bits: u32, v_bits: u32) -> BodyCodec {
    BodyCodec::for_layer(D, k_bits, v_bits, coding, coding, BalanceConfig::default()).unwrap()
}

/// Rows `[GROUP][KVH][D]` of block `b` from `[tokens][KVH][D]`, as per-head tiles
/// `[KVH][GROUP][D]` (the record order).
fn tiles(x: &[f32], b: usize) -> Vec<f32> {
    let mut out = vec![0.0; KVH * GROUP * D];
    for t in 0..GROUP {
        for h in 0..KVH {
            let from = ((b * GROUP + t) * KVH + h) * D;
            out[(h * GROUP + t) * D..(h * GROUP + t + 1) * D].copy_from_slice(&x[from..from + D]);
        }
    }
    out
}

fn untile(tiles: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; KVH * GROUP * D];
    for h in 0..KVH {
        for t in 0..GROUP {
            let to = (t * KVH + h) * D;
            out[to..to + D].copy_from_slice(&tiles[(h * GROUP + t) * D..(h * GROUP + t + 1) * D]);
        }
    }
    out
}

/// The largest error over query heads, relative to the head's largest output.
fn worst(got: &[f32], want: &[f64], n: usize) -> f64 {
    let mut worst = 0.0f64;
    for h in 0..QH {
        let (mut err, mut size) = (0.0f64, 0.0f64);
        for i in 0..n {
            for c in 0..D {
                let at = (i * QH + h) * D + c;
                err = err.max((got[at] as f64 - want[at]).abs());
                size = size.max(want[at].abs());
            }
        }
        worst = worst.max(err / size);
    }
    worst
}

/// Three sealed blocks and a fourth being filled (exact rows): queries of the fourth block
/// read the records of blocks 1..3 in place, the first block's exact rows (a sink) and their
/// own block's rows up to their position.
#[test]
fn records_read_in_place_attend_as_their_decoded_rows() {
    for (coding, kb, vb) in [
        (BodyCoding::Scalar, 4, 4),
        (BodyCoding::Scalar, 3, 2),
        ("trellis".parse().unwrap(), 3, 2),
    ] {
        let codec = codec(coding, kb, vb);
        let mut rng = SplitMix64::new(5);
        let tokens = 4 * GROUP;
        let (k, v) = (
            rng.gaussians(tokens * KVH * D),
            rng.gaussians(tokens * KVH * D),
        );
        // Rows as the queries see them: decoded records for blocks 1 and 2, exact elsewhere.
        let mut decoded_k = k.clone();
        let mut decoded_v = v.clone();
        let mut records = Vec::new();
        for b in 1..3 {
            let rec = encode_records(&codec, &tiles(&k, b), &tiles(&v, b), false, None).unwrap();
            let (mut dk, mut dv) = (vec![0.0; KVH * GROUP * D], vec![0.0; KVH * GROUP * D]);
            decode_records(&codec, &rec, &mut dk, &mut dv, false, None).unwrap();
            let span = b * GROUP * KVH * D..(b + 1) * GROUP * KVH * D;
            decoded_k[span.clone()].copy_from_slice(&untile(&dk));
            decoded_v[span].copy_from_slice(&untile(&dv));
            records.push(rec);
        }
        let block = |b: usize| b * GROUP * KVH * D..(b + 1) * GROUP * KVH * D;
        let own = [
            PagedBlock::Rows {
                k: &k[block(0)],
                v: &v[block(0)],
            },
            PagedBlock::Record(&records[0]),
            PagedBlock::Record(&records[1]),
            PagedBlock::Rows {
                k: &k[block(3)],
                v: &v[block(3)],
            },
        ];
        // Four queries at positions 3*128 + 10..: they see block 0 and their own block exact,
        // blocks 1 and 2 as their records decode.
        let (n, first_q) = (4, 3 * GROUP + 10);
        let (exact_k, exact_v) = (decoded_k, decoded_v);
        let q = rng.gaussians(n * QH * D);
        let scale = 0.125f32;
        let got = attend_paged(&codec, QH, KVH, &own, 0, &q, first_q, scale).unwrap();
        let mut want = vec![0.0f64; n * QH * D];
        for i in 0..n {
            let pos = first_q + i;
            for h in 0..QH {
                let kv = h / (QH / KVH);
                let qv = &q[(i * QH + h) * D..(i * QH + h + 1) * D];
                let logits: Vec<f64> = (0..=pos)
                    .map(|t| {
                        let kr = &exact_k[(t * KVH + kv) * D..(t * KVH + kv + 1) * D];
                        qv.iter()
                            .zip(kr)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for c in 0..D {
                    want[(i * QH + h) * D + c] = (0..=pos)
                        .map(|t| w[t] * exact_v[(t * KVH + kv) * D + c] as f64)
                        .sum::<f64>()
                        / z;
                }
            }
        }
        let err = worst(&got, &want, n);
        eprintln!("{coding:?} {kb}/{vb}: error {err:.2e} of the output");
        assert!(
            err <= 3e-4,
            "{coding:?} {kb}/{vb}: error {err:.2e} of the output"
        );
    }
}

#[test]
fn bad_blocks_and_queries_are_refused() {
    let codec = codec(BodyCoding::Scalar, 4, 4);
    let mut rng = SplitMix64::new(9);
    let rows = rng.gaussians(GROUP * KVH * D);
    let q = rng.gaussians(QH * D);
    let ok = [PagedBlock::Rows { k: &rows, v: &rows }];
    assert!(attend_paged(&codec, QH, KVH, &ok, 0, &q, 5, 0.1).is_ok());
    let short = [PagedBlock::Record(&[0u8; 10])];
    assert!(matches!(
        attend_paged(&codec, QH, KVH, &short, 0, &q, 5, 0.1),
        Err(CacheError::Shape { .. })
    ));
    assert!(attend_paged(&codec, 5, KVH, &ok, 0, &q, 5, 0.1).is_err());
    let mut nan = q.clone();
    nan[3] = f32::NAN;
    assert!(attend_paged(&codec, QH, KVH, &ok, 0, &nan, 5, 0.1).is_err());
    assert!(attend_paged(&codec, QH, KVH, &ok, 0, &q, 5, f32::INFINITY).is_err());
    // A query before every block sees nothing.
    assert!(matches!(
        attend_paged(&codec, QH, KVH, &ok, GROUP, &q, 5, 0.1),
        Err(CacheError::Position { .. })
    ));
}
