//! Body records' 4-bit sides scored straight from their packed fragment tiles with integer dot
//! products: no unpacked copy of the codes, no int-to-float conversion per code.
//!
//! The float operand of a sum (the rotated query times the key scales, or the softmax weights
//! times the value steps) is rounded once per record and query pair to 16-bit fixed point,
//! `x[i] ~ n[i] 2^e` with `|n[i]| <= 32512` (a relative step of 1/32512 of its largest entry,
//! far below the 4-bit codes' own rounding), and `sum_i n[i] u[i]` over the codes is then exact
//! in `i32`. Exact sums do not depend on their order, so every instruction set gives the same
//! bits: the portable loop sums `n * u` directly; AVX-512 VNNI splits `n = 256 hi + lo` into two
//! signed bytes and runs `vpdpbusd` (64 byte products per instruction) on the nibbles as they
//! lie in the record.
//!
//! Fragment tiles (docs/formats.md): a 16x16 tile is 32 little-endian words; word `4b + a`,
//! nibble `j` holds row `2a + 8((j >> 1) & 1) + (j >> 2)`, column `8(j & 1) + b`. Keys' rows
//! are channels and columns tokens; values' rows are tokens and columns channels. Both sums run
//! over rows, so one kernel serves both: byte `k` of word `4b + a` holds, in its low nibble,
//! rows `2a + 8(k & 1) + (k >> 1)` of column `b` and, in its high nibble, the same rows of
//! column `8 + b`: four rows per 32-bit lane, which is what one `vpdpbusd` lane sums.

use super::online_softmax::lane_sum;
use crate::simd::Ahead;

/// Largest `|n|` of a fixed-point operand: `hi = (n + 128) >> 8` stays a signed byte.
const FIXED_LIMIT: f32 = 32512.0;

/// Operands whose largest entry is below this are taken as zero (their products are below
/// `2^-96` of a code, and the exponent stays inside f32's normal range).
const FIXED_FLOOR: f32 = 1.0 / (1u128 << 100) as f32;

/// Rows and columns of a fragment tile.
pub(crate) const TILE: usize = 16;

/// Bytes of a fragment tile.
const TILE_BYTES: usize = TILE * TILE / 2;

/// The scale `2^e` of a fixed-point operand whose largest magnitude is `m`, and `2^-e`: the
/// largest `e` with `m 2^-e <= FIXED_LIMIT`. `(NaN, 0)` for a non-finite operand (the sums
/// come out NaN, as float arithmetic would give), `(0, 0)` below [`FIXED_FLOOR`].
fn fixed_scale(m: f32, finite: bool) -> (f32, f32) {
    fixed_scale_within(m, finite, FIXED_LIMIT)
}

/// [`fixed_scale`] for a largest `|n|` of `limit` (at least 2).
pub(crate) fn fixed_scale_within(m: f32, finite: bool, limit: f32) -> (f32, f32) {
    if !finite || !m.is_finite() {
        return (f32::NAN, 0.0);
    }
    if m < FIXED_FLOOR {
        return (0.0, 0.0);
    }
    // m = 1.f 2^E; e = E - L (2^L <= limit < 2^(L+1)) puts m 2^-e in [2^L, 2^(L+1)); one
    // more if above the limit.
    let exp = ((m.to_bits() >> 23) & 0xff) as i32 - 127;
    let mut e = exp - (limit as u32).ilog2() as i32;
    if m * pow2(-e) > limit {
        e += 1;
    }
    (pow2(e), pow2(-e))
}

/// `2^e` for `e` inside f32's normal exponents.
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Rounds `x` to fixed point: writes `n[i] = round_ties_even(x[i] 2^-e)` and returns `2^e`
/// and `sum_i n[i]`.
pub(crate) fn to_fixed(x: &[f32], n: &mut [i32]) -> (f32, i32) {
    let finite = x.iter().all(|v| v.is_finite());
    let m = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (scale, inv) = fixed_scale(m, finite);
    let mut total = 0i32;
    for (o, &v) in n.iter_mut().zip(x) {
        *o = if scale > 0.0 {
            (v * inv).round_ties_even() as i32
        } else {
            0
        };
        total += *o;
    }
    (scale, total)
}

/// Where a side's tiles lie: tile `(col, row)` (column tile `col` of the output, row tile
/// `row` of the sum) starts at byte `(col * col_stride + row * row_stride) * 128` of the
/// payload. Keys: columns are token tiles (`D / 16` tiles apart), rows channel tiles
/// (consecutive); values: columns are channel tiles (consecutive), rows token tiles.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TileGrid {
    pub cols: usize,
    pub rows: usize,
    pub col_stride: usize,
    pub row_stride: usize,
}

impl TileGrid {
    fn tile<'a>(&self, payload: &'a [u8], col: usize, row: usize) -> &'a [u8] {
        let at = (col * self.col_stride + row * self.row_stride) * TILE_BYTES;
        &payload[at..at + TILE_BYTES]
    }

    /// What the SIMD kernels read and write is inside their buffers: every tile of the grid,
    /// `m` byte operands (`hi` and `lo`, lengths `operand_lens`) of `rows * 16` bytes `stride`
    /// apart, and `m` rows of `cols * 16` sums `out_stride` apart.
    #[cfg(target_arch = "x86_64")]
    fn check_operands(
        &self,
        payload: &[u8],
        m: usize,
        operand_lens: [usize; 2],
        stride: usize,
        out_len: usize,
        out_stride: usize,
    ) {
        self.check(payload);
        let need = |stride: usize, len: usize| (m.max(1) - 1) * stride + len;
        assert!(
            m > 0
                && operand_lens
                    .iter()
                    .all(|&l| l >= need(stride, self.rows * TILE))
                && out_len >= need(out_stride, self.cols * TILE),
            "fragment operands"
        );
    }

    /// The payload must hold every tile of the grid.
    fn check(&self, payload: &[u8]) {
        if self.cols > 0 && self.rows > 0 {
            let last = (self.cols - 1) * self.col_stride + (self.rows - 1) * self.row_stride;
            assert!(payload.len() >= (last + 1) * TILE_BYTES, "fragment grid");
        }
    }
}

/// `out[s][c] = sum_r n[s][r] u[r][c]` over the grid's codes (`out` holds `cols * 16` sums
/// per operand, `n` holds `rows * 16` entries per operand, `stride` apart), the portable way.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fragment_dots_portable(
    payload: &[u8],
    grid: TileGrid,
    operands: usize,
    n: &[i32],
    stride: usize,
    out: &mut [i32],
    ahead: &mut Ahead,
) {
    grid.check(payload);
    let mut codes = [[0u8; TILE]; TILE];
    for col in 0..grid.cols {
        let mut acc = [[0i32; TILE]; crate::attention::tile_gemm::MAX_ROWS];
        for row in 0..grid.rows {
            ahead.step();
            unpack_tile(grid.tile(payload, col, row), &mut codes);
            for (s, acc) in acc.iter_mut().enumerate().take(operands) {
                let q = &n[s * stride + row * TILE..s * stride + (row + 1) * TILE];
                for (r, line) in codes.iter().enumerate() {
                    for (a, &u) in acc.iter_mut().zip(line) {
                        *a += q[r] * u as i32;
                    }
                }
            }
        }
        for (s, acc) in acc.iter().enumerate().take(operands) {
            out[s * grid.cols * TILE + col * TILE..][..TILE].copy_from_slice(acc);
        }
    }
}

/// One tile's codes as `[row][column]`.
fn unpack_tile(bytes: &[u8], codes: &mut [[u8; TILE]; TILE]) {
    for (w, word) in bytes.chunks_exact(4).enumerate() {
        let word = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        let (b, a) = (w / 4, w % 4);
        for j in 0..8 {
            let row = 2 * a + 8 * ((j >> 1) & 1) + (j >> 2);
            codes[row][8 * (j & 1) + b] = ((word >> (4 * j)) & 15) as u8;
        }
    }
}

/// Which implementation of the integer sums runs (all give the same bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FragmentKernel {
    Portable,
    /// 256-bit `vpmaddubsw` + `vpmaddwd`: AVX2 CPUs, and AVX-512 ones without VNNI.
    Avx2,
    /// 512-bit `vpdpbusd`.
    Vnni,
}

impl FragmentKernel {
    /// The fastest kernel the instruction-set level allows.
    pub(crate) fn for_level(level: crate::simd::SimdLevel) -> Self {
        use crate::simd::SimdLevel;
        match level {
            SimdLevel::Avx512 if crate::simd::avx512_vnni() => Self::Vnni,
            SimdLevel::Avx512 | SimdLevel::Avx2 if cfg!(target_arch = "x86_64") => Self::Avx2,
            _ => Self::Portable,
        }
    }
}

/// Buffers of [`fragment_products`], reused record after record.
#[derive(Default)]
pub(crate) struct FragmentScratch {
    n: Vec<i32>,
    hi: Vec<u8>,
    lo: Vec<u8>,
    sums: Vec<i32>,
}

/// `out[s * out_stride + c] ~ sum_r x_s[r] u[r][c]` for the `operands` float rows of `x`
/// (`x_stride` apart, `grid.rows * 16` entries used): the product a body record's 4-bit side
/// contributes, straight from its fragment tiles. Each row is rounded to fixed point
/// ([`to_fixed`]) and the codes centred on 7.5, so the rounding meets only `u - 7.5`: the
/// product is `2^e sum_r n[r] (u[r][c] - 7.5) + 7.5 sum_r x[r]`, the first sum exact in
/// integers (`(2 S - 15 N) 2^(e-1)`), the second a fixed-order float sum. Centring halves the
/// rounding's reach (codes sit around 7.5). The same bits with or without VNNI.
// Inlined into each SIMD level's attention loop, so its float loops get that level's vectors.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn fragment_products(
    kernel: FragmentKernel,
    payload: &[u8],
    grid: TileGrid,
    operands: usize,
    x: &[f32],
    x_stride: usize,
    sc: &mut FragmentScratch,
    out: &mut [f32],
    out_stride: usize,
    ahead: &mut Ahead,
) {
    let (len, cols) = (grid.rows * TILE, grid.cols * TILE);
    assert!(
        operands <= crate::attention::tile_gemm::MAX_ROWS,
        "fragment operands"
    );
    let mut scales = [0.0f32; crate::attention::tile_gemm::MAX_ROWS];
    let mut totals = [0i32; crate::attention::tile_gemm::MAX_ROWS];
    sc.sums.resize(operands * cols, 0);
    #[cfg(target_arch = "x86_64")]
    if kernel != FragmentKernel::Portable {
        sc.hi.resize(operands * len, 0);
        sc.lo.resize(operands * len, 0);
        for s in 0..operands {
            let row = &x[s * x_stride..s * x_stride + len];
            let (hi, lo) = (&mut sc.hi[s * len..][..len], &mut sc.lo[s * len..][..len]);
            // SAFETY: the kernel is only chosen where `simd` reported its features (AVX-512
            // implies AVX2); the byte buffers hold `len` entries.
            (scales[s], totals[s]) = unsafe {
                match kernel {
                    FragmentKernel::Vnni => vnni::to_fixed_bytes(row, hi, lo),
                    _ => avx2::to_fixed_bytes(row, hi, lo),
                }
            };
        }
        // Passes of at most MAX_OPERANDS keep the accumulators in registers.
        let most = match kernel {
            FragmentKernel::Vnni => vnni::MAX_OPERANDS,
            _ => avx2::MAX_OPERANDS,
        };
        let passes = operands.div_ceil(most);
        let per = operands.div_ceil(passes.max(1));
        let mut first = 0;
        while first < operands {
            let m = per.min(operands - first);
            let (hi, lo) = (&sc.hi[first * len..], &sc.lo[first * len..]);
            let sums = &mut sc.sums[first * cols..];
            macro_rules! call {
                ($m:literal) => {
                    // SAFETY: as above; the operand and sum buffers hold `m` rows.
                    unsafe {
                        if kernel == FragmentKernel::Vnni {
                            vnni::fragment_dots::<$m>(payload, grid, hi, lo, len, sums, cols, ahead)
                        } else {
                            avx2::fragment_dots::<$m>(payload, grid, hi, lo, len, sums, cols, ahead)
                        }
                    }
                };
            }
            by_rows!(m, call, [1, 2, 3, 4, 5], 6);
            first += m;
        }
    }
    if kernel == FragmentKernel::Portable || cfg!(not(target_arch = "x86_64")) {
        sc.n.resize(operands * len, 0);
        for s in 0..operands {
            let row = &x[s * x_stride..s * x_stride + len];
            (scales[s], totals[s]) = to_fixed(row, &mut sc.n[s * len..(s + 1) * len]);
        }
        fragment_dots_portable(payload, grid, operands, &sc.n, len, &mut sc.sums, ahead);
    }
    for s in 0..operands {
        let sums = &sc.sums[s * cols..(s + 1) * cols];
        let (half, centre) = (0.5 * scales[s], 7.5 * lane_sum(&x[s * x_stride..][..len]));
        let shift = 15 * totals[s];
        for (o, &v) in out[s * out_stride..s * out_stride + cols]
            .iter_mut()
            .zip(sums)
        {
            *o = (2 * v - shift) as f32 * half + centre;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod vnni {
    //! AVX-512 VNNI: the operands as two signed bytes each, in the tiles' row order, and
    //! `vpdpbusd` straight on the packed nibbles.

    use super::{fixed_scale, TileGrid, TILE, TILE_BYTES};
    use crate::simd::Ahead;
    use std::arch::x86_64::*;

    /// Operands per kernel call: 4 accumulators each, plus the codes, stay in registers.
    pub(crate) const MAX_OPERANDS: usize = 6;

    /// Byte `4a + k` of a 16-row group takes row `2a + 8(k & 1) + (k >> 1)`: the rows a
    /// fragment word's byte `k` holds, so one 32-bit lane meets its four rows.
    pub(super) const ROW_ORDER: [i8; 16] = {
        let mut p = [0i8; 16];
        let mut i = 0;
        while i < 16 {
            let (a, k) = (i / 4, i % 4);
            p[i] = (2 * a + 8 * (k & 1) + (k >> 1)) as i8;
            i += 1;
        }
        p
    };

    /// [`super::to_fixed`] for AVX-512: the same `n` (one exact multiply by `2^-e` and a
    /// round to nearest even), written as `hi = (n + 128) >> 8` and `lo = n - 256 hi` bytes in
    /// [`ROW_ORDER`] within each group of 16. `x.len()` must be a multiple of 16.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL; `hi` and `lo` must hold `x.len()` bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn to_fixed_bytes(x: &[f32], hi: &mut [u8], lo: &mut [u8]) -> (f32, i32) {
        assert!(x.len().is_multiple_of(TILE) && hi.len() >= x.len() && lo.len() >= x.len());
        let mut most = _mm512_setzero_ps();
        let mut bad: __mmask16 = 0;
        for chunk in x.chunks_exact(TILE) {
            // SAFETY: 16 floats in `chunk`.
            let v = _mm512_loadu_ps(chunk.as_ptr());
            most = _mm512_max_ps(most, _mm512_abs_ps(v));
            // Not finite: |v| is not below infinity (NaN compares unordered, hence false).
            bad |=
                !_mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(v), _mm512_set1_ps(f32::INFINITY));
        }
        let (scale, inv) = fixed_scale(_mm512_reduce_max_ps(most), bad == 0);
        let order = _mm_loadu_si128(ROW_ORDER.as_ptr() as *const __m128i);
        let inv = _mm512_set1_ps(if scale > 0.0 { inv } else { 0.0 });
        let mut total = _mm512_setzero_si512();
        for (g, chunk) in x.chunks_exact(TILE).enumerate() {
            // SAFETY: 16 floats in `chunk`; 16 bytes at `16 g` of `hi` and `lo` (checked).
            let n = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(chunk.as_ptr()), inv));
            total = _mm512_add_epi32(total, n);
            let h = _mm512_srai_epi32::<8>(_mm512_add_epi32(n, _mm512_set1_epi32(128)));
            let l = _mm512_sub_epi32(n, _mm512_slli_epi32::<8>(h));
            let (h, l) = (_mm512_cvtepi32_epi8(h), _mm512_cvtepi32_epi8(l));
            let (h, l) = (_mm_shuffle_epi8(h, order), _mm_shuffle_epi8(l, order));
            _mm_storeu_si128(hi.as_mut_ptr().add(g * TILE) as *mut __m128i, h);
            _mm_storeu_si128(lo.as_mut_ptr().add(g * TILE) as *mut __m128i, l);
        }
        (scale, _mm512_reduce_add_epi32(total))
    }

    /// [`super::fragment_dots_portable`] for `M` operands (bytes from [`to_fixed_bytes`],
    /// `stride` apart; sums `cols * 16` per operand, `out_stride` apart).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL and VNNI; `hi`/`lo` must hold `M` operands of
    /// `grid.rows * 16` bytes and `out` `M` rows of `grid.cols * 16` sums.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn fragment_dots<const M: usize>(
        payload: &[u8],
        grid: TileGrid,
        hi: &[u8],
        lo: &[u8],
        stride: usize,
        out: &mut [i32],
        out_stride: usize,
        ahead: &mut Ahead,
    ) {
        grid.check_operands(
            payload,
            M,
            [hi.len(), lo.len()],
            stride,
            out.len(),
            out_stride,
        );
        let nibble = _mm512_set1_epi8(15);
        // Lanes (b, a) -> [column b of each 128-bit lane, then column 8 + b]: lane 4b' of the
        // summed low and high vectors, interleaved by `unpack`, picked in column order.
        let pick = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        let (hp, lp, op) = (hi.as_ptr(), lo.as_ptr(), out.as_mut_ptr());
        for col in 0..grid.cols {
            for half in 0..2 {
                let zero = _mm512_setzero_si512();
                let (mut hl, mut ll, mut hh, mut lh) = ([zero; M], [zero; M], [zero; M], [zero; M]);
                for row in 0..grid.rows {
                    ahead.step();
                    let at = (col * grid.col_stride + row * grid.row_stride) * TILE_BYTES;
                    // SAFETY (all reads here): `grid.check` and the asserts above bound every
                    // tile, operand and sum offset.
                    let w = _mm512_loadu_si512(payload.as_ptr().add(at + 64 * half) as *const _);
                    let low = _mm512_and_si512(w, nibble);
                    let high = _mm512_and_si512(_mm512_srli_epi32::<4>(w), nibble);
                    for s in 0..M {
                        let h = _mm512_broadcast_i32x4(_mm_loadu_si128(
                            hp.add(s * stride + row * TILE) as *const __m128i,
                        ));
                        let l = _mm512_broadcast_i32x4(_mm_loadu_si128(
                            lp.add(s * stride + row * TILE) as *const __m128i,
                        ));
                        hl[s] = _mm512_dpbusd_epi32(hl[s], low, h);
                        ll[s] = _mm512_dpbusd_epi32(ll[s], low, l);
                        hh[s] = _mm512_dpbusd_epi32(hh[s], high, h);
                        lh[s] = _mm512_dpbusd_epi32(lh[s], high, l);
                    }
                }
                for s in 0..M {
                    // n = 256 hi + lo, then the four row lanes (a) of each column summed.
                    let x = _mm512_add_epi32(_mm512_slli_epi32::<8>(hl[s]), ll[s]);
                    let y = _mm512_add_epi32(_mm512_slli_epi32::<8>(hh[s]), lh[s]);
                    let t =
                        _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y));
                    let t = _mm512_add_epi32(t, _mm512_shuffle_epi32::<0b01_00_11_10>(t));
                    let t = _mm512_permutexvar_epi32(pick, t);
                    let o = op.add(s * out_stride + col * TILE + 4 * half);
                    _mm_storeu_si128(o as *mut __m128i, _mm512_castsi512_si128(t));
                    _mm_storeu_si128(o.add(8) as *mut __m128i, _mm512_extracti32x4_epi32::<1>(t));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! AVX2: the VNNI kernel's layout with 256-bit registers (two fragment words' columns per
    //! register), each byte dot product as `vpmaddubsw` (two u8 x s8 products, at most 3840 in
    //! magnitude: no saturation) then `vpmaddwd` by 256 (the high byte) or 1 (the low byte).

    use super::{fixed_scale, vnni::ROW_ORDER, TileGrid, TILE, TILE_BYTES};
    use crate::simd::Ahead;
    use std::arch::x86_64::*;

    /// Operands per kernel call: 2 accumulators each in 16 registers.
    pub(crate) const MAX_OPERANDS: usize = 3;

    /// 16 i32 lanes (two registers) as 16 bytes in order (values must fit a signed byte).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn bytes16(a: __m256i, b: __m256i) -> __m128i {
        let words = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(a, b));
        let bytes = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi16(words, words));
        _mm256_castsi256_si128(bytes)
    }

    /// [`super::vnni::to_fixed_bytes`] with AVX2: the same `n`, `hi`, `lo` and sum.
    ///
    /// # Safety
    /// The CPU must have AVX2; `hi` and `lo` must hold `x.len()` bytes.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn to_fixed_bytes(x: &[f32], hi: &mut [u8], lo: &mut [u8]) -> (f32, i32) {
        assert!(x.len().is_multiple_of(TILE) && hi.len() >= x.len() && lo.len() >= x.len());
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (mut most, mut bad) = (_mm256_setzero_ps(), 0);
        for chunk in x.chunks_exact(8) {
            // SAFETY: 8 floats in `chunk`.
            let a = _mm256_and_ps(_mm256_loadu_ps(chunk.as_ptr()), magnitude);
            most = _mm256_max_ps(most, a);
            // Not below infinity: infinite or NaN.
            bad |= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(
                a,
                _mm256_set1_ps(f32::INFINITY),
            ));
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), most);
        let m = lanes.iter().fold(0.0f32, |m, &v| m.max(v));
        let (scale, inv) = fixed_scale(m, bad == 0);
        let order = _mm_loadu_si128(ROW_ORDER.as_ptr() as *const __m128i);
        let inv = _mm256_set1_ps(if scale > 0.0 { inv } else { 0.0 });
        let (round, total) = (_mm256_set1_epi32(128), &mut _mm256_setzero_si256());
        let split = |n: __m256i| {
            let h = _mm256_srai_epi32::<8>(_mm256_add_epi32(n, round));
            (h, _mm256_sub_epi32(n, _mm256_slli_epi32::<8>(h)))
        };
        for (g, chunk) in x.chunks_exact(TILE).enumerate() {
            // SAFETY: 16 floats in `chunk`; 16 bytes at `16 g` of `hi` and `lo` (checked).
            let n0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(chunk.as_ptr()), inv));
            let n1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(chunk.as_ptr().add(8)), inv));
            *total = _mm256_add_epi32(*total, _mm256_add_epi32(n0, n1));
            let ((h0, l0), (h1, l1)) = (split(n0), split(n1));
            let (h, l) = (bytes16(h0, h1), bytes16(l0, l1));
            _mm_storeu_si128(
                hi.as_mut_ptr().add(g * TILE) as *mut __m128i,
                _mm_shuffle_epi8(h, order),
            );
            _mm_storeu_si128(
                lo.as_mut_ptr().add(g * TILE) as *mut __m128i,
                _mm_shuffle_epi8(l, order),
            );
        }
        let mut sums = [0i32; 8];
        _mm256_storeu_si256(sums.as_mut_ptr() as *mut __m256i, *total);
        (scale, sums.iter().sum())
    }

    /// [`super::vnni::fragment_dots`] with AVX2.
    ///
    /// # Safety
    /// The CPU must have AVX2; the buffers as [`super::vnni::fragment_dots`] requires.
    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn fragment_dots<const M: usize>(
        payload: &[u8],
        grid: TileGrid,
        hi: &[u8],
        lo: &[u8],
        stride: usize,
        out: &mut [i32],
        out_stride: usize,
        ahead: &mut Ahead,
    ) {
        grid.check_operands(
            payload,
            M,
            [hi.len(), lo.len()],
            stride,
            out.len(),
            out_stride,
        );
        let nibble = _mm256_set1_epi8(15);
        let (ones, high_byte) = (_mm256_set1_epi16(1), _mm256_set1_epi16(256));
        let (hp, lp, op) = (hi.as_ptr(), lo.as_ptr(), out.as_mut_ptr());
        for col in 0..grid.cols {
            // Words 8q.. of each tile: columns b = 2q (low 128 bits) and 2q + 1.
            for q in 0..4 {
                let zero = _mm256_setzero_si256();
                let (mut lows, mut highs) = ([zero; M], [zero; M]);
                for row in 0..grid.rows {
                    ahead.step();
                    let at = (col * grid.col_stride + row * grid.row_stride) * TILE_BYTES;
                    // SAFETY (all reads here): `grid.check` and the asserts above bound every
                    // tile, operand and sum offset.
                    let w = _mm256_loadu_si256(payload.as_ptr().add(at + 32 * q) as *const _);
                    let low = _mm256_and_si256(w, nibble);
                    let high = _mm256_and_si256(_mm256_srli_epi16::<4>(w), nibble);
                    for s in 0..M {
                        let h = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                            hp.add(s * stride + row * TILE) as *const __m128i,
                        ));
                        let l = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                            lp.add(s * stride + row * TILE) as *const __m128i,
                        ));
                        let dot = |u: __m256i| {
                            _mm256_add_epi32(
                                _mm256_madd_epi16(_mm256_maddubs_epi16(u, h), high_byte),
                                _mm256_madd_epi16(_mm256_maddubs_epi16(u, l), ones),
                            )
                        };
                        lows[s] = _mm256_add_epi32(lows[s], dot(low));
                        highs[s] = _mm256_add_epi32(highs[s], dot(high));
                    }
                }
                for s in 0..M {
                    // The four row lanes (a) of each column summed: lane k of `t` holds
                    // column 2q + k (dword 0) and column 8 + 2q + k (dword 1).
                    let (x, y) = (lows[s], highs[s]);
                    let t =
                        _mm256_add_epi32(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y));
                    let t = _mm256_add_epi32(t, _mm256_shuffle_epi32::<0b01_00_11_10>(t));
                    let o = op.add(s * out_stride + col * TILE + 2 * q);
                    *o = _mm256_extract_epi32::<0>(t);
                    *o.add(1) = _mm256_extract_epi32::<4>(t);
                    *o.add(8) = _mm256_extract_epi32::<1>(t);
                    *o.add(9) = _mm256_extract_epi32::<5>(t);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
