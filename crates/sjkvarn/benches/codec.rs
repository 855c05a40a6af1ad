//! Codec throughput: encode and decode values/s per flat format, and scalar body seal rate
//! (tiles/s, one K+V record per tile) for head_dim 64, 128 and 256, on one thread.
//!
//! Run: `cargo bench -p sjkvarn --bench codec` (add `-- --quick` for a fast pass).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sjkvarn::codec::extension::body::GROUP;
use sjkvarn::codec::format;
use sjkvarn::codec::fp16::f32_to_f16;
use sjkvarn::codec::{Body, Decoder, RecordLayout, Sealer, ITERS};
use sjkvarn::BlockFormat;
use std::hint::black_box;

/// Deterministic Gaussian-like values (Irwin-Hall, 4 uniforms) without extra crates.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            let mut acc = 0.0f32;
            for _ in 0..4 {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                acc += (s >> 40) as f32 / (1u64 << 24) as f32;
            }
            (acc - 2.0) * 1.7
        })
        .collect()
}

fn flat_formats(c: &mut Criterion) {
    let n = 128 * 1024;
    let x = values(n, 1);
    let mut group = c.benchmark_group("flat");
    group.throughput(Throughput::Elements(n as u64));
    for &f in BlockFormat::all() {
        let encoded = format::encode(f, &x, Some(1)).unwrap();
        let mut out = vec![0u8; encoded.len()];
        group.bench_function(BenchmarkId::new("encode", f.name()), |b| {
            b.iter(|| format::encode_into(f, black_box(&x), &mut out, Some(1)).unwrap())
        });
        let mut back = vec![0f32; n];
        group.bench_function(BenchmarkId::new("decode", f.name()), |b| {
            b.iter(|| format::decode_into(f, black_box(&encoded), &mut back, Some(1)).unwrap())
        });
    }
    group.finish();
}

/// Sealing and decoding one SJ-KVaRN record (one KV head, 128 tokens) on one thread: scalar
/// 4/4 and 3/2, trellis 3/2 (the reference's 64-state Viterbi, the slow part of a seal).
fn body_seal(c: &mut Criterion) {
    let mut group = c.benchmark_group("body_seal");
    group.throughput(Throughput::Elements(1)); // one tile = one K+V record
    for d in [64usize, 128, 256] {
        let k: Vec<u16> = values(GROUP * d, 2)
            .iter()
            .map(|&x| f32_to_f16(x))
            .collect();
        let v: Vec<u16> = values(GROUP * d, 3)
            .iter()
            .map(|&x| f32_to_f16(x))
            .collect();
        for (k_bits, v_bits, body) in [
            (4, 4, Body::Scalar),
            (3, 2, Body::Scalar),
            (3, 2, Body::Trellis),
        ] {
            let layout = RecordLayout::new(d, GROUP, k_bits, v_bits, body).unwrap();
            let mut sealer = Sealer::new(layout, ITERS);
            let mut rec = vec![0u8; layout.bytes];
            let id = format!("d{d}_k{k_bits}v{v_bits}_{}", body.name());
            group.bench_function(BenchmarkId::new("encode", &id), |b| {
                b.iter(|| {
                    sealer
                        .seal(black_box(&k), black_box(&v), d, &mut rec)
                        .unwrap()
                })
            });
            let decoder = Decoder::new(layout);
            let (mut kk, mut vv) = (vec![0f32; GROUP * d], vec![0f32; GROUP * d]);
            group.bench_function(BenchmarkId::new("decode", &id), |b| {
                b.iter(|| decoder.decode(black_box(&rec), &mut kk, &mut vv))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, flat_formats, body_seal);
criterion_main!(benches);
