use super::*;
use crate::rng::SplitMix64;

/// `trim` frees a prefill's worth of rounded rows and keeps a decode call's.
#[test]
fn trim_frees_only_large_buffers() {
    let mut rng = SplitMix64::new(3);
    let mut fq = FixedQueries::default();
    fq.prepare(&rng.gaussians(6 * 256), 256, 6, 256);
    fq.trim(1 << 20);
    assert_eq!(fq.n.len(), 6 * 256);
    fq.prepare(&rng.gaussians(4096 * 256), 256, 4096, 256);
    fq.trim(1 << 20);
    assert_eq!(fq.n.capacity() + fq.factor.capacity(), 0);
    fq.prepare(&rng.gaussians(6 * 256), 256, 6, 256);
    assert_eq!(fq.n.len(), 6 * 256);
}

fn rows_of(d: usize, n: usize, rng: &mut SplitMix64) -> Vec<Vec<u8>> {
    (0..n)
        .map(|_| {
            let x: Vec<f32> = rng.gaussians(d).iter().map(|v| v * 1.7).collect();
            let mut b = vec![0u8; tq6::row_bytes(d) + 7];
            tq6::encode_row(&x, &mut b);
            b
        })
        .collect()
}

/// The kernels this CPU can run.
fn kernels() -> Vec<RingKernel> {
    let mut kernels = vec![RingKernel::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx512() {
            kernels.push(RingKernel::Avx512);
        }
        if RingKernel::for_level(crate::simd::simd_level()) == RingKernel::Vnni {
            kernels.push(RingKernel::Vnni);
        }
    }
    kernels
}

/// Every kernel this CPU has gives the portable bits, for both block sizes, every query
/// count and partial row groups.
#[test]
fn every_kernel_gives_the_portable_bits() {
    let mut rng = SplitMix64::new(5);
    let kernels = kernels();
    for d in [64usize, 128, 256] {
        let rows = rows_of(d, 37, &mut rng);
        let slices: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
        for m in [1usize, 3, 6, 8] {
            let queries = rng.gaussians(m * d);
            let mut fq = FixedQueries::default();
            fq.prepare(&queries, d, m, d);
            let mut want = vec![0.0f32; m * 40];
            key_scores(RingKernel::Portable, &fq, 0, m, &slices, 37, &mut want, 40);
            for &kernel in &kernels {
                let mut got = vec![0.0f32; m * 40];
                key_scores(kernel, &fq, 0, m, &slices, 37, &mut got, 40);
                assert_eq!(got, want, "{kernel:?}, d {d}, {m} queries");
            }
        }
    }
}

/// The fixed-point scores are the float dot products with the decoded rows, within the
/// rounding of query and centroids (about 1e-4 of `|q| |k|`).
#[test]
fn scores_are_dot_products_with_the_decoded_rows() {
    let mut rng = SplitMix64::new(6);
    for d in [64usize, 256] {
        let rows = rows_of(d, 20, &mut rng);
        let slices: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
        let queries = rng.gaussians(2 * d);
        let mut fq = FixedQueries::default();
        fq.prepare(&queries, d, 2, d);
        let mut got = vec![0.0f32; 2 * 20];
        key_scores(RingKernel::Portable, &fq, 0, 2, &slices, 20, &mut got, 20);
        let mut worst = 0.0f64;
        for (t, row) in rows.iter().enumerate() {
            let mut k = vec![0.0f32; d];
            tq6::decode_row(&row[..tq6::row_bytes(d)], &mut k);
            for s in 0..2 {
                let q = &queries[s * d..(s + 1) * d];
                let want: f64 = q.iter().zip(&k).map(|(a, b)| *a as f64 * *b as f64).sum();
                let norms: f64 = (q.iter().map(|a| (*a as f64).powi(2)).sum::<f64>()
                    * k.iter().map(|a| (*a as f64).powi(2)).sum::<f64>())
                .sqrt();
                worst = worst.max((got[s * 20 + t] as f64 - want).abs() / norms);
            }
        }
        assert!(worst < 1e-4, "d {d}: error {worst:.2e} of |q||k|");
    }
}

/// A query block of zeros scores zero; a non-finite one scores NaN, as float arithmetic.
#[test]
fn zero_and_non_finite_queries() {
    let mut rng = SplitMix64::new(7);
    let rows = rows_of(128, 3, &mut rng);
    let slices: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
    let mut q = vec![0.0f32; 256];
    q[128 + 5] = f32::INFINITY;
    let mut fq = FixedQueries::default();
    fq.prepare(&q, 128, 2, 128);
    let mut out = vec![1.0f32; 6];
    key_scores(RingKernel::Portable, &fq, 0, 2, &slices, 3, &mut out, 3);
    assert!(out[..3].iter().all(|&x| x == 0.0) && out[3..].iter().all(|x| x.is_nan()));
}
/// The value sums of every kernel this CPU has give the portable bits, and equal the
/// weighted sums of the decoded rows up to float rounding (the norm joins the weight).
#[test]
fn value_sums_are_weighted_sums_of_the_decoded_rows() {
    let mut rng = SplitMix64::new(8);
    let kernels = kernels();
    for d in [64usize, 128, 256] {
        // Entries: 5 bytes of something else, then the value row.
        let rows: Vec<Vec<u8>> = rows_of(d, 37, &mut rng)
            .into_iter()
            .map(|r| [vec![9u8; 5], r].concat())
            .collect();
        let slices: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
        for m in [1usize, 3, 6, 8] {
            let w: Vec<f32> = rng.gaussians(m * 40).iter().map(|x| x.abs()).collect();
            let mut want = vec![0.5f32; m * d];
            value_sums(
                RingKernel::Portable,
                d,
                &w,
                40,
                m,
                &slices,
                5,
                37,
                &mut want,
                d,
                false,
            );
            for &kernel in &kernels {
                for carry in [false, true] {
                    let mut got = vec![0.5f32; m * d];
                    value_sums(kernel, d, &w, 40, m, &slices, 5, 37, &mut got, d, carry);
                    if carry {
                        got.iter_mut().for_each(|x| *x -= 0.5);
                        let close = got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-4);
                        assert!(close, "{kernel:?} carry, d {d}, {m}");
                    } else {
                        assert_eq!(got, want, "{kernel:?}, d {d}, {m} pairs");
                    }
                }
            }
            let mut decoded = vec![0.0f32; d];
            let mut exact = vec![0.0f64; m * d];
            for (t, row) in rows.iter().enumerate() {
                tq6::decode_row(&row[5..5 + tq6::row_bytes(d)], &mut decoded);
                for s in 0..m {
                    for c in 0..d {
                        exact[s * d + c] += w[s * 40 + t] as f64 * decoded[c] as f64;
                    }
                }
            }
            for (g, e) in want.iter().zip(&exact) {
                assert!((*g as f64 - e).abs() < 1e-4 * (1.0 + e.abs()), "{g} vs {e}");
            }
        }
    }
}
