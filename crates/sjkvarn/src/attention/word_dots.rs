//! Trellis body sides summed from their codebook words: keys with integer dot products,
//! values in f32 from the words widened exactly; no float copy of the side.
//!
//! A trellis side is read once per record into 16-bit words, each code's codebook entry in
//! fixed point (`u ~ word * step`, `codec::trellis::codebook_words`). The operand of the keys'
//! sum (the rotated query times the key scales) is rounded once per record and query pair to
//! 16-bit fixed point, `x ~ n 2^e` with `|n| <= 32767`; words are at most `2^13`,
//! so a product stays within `2^28` and eight of them fit an `i32` lane exactly. The value sum
//! (softmax weights times the value steps, which are peaky: one 16-bit part cost 4.6e-4 of the
//! attention output) stays in f32, each word converted exactly. The sums are defined lane by
//! lane, and every instruction set gives the same bits:
//!
//! * keys, `out[t] = sum_c x[c] u[c][t]`: the integer sums of [`KEY_BLOCK`] consecutive
//!   channels, converted to f32 and added in ascending channel order;
//! * values, `out[c] = sum_t x[t] u[c][t]`: lane `j` accumulates tokens `t = j (mod 16)` in
//!   ascending order with fused multiply-adds (`f32::mul_add`), the 16 lanes are then reduced
//!   pairwise ([`pairwise`]) and scaled by the step (a power of two: exact).
//!
//! AVX-512 runs the keys with VNNI `vpdpwssd` (32 words per instruction) and the values with
//! `vfmadd`; the portable loops (auto-vectorised on other levels) define the bits.

use super::fragment_dots::fixed_scale_within;
use super::online_softmax::pairwise;
use super::tile_gemm::MAX_ROWS;
use crate::codec::extension::body::GROUP;
use crate::codec::trellis::WORD_LIMIT;
use crate::simd::Ahead;

/// Largest `|n|` of a fixed-point operand: times a word (`|w| <= 2^13`) within `2^28`.
const OPERAND_LIMIT: f32 = i16::MAX as f32;

// Eight products of an operand and a word fit an i32 lane: the sums below are exact.
const _: () = assert!(8 * (i16::MAX as i64) * (WORD_LIMIT as i64) <= i32::MAX as i64);

/// Channels whose key products one `i32` lane sums exactly before they join the f32 total.
const KEY_BLOCK: usize = 8;

/// Lanes of a value sum (tokens `t = j mod 16`).
const VALUE_LANES: usize = 16;

/// Which implementation of the integer sums runs (all give the same bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WordKernel {
    Portable,
    /// AVX-512: VNNI `vpdpwssd` for keys, `vfmadd` for values.
    Vnni,
}

impl WordKernel {
    /// The fastest kernel the instruction-set level allows.
    pub(crate) fn for_level(level: crate::simd::SimdLevel) -> Self {
        match level {
            crate::simd::SimdLevel::Avx512 if crate::simd::avx512_vnni() => Self::Vnni,
            _ => Self::Portable,
        }
    }

    /// Every kernel this CPU can run (tests).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        let mut all = vec![Self::Portable];
        if crate::simd::avx512() && crate::simd::avx512_vnni() {
            all.push(Self::Vnni);
        }
        all
    }
}

/// Buffers of the word products, reused record after record.
#[derive(Default)]
pub(crate) struct WordScratch {
    n: Vec<i16>,
    lanes: Vec<f32>,
}

/// Rounds `x` to fixed point: `n[i] = round_ties_even(x[i] 2^-e)`, returns `2^e` (NaN for a
/// non-finite row, so its sums come out NaN; 0 for a row of zeros).
#[inline(always)]
fn to_words(x: &[f32], n: &mut [i16]) -> f32 {
    // The largest magnitude as bits (an integer max, which vectorises): at or above the
    // infinity pattern, some entry is not finite.
    let top = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    let finite = top < 0x7f80_0000;
    let m = f32::from_bits(top.min(0x7f7f_ffff));
    let (scale, inv) = fixed_scale_within(m, finite, OPERAND_LIMIT);
    if scale.is_nan() || scale == 0.0 {
        n.fill(0);
        return scale;
    }
    // Integral and finite with |v 2^-e| <= OPERAND_LIMIT (the scale's definition), so the
    // unchecked conversion is exact, and it vectorises where `as` (saturating) does not.
    let whole = |y: f32| {
        let y = y.round_ties_even();
        debug_assert!(y.abs() <= OPERAND_LIMIT);
        // SAFETY: `y` is finite (every entry is, and `inv` is finite) and within i32's range.
        unsafe { y.to_int_unchecked::<i32>() as i16 }
    };
    for (o, &v) in n.iter_mut().zip(x) {
        *o = whole(v * inv);
    }
    scale
}

/// Which sum a call forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WordSum {
    /// `out[s][t] = sum_c x[s][c] u[c][t]`: `x` rows of `r` entries, `g` sums per row.
    Keys,
    /// `out[s][c] = sum_t x[s][t] u[c][t]`: `x` rows of `g` entries, `r` sums per row.
    Values,
}

/// The sums of `operands` float rows `x` (`x_stride` apart) against a trellis side's words
/// (`[r][g]` channel-major, unit value `word * step`), into rows of `out` (`out_stride`
/// apart): each row rounded to fixed point, the integer sums formed as the module says, then
/// scaled by `2^e step`. `ahead` (the next record) is fetched a line per channel step.
/// Inlined into each SIMD level's attention loop.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn word_products(
    kernel: WordKernel,
    sum: WordSum,
    operands: usize,
    x: &[f32],
    x_stride: usize,
    words: &[i16],
    r: usize,
    step: f32,
    sc: &mut WordScratch,
    out: &mut [f32],
    out_stride: usize,
    ahead: &mut Ahead,
) {
    let g = GROUP;
    assert!(
        operands <= MAX_ROWS
            && words.len() >= r * g
            && r.is_multiple_of(VALUE_LANES)
            && r.is_multiple_of(KEY_BLOCK),
        "word operands"
    );
    let (len, cols) = match sum {
        WordSum::Keys => (r, g),
        WordSum::Values => (g, r),
    };
    assert!(
        operands == 0
            || (x.len() >= (operands - 1) * x_stride + len
                && out.len() >= (operands - 1) * out_stride + cols),
        "word operands"
    );
    let mut factor = [step; MAX_ROWS];
    if sum == WordSum::Keys {
        sc.n.resize(operands * len, 0);
        for s in 0..operands {
            let row = &x[s * x_stride..s * x_stride + len];
            factor[s] = to_words(row, &mut sc.n[s * len..(s + 1) * len]) * step;
        }
    }
    let n = &sc.n[..];
    match (kernel, sum) {
        #[cfg(target_arch = "x86_64")]
        (WordKernel::Vnni, WordSum::Keys) => {
            // Passes of at most six rows keep 24 accumulators in registers.
            let passes = operands.div_ceil(6);
            let per = operands.div_ceil(passes.max(1));
            let mut first = 0;
            while first < operands {
                let m = per.min(operands - first);
                let (n, o) = (&n[first * r..], &mut out[first * out_stride..]);
                macro_rules! call {
                    ($m:literal) => {
                        // SAFETY: `Vnni` is only chosen where the CPU reported AVX-512 F/BW
                        // and VNNI; the sizes were checked above.
                        unsafe { vnni::key_sums::<$m>(n, r, words, o, out_stride, ahead) }
                    };
                }
                by_rows!(m, call, [1, 2, 3, 4, 5], 6);
                first += m;
            }
        }
        #[cfg(target_arch = "x86_64")]
        (WordKernel::Vnni, WordSum::Values) => {
            sc.lanes.resize(MAX_ROWS * 8 * VALUE_LANES, 0.0);
            let lanes = &mut sc.lanes[..];
            macro_rules! call {
                ($m:literal, $ch:literal) => {
                    // SAFETY: as above; `lanes` holds 8 vectors of 16 per row.
                    unsafe {
                        vnni::value_sums::<$m, $ch>(
                            x, x_stride, r, words, lanes, out, out_stride, ahead,
                        )
                    }
                };
            }
            match operands {
                0 => {}
                // Accumulators in registers: M * CH of them.
                1 => call!(1, 4),
                2 => call!(2, 4),
                3 => call!(3, 4),
                4 => call!(4, 4),
                5 => call!(5, 4),
                6 => call!(6, 4),
                7 => call!(7, 2),
                _ => call!(8, 2),
            }
        }
        (_, WordSum::Keys) => key_sums_portable(operands, n, r, words, out, out_stride, ahead),
        (_, WordSum::Values) => {
            value_sums_portable(operands, x, x_stride, r, words, out, out_stride, ahead)
        }
    }
    for s in 0..operands {
        for o in &mut out[s * out_stride..s * out_stride + cols] {
            *o *= factor[s];
        }
    }
}

/// Key sums, the portable way: per row, `KEY_BLOCK` channels at a time summed exactly in
/// `i32`, each block's sums added to the f32 totals in channel order.
#[inline(always)]
fn key_sums_portable(
    operands: usize,
    n: &[i16],
    r: usize,
    words: &[i16],
    out: &mut [f32],
    out_stride: usize,
    ahead: &mut Ahead,
) {
    let g = GROUP;
    for s in 0..operands {
        let acc = &mut out[s * out_stride..s * out_stride + g];
        acc.fill(0.0);
        for c0 in (0..r).step_by(KEY_BLOCK) {
            ahead.step();
            let mut block = [0i32; GROUP];
            for c in c0..c0 + KEY_BLOCK {
                let q = n[s * r + c] as i32;
                for (b, &w) in block.iter_mut().zip(&words[c * g..(c + 1) * g]) {
                    *b += q * w as i32;
                }
            }
            for (a, &b) in acc.iter_mut().zip(&block) {
                *a += b as f32;
            }
        }
    }
}

/// Value sums, the portable way: per row and channel, 16 f32 lanes (lane `j`: tokens
/// `t = j mod 16`, ascending, one fused multiply-add each), reduced pairwise.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn value_sums_portable(
    operands: usize,
    x: &[f32],
    x_stride: usize,
    r: usize,
    words: &[i16],
    out: &mut [f32],
    out_stride: usize,
    ahead: &mut Ahead,
) {
    let g = GROUP;
    for s in 0..operands {
        let x = &x[s * x_stride..s * x_stride + g];
        for c in 0..r {
            ahead.step();
            let u = &words[c * g..(c + 1) * g];
            let mut lanes = [0.0f32; VALUE_LANES];
            for (xs, us) in x.chunks_exact(VALUE_LANES).zip(u.chunks_exact(VALUE_LANES)) {
                for j in 0..VALUE_LANES {
                    lanes[j] = xs[j].mul_add(us[j] as f32, lanes[j]);
                }
            }
            // `+ 0.0` as the dot kernel's reduction ends (`tile_gemm::avx512::reduce16`).
            out[s * out_stride + c] = pairwise(&mut lanes) + 0.0;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    //! AVX-512: keys by VNNI `vpdpwssd` on the words as they lie (32 per instruction), values by
    //! `vfmadd` on the words widened to f32.

    // Rows index several accumulator arrays in step; index loops say that more plainly.
    #![allow(clippy::needless_range_loop)]

    use super::{Ahead, GROUP, KEY_BLOCK, VALUE_LANES};
    use crate::attention::tile_gemm::avx512::{add_halves4, add_halves8, reduce16_tail};
    use std::arch::x86_64::*;

    /// Key sums of `M` rows: per 32 tokens, channels `c, c + 1` interleaved word by word
    /// (`vpunpck[lh]wd`), so a 32-bit lane holds one token of both and `vpdpwssd` against the
    /// broadcast pair `(n[c], n[c + 1])` adds their two products. `lo` lanes hold tokens
    /// `8L + i`, `hi` lanes `8L + 4 + i` (`L` the 128-bit block, `i < 4`); two permutes put
    /// them back in token order.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn key_sums<const M: usize>(
        n: &[i16],
        r: usize,
        words: &[i16],
        out: &mut [f32],
        out_stride: usize,
        ahead: &mut Ahead,
    ) {
        let g = GROUP;
        assert!(
            n.len() >= M * r
                && words.len() >= r * g
                && out.len() >= (M - 1) * out_stride + g
                && r.is_multiple_of(KEY_BLOCK)
        );
        let first: [i32; 16] = [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23];
        let second: [i32; 16] = [8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31];
        let first = _mm512_loadu_si512(first.as_ptr() as *const __m512i);
        let second = _mm512_loadu_si512(second.as_ptr() as *const __m512i);
        for t0 in (0..g).step_by(32) {
            let mut f_lo = [_mm512_setzero_ps(); M];
            let mut f_hi = [_mm512_setzero_ps(); M];
            for c0 in (0..r).step_by(KEY_BLOCK) {
                ahead.step();
                let mut i_lo = [_mm512_setzero_si512(); M];
                let mut i_hi = [_mm512_setzero_si512(); M];
                for c in (c0..c0 + KEY_BLOCK).step_by(2) {
                    // SAFETY: rows c and c + 1 hold g words each, t0 + 32 <= g (asserted).
                    let a = _mm512_loadu_si512(words.as_ptr().add(c * g + t0) as *const __m512i);
                    let b =
                        _mm512_loadu_si512(words.as_ptr().add((c + 1) * g + t0) as *const __m512i);
                    let (lo, hi) = (_mm512_unpacklo_epi16(a, b), _mm512_unpackhi_epi16(a, b));
                    for s in 0..M {
                        // SAFETY: entries c, c + 1 of row s (c + 1 < r, M rows asserted).
                        let pair = (n.as_ptr().add(s * r + c) as *const i32).read_unaligned();
                        let q = _mm512_set1_epi32(pair);
                        i_lo[s] = _mm512_dpwssd_epi32(i_lo[s], lo, q);
                        i_hi[s] = _mm512_dpwssd_epi32(i_hi[s], hi, q);
                    }
                }
                for s in 0..M {
                    f_lo[s] = _mm512_add_ps(f_lo[s], _mm512_cvtepi32_ps(i_lo[s]));
                    f_hi[s] = _mm512_add_ps(f_hi[s], _mm512_cvtepi32_ps(i_hi[s]));
                }
            }
            for s in 0..M {
                // SAFETY: 32 sums at t0 of row s (asserted above).
                let o = out.as_mut_ptr().add(s * out_stride + t0);
                _mm512_storeu_ps(o, _mm512_permutex2var_ps(f_lo[s], first, f_hi[s]));
                _mm512_storeu_ps(o.add(16), _mm512_permutex2var_ps(f_lo[s], second, f_hi[s]));
            }
        }
    }

    /// Value sums of `M` rows: per channel, its words 16 at a time widened to f32 (exact) and
    /// multiplied into the row's weights with `vfmadd` (lane `j` takes tokens `j mod 16`, in
    /// ascending order); per 16 channels, the 16 vectors of a row reduced pairwise together by
    /// the dot kernel's transposing tree (`reduce16`), its first steps taken as each group of
    /// `CH` channels is done (one vector per group kept in `lanes`), the rest at the end.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
    pub(super) unsafe fn value_sums<const M: usize, const CH: usize>(
        x: &[f32],
        x_stride: usize,
        r: usize,
        words: &[i16],
        lanes: &mut [f32],
        out: &mut [f32],
        out_stride: usize,
        ahead: &mut Ahead,
    ) {
        let g = GROUP;
        assert!(
            x.len() >= (M - 1) * x_stride + g
                && words.len() >= r * g
                && lanes.len() >= M * 8 * VALUE_LANES
                && out.len() >= (M - 1) * out_stride + r
                && r.is_multiple_of(VALUE_LANES)
                && (CH == 2 || CH == 4)
        );
        for c0 in (0..r).step_by(VALUE_LANES) {
            // CH channels at a time share each load of the weights.
            for ci0 in (0..VALUE_LANES).step_by(CH) {
                for _ in 0..CH {
                    ahead.step();
                }
                let mut acc = [[_mm512_setzero_ps(); M]; CH];
                for t0 in (0..g).step_by(VALUE_LANES) {
                    let u: [__m512; CH] = std::array::from_fn(|k| {
                        let c = c0 + ci0 + k;
                        // SAFETY: row c holds g words, t0 + 16 <= g.
                        let w =
                            _mm256_loadu_si256(words.as_ptr().add(c * g + t0) as *const __m256i);
                        _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(w))
                    });
                    for s in 0..M {
                        // SAFETY: row s of x holds g entries.
                        let xs = _mm512_loadu_ps(x.as_ptr().add(s * x_stride + t0));
                        for k in 0..CH {
                            acc[k][s] = _mm512_fmadd_ps(xs, u[k], acc[k][s]);
                        }
                    }
                }
                // The reduction's first steps at once, so a row keeps one vector per
                // group of channels instead of one per channel: four channels' second-step
                // result (CH = 4), or two channels' first-step result (CH = 2).
                for s in 0..M {
                    let part = if CH == 4 {
                        add_halves4(
                            add_halves8(acc[0][s], acc[1][s]),
                            add_halves8(acc[2][s], acc[3][s]),
                        )
                    } else {
                        add_halves8(acc[0][s], acc[1][s])
                    };
                    // SAFETY: slot ci0 / CH of row s inside `lanes` (asserted; at most 8).
                    let at = lanes.as_mut_ptr().add((s * 8 + ci0 / CH) * VALUE_LANES);
                    _mm512_storeu_ps(at, part);
                }
            }
            for s in 0..M {
                // SAFETY: the row's slots written just above; 16 sums at c0 of row s
                // (asserted above).
                let slot =
                    |i: usize| _mm512_loadu_ps(lanes.as_ptr().add((s * 8 + i) * VALUE_LANES));
                let s2: [__m512; 4] = if CH == 4 {
                    std::array::from_fn(slot)
                } else {
                    std::array::from_fn(|i| add_halves4(slot(2 * i), slot(2 * i + 1)))
                };
                _mm512_storeu_ps(
                    out.as_mut_ptr().add(s * out_stride + c0),
                    reduce16_tail(&s2),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn side(rng: &mut SplitMix64, r: usize) -> Vec<i16> {
        (0..r * GROUP)
            .map(|_| (rng.next_u64() % (2 * WORD_LIMIT as u64 + 1)) as i32 - WORD_LIMIT)
            .map(|w| w as i16)
            .collect()
    }

    /// Extreme operands (every word and entry at its largest magnitude) do not overflow, and
    /// every kernel gives the portable bits for every row count, both sums, both widths.
    #[test]
    fn every_kernel_gives_the_portable_bits() {
        let mut rng = SplitMix64::new(21);
        for r in [64usize, 256] {
            let mut sides = vec![side(&mut rng, r), vec![WORD_LIMIT as i16; r * GROUP]];
            sides.push(sides[0].iter().map(|w| -w.abs()).collect());
            for words in &sides {
                for sum in [WordSum::Keys, WordSum::Values] {
                    let len = if sum == WordSum::Keys { r } else { GROUP };
                    let cols = if sum == WordSum::Keys { GROUP } else { r };
                    for rows in 1..=MAX_ROWS {
                        let mut x: Vec<f32> = rng.gaussians(rows * len);
                        if rows == 2 {
                            x.iter_mut().for_each(|v| *v = -7.25); // all at the limit
                        }
                        let run = |kernel| {
                            let mut out = vec![0f32; rows * cols];
                            let mut sc = WordScratch::default();
                            word_products(
                                kernel,
                                sum,
                                rows,
                                &x,
                                len,
                                words,
                                r,
                                0.5,
                                &mut sc,
                                &mut out,
                                cols,
                                &mut Ahead::new(&[]),
                            );
                            out
                        };
                        let want = run(WordKernel::Portable);
                        for kernel in WordKernel::available() {
                            let got = run(kernel);
                            let same = want
                                .iter()
                                .zip(&got)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{kernel:?} {sum:?} r {r} rows {rows}");
                        }
                    }
                }
            }
        }
    }

    /// The fixed-point sums are the float sums over the word values within the operands'
    /// rounding: at most `|x|_1 * 2^e / 2 * |u|_max` per sum, far below 1e-3 of `|x| |u|`.
    #[test]
    fn word_sums_equal_float_sums_within_the_rounding() {
        let mut rng = SplitMix64::new(5);
        let r = 128;
        let words = side(&mut rng, r);
        let step = 1.0 / 4096.0;
        for sum in [WordSum::Keys, WordSum::Values] {
            let (len, cols) = if sum == WordSum::Keys {
                (r, GROUP)
            } else {
                (GROUP, r)
            };
            let x: Vec<f32> = rng.gaussians(3 * len);
            let mut out = vec![0f32; 3 * cols];
            let mut sc = WordScratch::default();
            let kernel = *WordKernel::available().last().unwrap();
            let ahead = &mut Ahead::new(&[]);
            word_products(
                kernel, sum, 3, &x, len, &words, r, step, &mut sc, &mut out, cols, ahead,
            );
            for s in 0..3 {
                let row = &x[s * len..(s + 1) * len];
                let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
                for j in 0..cols {
                    let u = |i: usize| match sum {
                        WordSum::Keys => words[i * GROUP + j],
                        WordSum::Values => words[j * GROUP + i],
                    } as f64
                        * step as f64;
                    let want: f64 = (0..len).map(|i| row[i] as f64 * u(i)).sum();
                    let u_norm = (0..len).map(|i| u(i) * u(i)).sum::<f64>().sqrt();
                    let err = (out[s * cols + j] as f64 - want).abs();
                    assert!(err <= 2e-4 * norm as f64 * u_norm, "{sum:?} {s} {j}: {err}");
                }
            }
        }
    }

    /// A non-finite operand row gives NaN sums; a zero row gives zeros.
    #[test]
    fn non_finite_rows_give_nan_and_zero_rows_zero() {
        let mut rng = SplitMix64::new(9);
        let r = 64;
        let words = side(&mut rng, r);
        for kernel in WordKernel::available() {
            let mut x = vec![0f32; 2 * r];
            x[r + 3] = f32::INFINITY;
            let mut out = vec![1f32; 2 * GROUP];
            let mut sc = WordScratch::default();
            word_products(
                kernel,
                WordSum::Keys,
                2,
                &x,
                r,
                &words,
                r,
                1.0,
                &mut sc,
                &mut out,
                GROUP,
                &mut Ahead::new(&[]),
            );
            assert!(out[..GROUP].iter().all(|&v| v == 0.0), "{kernel:?}");
            assert!(out[GROUP..].iter().all(|v| v.is_nan()), "{kernel:?}");
        }
    }
}
