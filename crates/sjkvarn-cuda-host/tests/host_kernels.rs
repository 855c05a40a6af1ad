//! The CUDA kernels' lane functions, compiled for the host, against the Rust reference
//! (`sjkvarn::codec`): staged rows and sealed records must be the same bytes; attention, which
//! sums in another order (per-split partial sums merged by log-sum-exp), the same outputs within
//! 1e-4 relative of an f64 softmax over the decoded rows.

use sjkvarn::codec::conformance::{fnv, fnv_f32, Inputs, FNV0};
use sjkvarn::codec::fp16::{f16_to_f32 as ref_f16_to_f32, f32_to_f16 as ref_f32_to_f16};
use sjkvarn::codec::rotation::hadamard;
use sjkvarn::codec::{tq6, Body, Decoder, RecordLayout, Sealer, GROUP, ITERS};
use sjkvarn::kernel_abi::{
    attend_shared_floats, seal_scratch_bytes, KernelLayerView, KernelRecordLayout, STAGING_F16,
    STAGING_TQ6,
};
use sjkvarn_cuda_host::{
    c_attend_scratch_floats, c_code_bit, c_k_slot, c_record_layout, c_seal_scratch_bytes,
    c_struct_sizes, c_v_slot, f16_to_f32, f32_to_f16, fwht, record_q, seal_record, stage_row,
    tq_row, tq_row_bytes, tq_row_values, HostLayer, LayerBytes,
};

/// Every body the device backend implements, at every head_dim.
const BODIES: [(u32, u32, Body); 13] = [
    (4, 4, Body::Scalar),
    (4, 3, Body::Scalar),
    (4, 2, Body::Scalar),
    (3, 4, Body::Scalar),
    (3, 3, Body::Scalar),
    (3, 2, Body::Scalar),
    (2, 4, Body::Scalar),
    (2, 3, Body::Scalar),
    (2, 2, Body::Scalar),
    (3, 3, Body::Trellis),
    (3, 2, Body::Trellis),
    (2, 2, Body::Trellis),
    (2, 4, Body::Scalar),
];

fn layout(d: usize, bk: u32, bv: u32, body: Body) -> RecordLayout {
    RecordLayout::new(d, GROUP, bk, bv, body).unwrap()
}

fn name(l: &RecordLayout) -> String {
    format!(
        "D={} {}/{} {}",
        l.head_dim,
        l.bits_k,
        l.bits_v,
        l.body.name()
    )
}

#[test]
fn c_structs_have_the_rust_layout() {
    assert_eq!(
        c_struct_sizes(),
        (
            std::mem::size_of::<KernelLayerView>(),
            std::mem::size_of::<KernelRecordLayout>()
        )
    );
    for d in [64usize, 128, 256, 512] {
        assert_eq!(seal_scratch_bytes(d), c_seal_scratch_bytes(d));
    }
    for gs in [1usize, 3, 8, 16] {
        for d in [64usize, 512] {
            assert_eq!(
                attend_shared_floats(gs, d),
                gs * d + c_attend_scratch_floats(gs)
            );
        }
    }
}

#[test]
fn record_layouts_and_code_order_match_codec_layout() {
    for d in [64usize, 128, 256, 512] {
        for &(bk, bv, body) in &BODIES {
            let l = layout(d, bk, bv, body);
            let k = KernelRecordLayout::of(&l);
            assert_eq!(c_record_layout(d, bk, bv, body), k, "{}", name(&l));
            for is_v in [false, true] {
                for t in 0..GROUP {
                    for c in 0..d {
                        assert_eq!(c_code_bit(&k, t, c, is_v), l.code_bit(t, c, is_v));
                    }
                }
            }
            for c in 0..d {
                assert_eq!(c_k_slot(&k, c), l.k_channel_slot(c));
                assert_eq!(c_v_slot(&k, c), l.v_channel_slot(c));
            }
        }
    }
}

#[test]
fn fp16_conversion_is_bit_exact() {
    let mut s = Inputs(0x1234_5678_9abc_def1);
    let mut xs: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        65504.0,
        65520.0,
        65519.99,
        5.9604645e-8,
        2.9802322e-8,
        2.9802326e-8,
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::INFINITY,
        -f32::INFINITY,
        f32::NAN,
        -f32::NAN,
        6.1035156e-5,
        6.1035152e-5,
    ];
    for _ in 0..200_000 {
        xs.push(f32::from_bits(s.next_u32() ^ (s.next_u32() << 21)));
    }
    for x in xs {
        assert_eq!(
            f32_to_f16(x),
            ref_f32_to_f16(x),
            "{x:e} ({:#x})",
            x.to_bits()
        );
    }
    for h in 0..=u16::MAX {
        let (got, want) = (f16_to_f32(h), ref_f16_to_f32(h));
        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
    }
}

#[test]
fn hadamard_matches_codec_rotation() {
    let mut s = Inputs(9);
    for n in [64usize, 128, 256, 512] {
        let x = s.gaussians(n, 1.0);
        let mut want = x.clone();
        hadamard(&mut want).unwrap();
        let mut got = x;
        fwht(&mut got);
        assert_eq!(bits(&got), bits(&want), "n = {n}");
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn ref_tq_row(x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; tq6::row_bytes(x.len())];
    tq6::encode_row(x, &mut out);
    out
}

#[test]
fn staged_rows_are_codec_tq6_bytes() {
    for d in [64usize, 128, 256, 512] {
        let rows = 40;
        let mut x = Inputs::rows(rows, d);
        // Values on and around midpoints, tiny and zero rows.
        let norm_row = &mut x[0..d];
        norm_row.fill(0.0);
        norm_row[0] = 1.0;
        x[d..2 * d].fill(1e-12);
        for r in 0..rows {
            let row = &x[r * d..(r + 1) * d];
            let want = ref_tq_row(row);
            let (got, st) = tq_row(row);
            assert_eq!(st, 0);
            assert_eq!(got, want, "D={d} row {r}");
            let mut dec = vec![0f32; d];
            tq6::decode_row(&want, &mut dec);
            assert_eq!(
                bits(&tq_row_values(&got, d)),
                bits(&dec),
                "D={d} row {r} decode"
            );
        }
        // The append path: model-frame rows rotated then staged.
        let mut s = Inputs(d as u64);
        for _ in 0..8 {
            let model = s.gaussians(d, 0.7);
            let mut rot = model.clone();
            hadamard(&mut rot).unwrap();
            let (got, st) = stage_row(&model);
            assert_eq!(st, 0);
            assert_eq!(got, ref_tq_row(&rot), "D={d} staged");
        }
        assert_eq!(tq_row_bytes(d), tq6::row_bytes(d));
    }
    // An fp16-overflowing norm is reported.
    let (_, st) = tq_row(&[1e30f32; 128]);
    assert_eq!(st, 2);
}

#[test]
fn staged_rows_reproduce_the_reference_tq6_vector() {
    // `tq6 rows=64 n=256` of the reference's expected vectors.
    let (rows, n) = (64, 256);
    let x = Inputs::rows(rows, n);
    let mut enc = Vec::new();
    let mut dec = Vec::new();
    for r in 0..rows {
        let (row, st) = tq_row(&x[r * n..(r + 1) * n]);
        assert_eq!(st, 0);
        dec.extend(tq_row_values(&row, n));
        enc.extend(row);
    }
    assert_eq!(fnv(&enc, FNV0), 0xe2cf2c357ef8de90);
    assert_eq!(fnv_f32(&dec, FNV0), 0xde4f0c87393006e6);
}

fn ref_seal(l: &RecordLayout, k: &[u16], v: &[u16], stride: usize) -> Vec<u8> {
    let mut rec = vec![0u8; l.bytes];
    Sealer::new(*l, ITERS).seal(k, v, stride, &mut rec).unwrap();
    rec
}

fn first_difference(a: &[u8], b: &[u8], l: &RecordLayout) -> String {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        None => "same".into(),
        Some(i) => {
            let field = [
                ("k_payload", l.k_payload),
                ("v_payload", l.v_payload),
                ("k_scale", l.k_scale),
                ("k_zero", l.k_zero),
                ("k_tok", l.k_tok),
                ("v_ch", l.v_ch),
                ("v_scale", l.v_scale),
                ("v_zero", l.v_zero),
            ]
            .iter()
            .rev()
            .find(|(_, off)| i >= *off)
            .map(|(n, off)| format!("{n}+{}", i - off))
            .unwrap_or_default();
            let n = a.iter().zip(b).filter(|(x, y)| x != y).count();
            format!("first differing byte {i} ({field}), {n} bytes differ")
        }
    }
}

fn check_seal(l: &RecordLayout, seed: u32) {
    let d = l.head_dim;
    let (k, v) = Inputs::group(d, GROUP, seed);
    let want = ref_seal(l, &k, &v, d);
    let (got, st) = seal_record(l, &k, &v, d, ITERS);
    assert_eq!(st, 0);
    assert!(
        got == want,
        "{}: {}",
        name(l),
        first_difference(&got, &want, l)
    );
    // Every code value the attention reads is the decoder's.
    let dec = Decoder::new(*l);
    for t in (0..GROUP).step_by(7) {
        for c in 0..d {
            for is_v in [false, true] {
                assert_eq!(
                    record_q(l, &got, t, c, is_v).to_bits(),
                    dec.q(&got, t, c, is_v).to_bits()
                );
            }
        }
    }
}

#[test]
fn sealed_records_are_codec_bytes_scalar() {
    for d in [128usize, 256] {
        for (bk, bv) in [(4, 4), (4, 2), (3, 3), (2, 2), (4, 3), (2, 4), (3, 2)] {
            check_seal(&layout(d, bk, bv, Body::Scalar), 3);
        }
    }
    check_seal(&layout(64, 4, 4, Body::Scalar), 5);
    check_seal(&layout(64, 3, 2, Body::Scalar), 5);
    check_seal(&layout(512, 4, 2, Body::Scalar), 6);
}

#[test]
fn sealed_records_are_codec_bytes_trellis() {
    for d in [128usize, 256] {
        for (bk, bv) in [(3, 3), (3, 2), (2, 2)] {
            check_seal(&layout(d, bk, bv, Body::Trellis), 4);
        }
    }
    check_seal(&layout(64, 3, 2, Body::Trellis), 7);
    check_seal(&layout(512, 2, 2, Body::Trellis), 8);
}

#[test]
fn sealed_records_reproduce_reference_vector_hashes() {
    // (D, bits K, bits V, body, record hash, decoded-rows hash) from the reference's
    // `tests/expected_vectors.txt` (as in crates/sjkvarn/tests/reference_vectors.rs).
    let cases = [
        (
            128,
            4,
            4,
            Body::Scalar,
            0xee9813f6f22b03a4u64,
            0xb11506576bb29867u64,
        ),
        (
            128,
            3,
            3,
            Body::Trellis,
            0x504d4796353fa3ea,
            0xd909eb8c10ec7b43,
        ),
        (
            128,
            2,
            2,
            Body::Scalar,
            0x666849aebc22fd4e,
            0xd46a43fdbad9a76a,
        ),
        (
            256,
            3,
            2,
            Body::Trellis,
            0x5c5b8edd8a06fe37,
            0xbcb2744c5e87923e,
        ),
        (
            256,
            4,
            2,
            Body::Scalar,
            0x5e5c11b4c63c7f74,
            0x501642d89009d2eb,
        ),
    ];
    for (d, bk, bv, body, want_rec, want_dec) in cases {
        let l = layout(d, bk, bv, body);
        let (k, v) = Inputs::group(d, GROUP, 1);
        let (rec, st) = seal_record(&l, &k, &v, d, ITERS);
        assert_eq!(st, 0);
        assert_eq!(fnv(&rec, FNV0), want_rec, "{}", name(&l));
        // Decoded rows from the kernels' own code reader and the record's fields.
        let mut h = FNV0;
        let half = |off: usize| ref_f16_to_f32(u16::from_le_bytes([rec[off], rec[off + 1]]));
        for t in 0..GROUP {
            let tok = half(l.k_tok + 2 * t);
            let krow: Vec<f32> = (0..d)
                .map(|c| {
                    let s = l.k_channel_slot(c);
                    (record_q(&l, &rec, t, c, false) * half(l.k_scale + 2 * s)
                        + half(l.k_zero + 2 * s))
                        * tok
                })
                .collect();
            h = fnv_f32(&krow, h);
            let (sc, zp) = (half(l.v_scale + 2 * t), half(l.v_zero + 2 * t));
            let vrow: Vec<f32> = (0..d)
                .map(|c| {
                    (record_q(&l, &rec, t, c, true) * sc + zp)
                        * half(l.v_ch + 2 * l.v_channel_slot(c))
                })
                .collect();
            h = fnv_f32(&vrow, h);
        }
        assert_eq!(h, want_dec, "{}: decoded rows", name(&l));
    }
}

/// A host-built layer: sink rows, `sealed` groups sealed by `codec::Sealer` from the staged
/// rows, and a ring holding the staged rows of every position after the sink (so groups not yet
/// sealed can be sealed by the kernel). Returns the layer and the rotated rows each position
/// decodes to ([pos][head][d], K and V) for the reference attention.
struct Built {
    layer: HostLayer,
    k_rows: Vec<f32>,
    v_rows: Vec<f32>,
}

fn build_layer(
    l: RecordLayout,
    kv_heads: usize,
    len: usize,
    sealed: usize,
    staging: i32,
    seed: u64,
) -> Built {
    let d = l.head_dim;
    let mut s = Inputs(seed);
    let ring_len = len.saturating_sub(128);
    let ring_rows = ring_len.max(1);
    let row_bytes = if staging == STAGING_F16 {
        2 * d
    } else {
        tq6::row_bytes(d)
    };
    let mut sink_k = vec![0u16; 128 * kv_heads * d];
    let mut sink_v = sink_k.clone();
    let mut ring = vec![0u8; ring_rows * kv_heads * 2 * row_bytes];
    let mut k_rows = vec![0f32; len * kv_heads * d];
    let mut v_rows = k_rows.clone();
    // Per-channel spreads like real keys (a few outlier channels).
    let spread: Vec<f32> = (0..d)
        .map(|c| if c % 37 == 5 { 6.0 } else { 1.0 })
        .collect();
    for pos in 0..len {
        for h in 0..kv_heads {
            for (value, rows_out) in [(0usize, &mut k_rows), (1, &mut v_rows)] {
                let mut x = s.gaussians(d, 0.8);
                if value == 0 {
                    for (v, sp) in x.iter_mut().zip(&spread) {
                        *v *= sp;
                    }
                }
                hadamard(&mut x).unwrap();
                let at = (pos * kv_heads + h) * d;
                if pos < 128 {
                    let sink = if value == 0 { &mut sink_k } else { &mut sink_v };
                    for c in 0..d {
                        sink[at + c] = ref_f32_to_f16(x[c]);
                        rows_out[at + c] = ref_f16_to_f32(sink[at + c]);
                    }
                    continue;
                }
                let idx = (pos - 128) % ring_rows;
                let off = ((idx * kv_heads + h) * 2 + value) * row_bytes;
                let dst = &mut ring[off..off + row_bytes];
                let decoded: Vec<f32> = if staging == STAGING_F16 {
                    x.iter()
                        .enumerate()
                        .map(|(c, &v)| {
                            let hb = ref_f32_to_f16(v);
                            dst[2 * c..2 * c + 2].copy_from_slice(&hb.to_le_bytes());
                            ref_f16_to_f32(hb)
                        })
                        .collect()
                } else {
                    tq6::encode_row(&x, dst);
                    let mut y = vec![0f32; d];
                    tq6::decode_row(dst, &mut y);
                    y
                };
                rows_out[at..at + d].copy_from_slice(&decoded);
            }
        }
    }
    // Seal the first `sealed` groups with the reference sealer (rows: staged, decoded, fp16).
    let mut pool = vec![0u8; sealed * kv_heads * l.bytes];
    let mut sealer = Sealer::new(l, ITERS);
    let dec = Decoder::new(l);
    for g in 0..sealed {
        for h in 0..kv_heads {
            let rows16 = |src: &Vec<f32>| -> Vec<u16> {
                (0..GROUP)
                    .flat_map(|t| {
                        let at = ((128 + g * GROUP + t) * kv_heads + h) * d;
                        src[at..at + d]
                            .iter()
                            .map(|&v| ref_f32_to_f16(v))
                            .collect::<Vec<_>>()
                    })
                    .collect()
            };
            let (k16, v16) = (rows16(&k_rows), rows16(&v_rows));
            let rec = &mut pool[(g * kv_heads + h) * l.bytes..(g * kv_heads + h + 1) * l.bytes];
            sealer.seal(&k16, &v16, d, rec).unwrap();
            for t in 0..GROUP {
                let at = ((128 + g * GROUP + t) * kv_heads + h) * d;
                dec.k_row(rec, t, &mut k_rows[at..at + d]);
                dec.v_row(rec, t, &mut v_rows[at..at + d]);
            }
        }
    }
    let layer = HostLayer::new(LayerBytes {
        layout: l,
        kv_heads,
        len,
        sealed,
        staging,
        row_bytes,
        ring_rows,
        sink_k,
        sink_v,
        ring,
        pool,
    });
    Built {
        layer,
        k_rows,
        v_rows,
    }
}

#[test]
fn seal_kernel_gathers_the_ring_like_the_journal() {
    for (d, bk, bv, body, staging) in [
        (128, 4, 4, Body::Scalar, STAGING_TQ6),
        (256, 3, 2, Body::Trellis, STAGING_TQ6),
        (64, 2, 2, Body::Trellis, STAGING_F16),
        (512, 4, 3, Body::Scalar, STAGING_TQ6),
    ] {
        let l = layout(d, bk, bv, body);
        let kv_heads = 2;
        let b = build_layer(l, kv_heads, 128 + 2 * GROUP + 5, 1, staging, d as u64 + 1);
        // Group 1 is still in the ring: the kernel's seal must equal the reference's on the
        // same rows (staged, decoded, rounded to fp16).
        for h in 0..kv_heads {
            let rows16 = |src: &Vec<f32>| -> Vec<u16> {
                (0..GROUP)
                    .flat_map(|t| {
                        let at = ((128 + GROUP + t) * kv_heads + h) * d;
                        src[at..at + d]
                            .iter()
                            .map(|&v| ref_f32_to_f16(v))
                            .collect::<Vec<_>>()
                    })
                    .collect()
            };
            let want = ref_seal(&l, &rows16(&b.k_rows), &rows16(&b.v_rows), d);
            let (got, st) = b.layer.seal_group(1, h, ITERS);
            assert_eq!(st, 0);
            assert!(
                got == want,
                "{} head {h}: {}",
                name(&l),
                first_difference(&got, &want, &l)
            );
        }
    }
}

/// Causal softmax attention in f64 over the decoded rotated rows; output un-rotated.
fn reference_attention(b: &Built, q: &[f32], q_heads: usize, scale: f32) -> Vec<f32> {
    let v = b.layer.view();
    let (d, kvh, len) = (v.head_dim as usize, v.kv_heads as usize, v.len as usize);
    let gs = q_heads / kvh;
    let rows = q.len() / (q_heads * d);
    let mut out = vec![0f32; q.len()];
    for i in 0..rows {
        let qpos = len - rows + i;
        for head in 0..q_heads {
            let h = head / gs;
            let mut qr = q[(i * q_heads + head) * d..(i * q_heads + head + 1) * d].to_vec();
            hadamard(&mut qr).unwrap();
            let logits: Vec<f64> = (0..=qpos)
                .map(|p| {
                    let k = &b.k_rows[(p * kvh + h) * d..(p * kvh + h + 1) * d];
                    qr.iter()
                        .zip(k)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|&x| (x - m).exp()).collect();
            let total: f64 = w.iter().sum();
            let mut acc = vec![0f64; d];
            for (p, &wp) in w.iter().enumerate() {
                let vr = &b.v_rows[(p * kvh + h) * d..(p * kvh + h + 1) * d];
                for (a, &x) in acc.iter_mut().zip(vr) {
                    *a += wp * x as f64;
                }
            }
            let mut o: Vec<f32> = acc.iter().map(|&a| (a / total) as f32).collect();
            hadamard(&mut o).unwrap();
            out[(i * q_heads + head) * d..(i * q_heads + head + 1) * d].copy_from_slice(&o);
        }
    }
    out
}

#[test]
fn attention_matches_an_f64_softmax_over_decoded_rows() {
    let cases = [
        // (D, bits, body, staging, kv heads, q heads, len, sealed, query rows, splits)
        (
            128,
            4,
            4,
            Body::Scalar,
            STAGING_TQ6,
            2,
            4,
            128 + 2 * GROUP + 70,
            2,
            1,
            1,
        ),
        (
            128,
            4,
            2,
            Body::Scalar,
            STAGING_TQ6,
            1,
            3,
            128 + 2 * GROUP + 70,
            2,
            3,
            2,
        ),
        (
            64,
            3,
            2,
            Body::Trellis,
            STAGING_F16,
            1,
            8,
            128 + GROUP + 9,
            1,
            1,
            3,
        ),
        (
            256,
            2,
            2,
            Body::Trellis,
            STAGING_TQ6,
            2,
            2,
            128 + 2 * GROUP + 128,
            2,
            2,
            4,
        ),
        (
            512,
            3,
            3,
            Body::Scalar,
            STAGING_TQ6,
            1,
            1,
            128 + GROUP + 3,
            1,
            1,
            2,
        ),
        (
            128,
            3,
            3,
            Body::Trellis,
            STAGING_TQ6,
            1,
            16,
            128 + GROUP + 1,
            1,
            1,
            1,
        ),
        (128, 4, 4, Body::Scalar, STAGING_TQ6, 1, 1, 70, 0, 4, 1),
    ];
    for (d, bk, bv, body, staging, kvh, qh, len, sealed, rows, splits) in cases {
        let l = layout(d, bk, bv, body);
        let b = build_layer(l, kvh, len, sealed, staging, (d * 7 + len) as u64);
        let mut s = Inputs(len as u64 * 3 + 1);
        let q = s.gaussians(rows * qh * d, 1.0);
        let scale = 1.0 / (d as f32).sqrt();
        let want = reference_attention(&b, &q, qh, scale);
        let got = b
            .layer
            .attend(&q, qh, scale, splits)
            .expect("kernel for the group size");
        for (row, (g, w)) in got.chunks(d).zip(want.chunks(d)).enumerate() {
            let norm = w.iter().map(|x| x.abs()).fold(0f32, f32::max);
            let err = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                err <= 1e-4 * norm,
                "{} row {row}: error {err} vs scale {norm}",
                name(&l)
            );
        }
    }
}
