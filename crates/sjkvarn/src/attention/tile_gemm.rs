//! The attention's arithmetic kernels, for at most [`MAX_ROWS`] query (row, head) pairs scored
//! together: [`product`], a small matrix product accumulated in registers over tiles of
//! [`TILE`] output columns (body records, value sums), and [`dots`], query rows against key
//! rows stored row by row (sink and ring).
//!
//! Each output element has one fixed summation order (ascending for `product`, 16 lanes then
//! a pairwise reduction for `dots`), each step one fused multiply-add (`f32::mul_add`, one
//! rounding: as fast as a plain multiply where FMA units are the only vector pipes). The
//! portable loops and the AVX-512 kernels follow it exactly, so every SIMD level gives the
//! same bits, and a row's result does not depend on which other rows share the call.

// The kernels index several per-row arrays in step; index loops say that more plainly.
#![allow(clippy::needless_range_loop)]

use super::online_softmax::pairwise;
use crate::simd::SimdLevel;

/// Lanes of the fixed-order dot products: one 16-lane vector.
const LANES: usize = 16;

/// Most rows of `a` in one product.
pub(crate) const MAX_ROWS: usize = 8;

/// Output columns held in registers at once: two 16-lane vectors per row under AVX-512.
const TILE: usize = 32;

/// Elements an operand of `lines` lines of `len` values, `stride` apart, must hold.
#[inline(always)]
fn span(lines: usize, stride: usize, len: usize) -> usize {
    match lines {
        0 => 0,
        n => (n - 1) * stride + len,
    }
}

/// Calls `$kernel::<M>($args)` with `M` the run-time row count (1 to [`MAX_ROWS`]; more
/// are refused by the callers' checks), so each row count gets its own register-resident code.
macro_rules! for_rows {
    ($rows:expr, $($kernel:ident)::+, $($arg:expr),*) => {
        match $rows {
            0 => {}
            1 => $($kernel)::+::<1>($($arg),*),
            2 => $($kernel)::+::<2>($($arg),*),
            3 => $($kernel)::+::<3>($($arg),*),
            4 => $($kernel)::+::<4>($($arg),*),
            5 => $($kernel)::+::<5>($($arg),*),
            6 => $($kernel)::+::<6>($($arg),*),
            7 => $($kernel)::+::<7>($($arg),*),
            _ => $($kernel)::+::<8>($($arg),*),
        }
    };
}

/// `out[s * ldo + j] = sum_{i < inner} a[s * lda + i] * b[i * ldb + j]` for `s < rows`,
/// `j < cols`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(
    level: SimdLevel,
    rows: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    inner: usize,
    cols: usize,
    out: &mut [f32],
    ldo: usize,
) {
    product_from(level, rows, a, lda, b, ldb, inner, cols, out, ldo, false);
}

/// [`product`], each sum starting from `out`'s value when `carry` (else from zero): a product
/// split along `inner` into consecutive calls (the first without `carry`) gives the same bits
/// as one call over the whole range.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_from(
    level: SimdLevel,
    rows: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    inner: usize,
    cols: usize,
    out: &mut [f32],
    ldo: usize,
    carry: bool,
) {
    assert!(
        rows <= MAX_ROWS
            && a.len() >= span(rows, lda, inner)
            && b.len() >= span(inner, ldb, cols)
            && out.len() >= span(rows, ldo, cols),
        "product operands too short"
    );
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Avx512 {
        // SAFETY: `Avx512` is only chosen after the CPU reported AVX-512F; the operand
        // lengths were checked above, which is all the kernel's pointer reads and writes need.
        unsafe {
            for_rows!(
                rows,
                avx512::product_rows,
                a,
                lda,
                b,
                ldb,
                inner,
                cols,
                out,
                ldo,
                carry
            );
        }
        return;
    }
    let _ = level;
    for_rows!(
        rows,
        product_rows,
        a,
        lda,
        b,
        ldb,
        inner,
        cols,
        out,
        ldo,
        carry
    );
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn product_rows<const M: usize>(
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    inner: usize,
    cols: usize,
    out: &mut [f32],
    ldo: usize,
    carry: bool,
) {
    let mut j0 = 0;
    while j0 + TILE <= cols {
        let mut acc = [[0.0f32; TILE]; M];
        if carry {
            for (s, tile) in acc.iter_mut().enumerate() {
                tile.copy_from_slice(&out[s * ldo + j0..s * ldo + j0 + TILE]);
            }
        }
        for i in 0..inner {
            let mut row = [0.0f32; TILE];
            row.copy_from_slice(&b[i * ldb + j0..i * ldb + j0 + TILE]);
            for s in 0..M {
                let x = a[s * lda + i];
                for l in 0..TILE {
                    acc[s][l] = x.mul_add(row[l], acc[s][l]);
                }
            }
        }
        for (s, tile) in acc.iter().enumerate() {
            out[s * ldo + j0..s * ldo + j0 + TILE].copy_from_slice(tile);
        }
        j0 += TILE;
    }
    product_tail::<M>(a, lda, b, ldb, inner, j0, cols, out, ldo, carry);
}

/// Columns `j0..cols` of [`product_rows`], one at a time.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn product_tail<const M: usize>(
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    inner: usize,
    j0: usize,
    cols: usize,
    out: &mut [f32],
    ldo: usize,
    carry: bool,
) {
    for j in j0..cols {
        let mut acc = [0.0f32; M];
        if carry {
            for (s, x) in acc.iter_mut().enumerate() {
                *x = out[s * ldo + j];
            }
        }
        for i in 0..inner {
            let y = b[i * ldb + j];
            for s in 0..M {
                acc[s] = a[s * lda + i].mul_add(y, acc[s]);
            }
        }
        for (s, &x) in acc.iter().enumerate() {
            out[s * ldo + j] = x;
        }
    }
}

/// `out[s * ldo + t] = dot(a[s * lda..][..len], b[t * ldb..][..len])` for `s < rows`,
/// `t < cols`: scores of `rows` query rows against `cols` key rows stored row by row, each in
/// [`dot`]'s order. `len` must be a multiple of 16.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dots(
    level: SimdLevel,
    rows: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    len: usize,
    cols: usize,
    out: &mut [f32],
    ldo: usize,
) {
    assert!(
        rows <= MAX_ROWS
            && len.is_multiple_of(LANES)
            && a.len() >= span(rows, lda, len)
            && b.len() >= span(cols, ldb, len)
            && out.len() >= span(rows, ldo, cols),
        "dots operands too short"
    );
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Avx512 {
        // SAFETY: `Avx512` is only chosen after the CPU reported AVX-512F; the operand
        // lengths were checked above, which is all the kernel's pointer reads and writes need.
        unsafe {
            for_rows!(rows, avx512::dots_rows, a, lda, b, ldb, len, cols, out, ldo);
        }
        return;
    }
    let _ = level;
    for t in 0..cols {
        let key = &b[t * ldb..t * ldb + len];
        for s in 0..rows {
            out[s * ldo + t] = dot(&a[s * lda..s * lda + len], key);
        }
    }
}

/// Dot product in a fixed order: 16 lane sums over ascending 16-element chunks, a pairwise
/// reduction (lanes `l` and `l + 8`, then `l + 4`, `l + 2`, `l + 1`), then the remainder's
/// ascending sum added last. Every caller and SIMD level uses this order.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let mut tail = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = x.mul_add(*y, tail);
    }
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            lanes[l] = x[l].mul_add(y[l], lanes[l]);
        }
    }
    pairwise(&mut lanes) + tail
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    /// [`super::product_rows`] with the tile's accumulators in registers: `2 * M` vectors of 16
    /// columns, one fused multiply-add per product, in the same order per element.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, and the operands must be as long as [`super::product`]
    /// checks.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn product_rows<const M: usize>(
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: usize,
        inner: usize,
        cols: usize,
        out: &mut [f32],
        ldo: usize,
        carry: bool,
    ) {
        let (ap, bp, op) = (a.as_ptr(), b.as_ptr(), out.as_mut_ptr());
        let mut j0 = 0;
        while j0 + 32 <= cols {
            let mut lo = [_mm512_setzero_ps(); M];
            let mut hi = [_mm512_setzero_ps(); M];
            if carry {
                for s in 0..M {
                    // SAFETY: the start values are read where the results are stored below.
                    lo[s] = _mm512_loadu_ps(op.add(s * ldo + j0));
                    hi[s] = _mm512_loadu_ps(op.add(s * ldo + j0 + 16));
                }
            }
            for i in 0..inner {
                // SAFETY (all pointer reads and writes here): `i < inner`, `j0 + 32 <= cols`
                // and `s < M` keep every offset inside the lengths `product` checked.
                let row = bp.add(i * ldb + j0);
                let (b0, b1) = (_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16)));
                for s in 0..M {
                    let x = _mm512_set1_ps(*ap.add(s * lda + i));
                    lo[s] = _mm512_fmadd_ps(x, b0, lo[s]);
                    hi[s] = _mm512_fmadd_ps(x, b1, hi[s]);
                }
            }
            for s in 0..M {
                _mm512_storeu_ps(op.add(s * ldo + j0), lo[s]);
                _mm512_storeu_ps(op.add(s * ldo + j0 + 16), hi[s]);
            }
            j0 += 32;
        }
        while j0 + 16 <= cols {
            let mut lo = [_mm512_setzero_ps(); M];
            if carry {
                for s in 0..M {
                    // SAFETY: as above.
                    lo[s] = _mm512_loadu_ps(op.add(s * ldo + j0));
                }
            }
            for i in 0..inner {
                let b0 = _mm512_loadu_ps(bp.add(i * ldb + j0));
                for s in 0..M {
                    let x = _mm512_set1_ps(*ap.add(s * lda + i));
                    lo[s] = _mm512_fmadd_ps(x, b0, lo[s]);
                }
            }
            for s in 0..M {
                _mm512_storeu_ps(op.add(s * ldo + j0), lo[s]);
            }
            j0 += 16;
        }
        super::product_tail::<M>(a, lda, b, ldb, inner, j0, cols, out, ldo, carry);
    }

    /// [`super::dot`]'s order for `M` query rows at once: each 16-value chunk of a key row is
    /// loaded once and multiplied with every query row.
    ///
    /// # Safety
    /// As [`product_rows`], with the lengths [`super::dots`] checks.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn dots_rows<const M: usize>(
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: usize,
        len: usize,
        cols: usize,
        out: &mut [f32],
        ldo: usize,
    ) {
        let (ap, bp, op) = (a.as_ptr(), b.as_ptr(), out.as_mut_ptr());
        // The lane sums of key row `t` for every query row.
        let lanes = |t: usize| -> [__m512; M] {
            let mut acc = [_mm512_setzero_ps(); M];
            let mut c = 0;
            while c < len {
                // SAFETY (all pointer reads here): `t < cols`, `c + 16 <= len` and `s < M`
                // keep every offset inside the lengths `dots` checked.
                let key = _mm512_loadu_ps(bp.add(t * ldb + c));
                for s in 0..M {
                    let q = _mm512_loadu_ps(ap.add(s * lda + c));
                    acc[s] = _mm512_fmadd_ps(q, key, acc[s]);
                }
                c += 16;
            }
            acc
        };
        // Sixteen key rows at a time: their lane sums reduced together ([`reduce16`]).
        let mut t = 0;
        while t + 16 <= cols {
            let mut block = [[_mm512_setzero_ps(); 16]; M];
            for u in 0..16 {
                let acc = lanes(t + u);
                for s in 0..M {
                    block[s][u] = acc[s];
                }
            }
            for (s, rows) in block.iter().enumerate() {
                // SAFETY: 16 outputs at `s * ldo + t`, `t + 16 <= cols`.
                _mm512_storeu_ps(op.add(s * ldo + t), reduce16(rows));
            }
            t += 16;
        }
        for t in t..cols {
            let acc = lanes(t);
            for s in 0..M {
                // SAFETY: as above.
                *op.add(s * ldo + t) = reduce(acc[s]);
            }
        }
    }

    /// [`reduce`] of 16 vectors at once, lane `j` of the result from vector `j`: each
    /// halving step adds the same lanes as `reduce` does (`l + 8`, `l + 4`, `l + 2`, `l + 1`),
    /// two vectors' halves packed into one register, so the bits are `reduce`'s.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) unsafe fn reduce16(x: &[__m512; 16]) -> __m512 {
        let s1: [__m512; 8] = std::array::from_fn(|i| add_halves8(x[2 * i], x[2 * i + 1]));
        let s2: [__m512; 4] = std::array::from_fn(|i| add_halves4(s1[2 * i], s1[2 * i + 1]));
        reduce16_tail(&s2)
    }

    /// [`reduce16`]'s first step for vectors `2i`, `2i + 1` (`a`, `b`): lanes `l` and `l + 8`
    /// of each added, the two results as one register of two 8-lane halves. Callers that
    /// finish vectors a few at a time take the first steps as they go.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) unsafe fn add_halves8(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    }

    /// [`reduce16`]'s second step for first-step results `2i`, `2i + 1`: lanes `l` and
    /// `l + 4`, one 128-bit lane per original vector.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) unsafe fn add_halves4(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    }

    /// [`reduce16`] from its four second-step results: lanes `l` and `l + 2`, then `l` and
    /// `l + 1`, inside 128-bit lanes, and the sums put in vector order.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) unsafe fn reduce16_tail(s2: &[__m512; 4]) -> __m512 {
        let s3: [__m512; 2] = std::array::from_fn(|i| {
            let (a, b) = (s2[2 * i], s2[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(a, b),
                _mm512_shuffle_ps::<0xEE>(a, b),
            )
        });
        let (a, b) = (s3[0], s3[1]);
        let s4 = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(a, b),
            _mm512_shuffle_ps::<0xDD>(a, b),
        );
        // Lane 4k + m holds vector 4m + k; `+ 0.0` as `reduce` ends.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_add_ps(_mm512_permutexvar_ps(order, s4), _mm512_setzero_ps())
    }

    /// The pairwise lane reduction of [`super::dot`] (the remainder is empty here).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn reduce(x: __m512) -> f32 {
        let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)));
        let x8 = _mm256_add_ps(_mm512_castps512_ps256(x), high);
        let x4 = _mm_add_ps(_mm256_castps256_ps128(x8), _mm256_extractf128_ps::<1>(x8));
        let x2 = _mm_add_ps(x4, _mm_movehl_ps(x4, x4));
        let x1 = _mm_add_ss(x2, _mm_shuffle_ps::<1>(x2, x2));
        _mm_cvtss_f32(x1) + 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use crate::simd::detected_level;

    /// Each element equals the plain ascending sum, whatever the row count, column tail or
    /// SIMD level.
    #[test]
    fn product_is_the_ascending_sum() {
        let mut rng = SplitMix64::new(3);
        for level in [SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512] {
            if level > detected_level() {
                continue;
            }
            check_level(level, &mut rng);
        }
    }

    /// `dots` equals `dot` row by row at every level.
    #[test]
    fn dots_follow_dot() {
        let mut rng = SplitMix64::new(4);
        for level in [SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512] {
            if level > detected_level() {
                continue;
            }
            for rows in 1..=MAX_ROWS {
                for (len, cols) in [(16usize, 1usize), (64, 37), (256, 128)] {
                    let a = rng.gaussians(rows * (len + 5));
                    let b = rng.gaussians(cols * (len + 2));
                    let mut out = vec![f32::NAN; rows * (cols + 1)];
                    dots(
                        level,
                        rows,
                        &a,
                        len + 5,
                        &b,
                        len + 2,
                        len,
                        cols,
                        &mut out,
                        cols + 1,
                    );
                    for s in 0..rows {
                        for t in 0..cols {
                            let want = dot(&a[s * (len + 5)..][..len], &b[t * (len + 2)..][..len]);
                            let got = out[s * (cols + 1) + t];
                            assert_eq!(want.to_bits(), got.to_bits(), "{level:?} {rows}x{len}");
                        }
                    }
                }
            }
        }
    }

    /// A product split along `inner` into `product_from` calls carrying their sums gives the
    /// bits of one call, at every level and for any split points.
    #[test]
    fn a_product_continued_in_pieces_is_the_whole_product() {
        let mut rng = SplitMix64::new(6);
        for level in [SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512] {
            if level > detected_level() {
                continue;
            }
            for rows in 1..=MAX_ROWS {
                let (inner, cols) = (128usize, 80usize);
                let a = rng.gaussians(rows * inner);
                let b = rng.gaussians(inner * cols);
                let mut whole = vec![0.0f32; rows * cols];
                product(
                    level, rows, &a, inner, &b, cols, inner, cols, &mut whole, cols,
                );
                for step in [1usize, 16, 37, 100] {
                    let mut pieces = vec![f32::NAN; rows * cols];
                    for i0 in (0..inner).step_by(step) {
                        let n = step.min(inner - i0);
                        let (a, b) = (&a[i0..], &b[i0 * cols..]);
                        let (carry, out) = (i0 > 0, &mut pieces);
                        product_from(level, rows, a, inner, b, cols, n, cols, out, cols, carry);
                    }
                    let same = whole
                        .iter()
                        .zip(&pieces)
                        .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{level:?}, {rows} rows, pieces of {step}");
                }
            }
        }
    }

    fn check_level(level: SimdLevel, rng: &mut SplitMix64) {
        for rows in 1..=MAX_ROWS {
            for (inner, cols) in [(1usize, 32usize), (37, 128), (128, 64), (5, 45)] {
                let lda = inner + 7;
                let a = rng.gaussians(rows * lda);
                let b = rng.gaussians(inner * (cols + 3));
                let mut out = vec![f32::NAN; rows * (cols + 1)];
                product(
                    level,
                    rows,
                    &a,
                    lda,
                    &b,
                    cols + 3,
                    inner,
                    cols,
                    &mut out,
                    cols + 1,
                );
                for s in 0..rows {
                    for j in 0..cols {
                        let mut want = 0.0f32;
                        for i in 0..inner {
                            want = a[s * lda + i].mul_add(b[i * (cols + 3) + j], want);
                        }
                        let got = out[s * (cols + 1) + j];
                        assert_eq!(want.to_bits(), got.to_bits(), "{level:?} {rows}x{cols}");
                    }
                }
            }
        }
    }
}
