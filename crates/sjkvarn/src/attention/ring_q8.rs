//! `q8_0` ring values summed straight from their 8-bit codes: no decoded float copy of a row.
//!
//! A `q8_0` value is `scale * code` (32 values per block, an fp16 scale, signed bytes). The
//! weighted sum `sum_t w_t v_t` over ring rows folds each block's scale into the weight
//! (`a = w_t scale`, one rounding) and adds `a * code` with one fused multiply-add per value,
//! in ascending `t`. Codes are exact in f32, so every instruction set gives the same bits and
//! the result differs from the sum over decoded rows only by where the scale's product is
//! rounded. Decoding a row first would write and read back 4 bytes per value; the fused sum
//! reads the 1-byte codes once.

use super::operands::value_operands_fit;
use super::ring_tq6::RingKernel;
use crate::codec::comparators::ggml::QK;
use crate::codec::fp16::f16_to_f32;
use crate::journal::RowCodec;
use crate::journal::Staging;

/// Bytes of one `q8_0` block: the fp16 scale, then 32 signed codes.
const BLOCK_BYTES: usize = 2 + QK;

/// Bytes of a `q8_0` row of `d` values (the ring's own row size).
fn row_bytes(d: usize) -> usize {
    RowCodec::new(Staging::Q8_0, d).row_bytes()
}

/// `out[s * ldo + c] = sum_t (w[s * ldw + t] scale[t, c]) code[t, c]` over `t < n`, in
/// ascending `t`, one fused multiply-add per step, starting from `out` when `carry` (else from
/// zero): the value sums of `m` query pairs over `q8_0` value rows of `d` values, each at byte
/// `offset` of `rows[t]`. `rows[n..]` are only prefetched.
#[allow(clippy::too_many_arguments)]
pub(crate) fn q8_value_sums(
    kernel: RingKernel,
    d: usize,
    w: &[f32],
    ldw: usize,
    m: usize,
    rows: &[&[u8]],
    offset: usize,
    n: usize,
    out: &mut [f32],
    ldo: usize,
    carry: bool,
) {
    let bytes = row_bytes(d);
    let (weights, outputs) = ((w, ldw), (out.len(), ldo));
    assert!(
        value_operands_fit(d, QK, m, weights, rows, offset + bytes, n, outputs),
        "q8_0 ring value rows"
    );
    if m == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel != RingKernel::Portable {
        // SAFETY: a non-portable kernel is only chosen where `simd` reported AVX-512 (F, BW,
        // F16C, FMA); rows, weights and output were checked above, which is all it touches.
        unsafe { avx512::sums(d, w, ldw, m, rows, offset, n, out, ldo, carry) };
        return;
    }
    let _ = kernel;
    for s in 0..m {
        if !carry {
            out[s * ldo..s * ldo + d].fill(0.0);
        }
    }
    for (t, row) in rows[..n].iter().enumerate() {
        for b in 0..d / QK {
            let block = &row[offset + b * BLOCK_BYTES..offset + (b + 1) * BLOCK_BYTES];
            let scale = f16_to_f32(u16::from_le_bytes([block[0], block[1]]));
            for s in 0..m {
                let a = w[s * ldw + t] * scale;
                let o = &mut out[s * ldo + b * QK..s * ldo + (b + 1) * QK];
                for (o, &code) in o.iter_mut().zip(&block[2..]) {
                    *o = a.mul_add((code as i8) as f32, *o);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    // The kernel indexes several per-pair arrays in step; index loops say that more plainly.
    #![allow(clippy::needless_range_loop)]

    use super::BLOCK_BYTES;
    use crate::codec::comparators::ggml::QK;
    use crate::codec::fp16::f16_to_f32;
    use std::arch::x86_64::*;

    /// Rows fetched ahead of the one being summed.
    const AHEAD: usize = 8;

    /// One block (32 channels) at a time, its `2 M` accumulators in registers over all rows;
    /// each row's 32 codes widened once and added with one fused multiply-add per pair.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn sums_m<const M: usize>(
        d: usize,
        w: &[f32],
        ldw: usize,
        rows: &[&[u8]],
        offset: usize,
        n: usize,
        out: &mut [f32],
        ldo: usize,
        carry: bool,
    ) {
        let (op, wp) = (out.as_mut_ptr(), w.as_ptr());
        for b in 0..d / QK {
            let mut acc = [[_mm512_setzero_ps(); 2]; M];
            if carry {
                for s in 0..M {
                    for k in 0..2 {
                        acc[s][k] = _mm512_loadu_ps(op.add(s * ldo + QK * b + 16 * k));
                    }
                }
            }
            for r in 0..n {
                if b == 0 {
                    if let Some(ahead) = rows.get(r + AHEAD) {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.as_ptr().add(offset) as *const i8);
                    }
                }
                let blk = rows[r].as_ptr().add(offset + b * BLOCK_BYTES);
                let scale = f16_to_f32(u16::from_le_bytes([*blk, *blk.add(1)]));
                let codes = blk.add(2);
                let v = [
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes as _))),
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes.add(16) as _))),
                ];
                for s in 0..M {
                    // SAFETY: weight `r < n` of pair `s` (checked by the caller).
                    let a = _mm512_set1_ps(*wp.add(s * ldw + r) * scale);
                    for k in 0..2 {
                        acc[s][k] = _mm512_fmadd_ps(a, v[k], acc[s][k]);
                    }
                }
            }
            for s in 0..M {
                for k in 0..2 {
                    // SAFETY: channels `32 b + 16 k .. + 16 <= d` of pair `s`.
                    _mm512_storeu_ps(op.add(s * ldo + QK * b + 16 * k), acc[s][k]);
                }
            }
        }
    }

    /// [`super::q8_value_sums`] on AVX-512.
    ///
    /// # Safety
    /// The CPU must have the features; operands as `q8_value_sums` checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn sums(
        d: usize,
        w: &[f32],
        ldw: usize,
        m: usize,
        rows: &[&[u8]],
        offset: usize,
        n: usize,
        out: &mut [f32],
        ldo: usize,
        carry: bool,
    ) {
        macro_rules! go {
            ($m:literal) => {
                sums_m::<$m>(d, w, ldw, rows, offset, n, out, ldo, carry)
            };
        }
        by_rows!(m, go, [1, 2, 3, 4, 5, 6, 7], 8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::comparators::ggml::GgmlFormat;
    use crate::rng::SplitMix64;

    /// `rows` q8_0 rows of `d` Gaussian values, each after 3 bytes of something else.
    fn rows_of(d: usize, rows: usize, rng: &mut SplitMix64) -> Vec<Vec<u8>> {
        (0..rows)
            .map(|_| {
                let x = rng.gaussians(d);
                let mut row = vec![7u8; 3 + row_bytes(d)];
                for (b, chunk) in x.chunks_exact(QK).enumerate() {
                    let at = 3 + b * BLOCK_BYTES;
                    GgmlFormat::Q8_0.encode_block(chunk, &mut row[at..at + BLOCK_BYTES]);
                }
                row
            })
            .collect()
    }

    fn kernels() -> Vec<RingKernel> {
        let mut kernels = vec![RingKernel::Portable];
        #[cfg(target_arch = "x86_64")]
        if crate::simd::avx512() {
            kernels.push(RingKernel::Avx512);
        }
        kernels
    }

    /// Every kernel gives the portable bits (with and without a carried start), and the sums
    /// equal the weighted sums of the decoded rows up to float rounding.
    #[test]
    fn sums_are_weighted_sums_of_the_decoded_rows() {
        let mut rng = SplitMix64::new(11);
        for d in [32usize, 64, 128, 256] {
            let rows = rows_of(d, 37, &mut rng);
            let slices: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
            for m in [1usize, 3, 6, 8] {
                let w: Vec<f32> = rng.gaussians(m * 40).iter().map(|x| x.abs()).collect();
                let start = rng.gaussians(m * d);
                for carry in [false, true] {
                    let mut want = start.clone();
                    let f = q8_value_sums;
                    f(
                        RingKernel::Portable,
                        d,
                        &w,
                        40,
                        m,
                        &slices,
                        3,
                        37,
                        &mut want,
                        d,
                        carry,
                    );
                    for &kernel in &kernels() {
                        let mut got = start.clone();
                        f(kernel, d, &w, 40, m, &slices, 3, 37, &mut got, d, carry);
                        assert_eq!(got, want, "{kernel:?}, d {d}, {m} pairs, carry {carry}");
                    }
                    let mut decoded = vec![0.0f32; d];
                    for s in 0..m {
                        let mut exact: Vec<f64> = if carry {
                            start[s * d..(s + 1) * d]
                                .iter()
                                .map(|&x| x as f64)
                                .collect()
                        } else {
                            vec![0.0; d]
                        };
                        for (t, row) in rows.iter().enumerate() {
                            for (b, o) in decoded.chunks_exact_mut(QK).enumerate() {
                                let at = 3 + b * BLOCK_BYTES;
                                GgmlFormat::Q8_0.decode_block(&row[at..at + BLOCK_BYTES], o);
                            }
                            for c in 0..d {
                                exact[c] += w[s * 40 + t] as f64 * decoded[c] as f64;
                            }
                        }
                        for (g, e) in want[s * d..(s + 1) * d].iter().zip(&exact) {
                            assert!((*g as f64 - e).abs() < 1e-4 * (1.0 + e.abs()), "{g} vs {e}");
                        }
                    }
                }
            }
        }
    }

    /// Only the first `n` rows are read: weights and rows past them change nothing.
    #[test]
    fn rows_past_n_are_not_summed() {
        let mut rng = SplitMix64::new(12);
        let rows = rows_of(64, 20, &mut rng);
        let slices: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
        let w = vec![1.0f32; 20];
        let mut a = vec![0.0f32; 64];
        let mut b = vec![0.0f32; 64];
        q8_value_sums(
            RingKernel::Portable,
            64,
            &w,
            20,
            1,
            &slices,
            3,
            12,
            &mut a,
            64,
            false,
        );
        q8_value_sums(
            RingKernel::Portable,
            64,
            &w,
            20,
            1,
            &slices[..12],
            3,
            12,
            &mut b,
            64,
            false,
        );
        assert_eq!(a, b);
        let mut c = vec![0.0f32; 64];
        q8_value_sums(
            RingKernel::Portable,
            64,
            &w,
            20,
            1,
            &slices,
            3,
            13,
            &mut c,
            64,
            false,
        );
        assert_ne!(a, c);
    }
}
