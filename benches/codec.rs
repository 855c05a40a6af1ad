//! Codec throughput: encode and decode values/s per flat format, and scalar body seal rate
//! (tiles/s, one K+V record per tile) for head_dim 64, 128 and 256, on one thread.
//!
//! Run: `cargo bench -p sjkvarn --bench codec` (add `-- --quick` for a fast pass).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sjkvarn::body::GROUP;
use sjkvarn::trellis::{self, Viterbi};
use sjkvarn::{bitpack, format, BalanceConfig, BlockFormat, BodySpec};
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

fn body_seal(c: &mut Criterion) {
    let mut group = c.benchmark_group("body_seal");
    group.throughput(Throughput::Elements(1)); // one tile = one K+V record
    for d in [64usize, 128, 256] {
        let k = values(GROUP * d, 2);
        let v = values(GROUP * d, 3);
        for (k_bits, v_bits) in [(4, 4), (3, 2)] {
            let spec = BodySpec::new(d, k_bits, v_bits).unwrap();
            let cfg = BalanceConfig::default();
            let mut rec = vec![0u8; spec.record_bytes()];
            let id = format!("d{d}_k{k_bits}v{v_bits}");
            group.bench_function(BenchmarkId::new("encode", &id), |b| {
                b.iter(|| {
                    spec.encode_rotated(black_box(&k), black_box(&v), &cfg, &mut rec)
                        .unwrap()
                })
            });
            let (mut kk, mut vv) = (vec![0f32; k.len()], vec![0f32; v.len()]);
            group.bench_function(BenchmarkId::new("decode", &id), |b| {
                b.iter(|| {
                    spec.decode_rotated(black_box(&rec), &mut kk, &mut vv)
                        .unwrap()
                })
            });
        }
    }
    group.finish();
}

/// Trellis coding of one K tile along the token axis: `D` runs of 128 (one tile per iteration),
/// and decoding throughput in values/s, on one thread.
fn trellis_runs(c: &mut Criterion) {
    let mut group = c.benchmark_group("trellis");
    for bits in [2u32, 3] {
        let cb = trellis::shipped(bits).unwrap();
        for d in [64usize, 256] {
            let x = values(GROUP * d, 4);
            let rb = bitpack::packed_len(GROUP, bits);
            let mut packed = vec![0u8; d * rb];
            let mut v = Viterbi::new();
            group.throughput(Throughput::Elements(1));
            group.bench_function(
                BenchmarkId::new("encode_tile", format!("128x{d}_{bits}bit")),
                |b| {
                    b.iter(|| {
                        for (run, out) in x.chunks_exact(GROUP).zip(packed.chunks_exact_mut(rb)) {
                            v.encode_packed(cb, black_box(run), out);
                        }
                    })
                },
            );
        }
        let runs = 4096;
        let x = values(GROUP * runs, 5);
        let packed = trellis::encode_runs(bits, &x, GROUP, None).unwrap();
        let mut out = vec![0f32; x.len()];
        group.throughput(Throughput::Elements(x.len() as u64));
        group.bench_function(BenchmarkId::new("decode", format!("{bits}bit")), |b| {
            b.iter(|| {
                trellis::decode_runs(bits, black_box(&packed), GROUP, &mut out, Some(1)).unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, flat_formats, body_seal, trellis_runs);
criterion_main!(benches);
