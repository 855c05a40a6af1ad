//! `tq6_0` ring keys scored straight from their 6-bit codes: no decoded float copy of a row.
//!
//! A `tq6_0` value is `norm * centroid[code]`. The centroids are held once as 16-bit integers
//! (`C[k] = round(centroid[k] s_C)`, `|C| <= 16384`) and each query block in 16-bit fixed
//! point (`q ~ n s_q`, its largest entry at `|n| = 16383`), so a block's dot product is a sum of
//! integer products: 16 `i32` lanes, lane `l` summing values `32j + 2l` and `32j + 2l + 1`
//! (eight products at most, which cannot overflow). Each lane is converted to f32, the lanes
//! are reduced in [`super::tile_gemm::dot`]'s pairwise order, and the blocks of a row are
//! added in ascending order, each times `norm s_q / s_C`. Integer lanes are exact,
//! so every instruction set gives the same bits; on AVX-512 one word permute looks up 32
//! centroids and one `vpdpwssd` (VNNI) multiplies and adds them for a query.
//!
//! The cost in accuracy: the query's rounding (1/16383 of its largest entry) and the
//! centroids' (1/32768 of the largest), each far below the 6-bit codes' own error.

use super::online_softmax::pairwise;
use super::tile_gemm::MAX_ROWS;
use crate::codec::codebooks::TQ6_CENTROIDS;
use crate::codec::fp16::f16_to_f32;
use crate::codec::tq6;

/// Largest `|n|` of a query block: eight lane products `n * C` stay below `2^31`.
const QUERY_LIMIT: f32 = 16383.0;

/// Query blocks whose largest entry is below this are taken as zero.
const QUERY_FLOOR: f32 = 1.0 / (1u128 << 100) as f32;

/// Largest `|C|` of a centroid word.
const CENTROID_LIMIT: f32 = 16384.0;

/// Lanes of a block's integer sum.
const LANES: usize = 16;

/// The centroid words of blocks of `values` (128, or 64 for the 64-wide extension, whose
/// centroids are the format's times `sqrt 2`) and `1 / scale`, the float each word step is.
struct CentroidWords {
    words: [i16; 64],
    unit: f32,
}

fn centroid_words(values: usize) -> &'static CentroidWords {
    static W128: std::sync::OnceLock<CentroidWords> = std::sync::OnceLock::new();
    static W64: std::sync::OnceLock<CentroidWords> = std::sync::OnceLock::new();
    let build = |factor: f32| {
        let centroids = TQ6_CENTROIDS.map(|c| c * factor);
        let most = centroids.iter().fold(0.0f32, |m, c| m.max(c.abs()));
        let scale = CENTROID_LIMIT / most;
        CentroidWords {
            words: centroids.map(|c| (c * scale).round() as i16),
            unit: 1.0 / scale,
        }
    };
    if values == tq6::BLOCK64_VALUES {
        W64.get_or_init(|| build(std::f32::consts::SQRT_2))
    } else {
        W128.get_or_init(|| build(1.0))
    }
}

/// Which implementation of the integer sums runs (all give the same bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RingKernel {
    Portable,
    /// AVX-512 BW word permutes and `vpmaddwd` (AVX-512 CPUs without VBMI or VNNI).
    Avx512,
    /// AVX-512 VBMI code unpacking and VNNI `vpdpwssd`.
    Vnni,
}

impl RingKernel {
    /// The fastest kernel the instruction-set level allows.
    pub(crate) fn for_level(level: crate::simd::SimdLevel) -> Self {
        use crate::simd::SimdLevel;
        match level {
            SimdLevel::Avx512 if crate::simd::avx512_vnni() && crate::simd::avx512_vbmi() => {
                Self::Vnni
            }
            SimdLevel::Avx512 if cfg!(target_arch = "x86_64") => Self::Avx512,
            _ => Self::Portable,
        }
    }
}

/// Query rows in fixed point, per `tq6_0` block: `n` (`[rows][d]`) and `factor`
/// (`[rows][blocks]`, `s_q / s_C`). Reused call after call.
#[derive(Default)]
pub(crate) struct FixedQueries {
    n: Vec<i16>,
    factor: Vec<f32>,
    rows: usize,
    d: usize,
    block: usize,
}

impl FixedQueries {
    /// Frees the buffers when they hold more than `bytes` (a long prefill's query rows), so a
    /// workspace kept between calls does not keep them; `prepare` sizes them again.
    pub(crate) fn trim(&mut self, bytes: usize) {
        let held = self.n.capacity() * 2 + self.factor.capacity() * 4;
        if held > bytes {
            *self = Self::default();
        }
    }

    /// Rounds `rows` query rows of `d` values (`stride` apart) block by block.
    pub(crate) fn prepare(&mut self, queries: &[f32], stride: usize, rows: usize, d: usize) {
        let block = if d == tq6::BLOCK64_VALUES {
            tq6::BLOCK64_VALUES
        } else {
            tq6::BLOCK_VALUES
        };
        assert!(d.is_multiple_of(block), "ring query rows");
        let unit = centroid_words(block).unit;
        let blocks = d / block;
        self.n.resize(rows * d, 0);
        self.factor.resize(rows * blocks, 0.0);
        for r in 0..rows {
            let q = &queries[r * stride..r * stride + d];
            for (b, x) in q.chunks_exact(block).enumerate() {
                let finite = x.iter().all(|v| v.is_finite());
                let most = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                // The largest entry goes to +-QUERY_LIMIT (`v * inv` rounds to at most that);
                // an all-zero block scores 0, a non-finite one NaN, as float sums would.
                let (scale, inv) = match (finite, most >= QUERY_FLOOR) {
                    (false, _) => (f32::NAN, 0.0),
                    // Below 2^-100 (`inv` would overflow) the block's products are negligible.
                    (true, false) => (0.0, 0.0),
                    (true, true) => (most / QUERY_LIMIT, QUERY_LIMIT / most),
                };
                let n = &mut self.n[r * d + b * block..r * d + (b + 1) * block];
                for (o, &v) in n.iter_mut().zip(x) {
                    *o = round_small(v * inv) as i16;
                }
                self.factor[r * blocks + b] = scale * unit;
            }
        }
        (self.rows, self.d, self.block) = (rows, d, block);
    }

    fn blocks(&self) -> usize {
        self.d / self.block
    }
}

/// `x` rounded to the nearest integer, ties to even, for `|x| < 2^22`: adding and taking away
/// `1.5 * 2^23` leaves no fraction bits (one IEEE rounding, the same on every CPU), without
/// the library call `round_ties_even` is where SSE4.1 is not assumed.
#[inline(always)]
fn round_small(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// `out[s * ldo + t]` = the score of prepared query `first + s` (`s < m <= MAX_ROWS`)
/// against the `tq6_0` key row at the start of `rows[t]`, for `t < n` (`rows[t]` may hold
/// more: its entry's value row follows). `rows[n..]` are only prefetched.
#[allow(clippy::too_many_arguments)]
pub(crate) fn key_scores(
    kernel: RingKernel,
    queries: &FixedQueries,
    first: usize,
    m: usize,
    rows: &[&[u8]],
    n: usize,
    out: &mut [f32],
    ldo: usize,
) {
    let row_bytes = tq6::row_bytes(queries.d);
    assert!(
        m <= MAX_ROWS
            && first + m <= queries.rows
            && n <= rows.len()
            && rows[..n].iter().all(|r| r.len() >= row_bytes)
            && (m == 0 || out.len() >= (m - 1) * ldo + n),
        "ring key rows"
    );
    if m == 0 {
        return;
    }
    let q = Prepared {
        all: queries,
        first,
        m,
    };
    #[cfg(target_arch = "x86_64")]
    if kernel != RingKernel::Portable {
        // SAFETY: the kernel is only chosen where `simd` reported its features; the rows and
        // the output were checked above, which is all the kernels read and write.
        unsafe {
            match kernel {
                RingKernel::Vnni => avx512::key_scores_vnni(&q, rows, n, out, ldo),
                _ => avx512::key_scores_bw(&q, rows, n, out, ldo),
            }
        }
        return;
    }
    let _ = kernel;
    key_scores_portable(&q, rows, n, out, ldo);
}

/// Queries `first..first + m` of a [`FixedQueries`].
struct Prepared<'a> {
    all: &'a FixedQueries,
    first: usize,
    m: usize,
}

impl Prepared<'_> {
    /// Query `s`'s words of block `b`.
    #[inline(always)]
    fn words(&self, s: usize, b: usize) -> &[i16] {
        let (d, values) = (self.all.d, self.all.block);
        &self.all.n[(self.first + s) * d + b * values..][..values]
    }

    #[inline(always)]
    fn factor(&self, s: usize, b: usize) -> f32 {
        self.all.factor[(self.first + s) * self.all.blocks() + b]
    }
}

/// The integer lanes of one block of codes against one query block (the module's lane order).
#[inline(always)]
fn block_lanes(n: &[i16], c: &[i16]) -> [i32; LANES] {
    let mut lanes = [0i32; LANES];
    for (nj, cj) in n.chunks_exact(2 * LANES).zip(c.chunks_exact(2 * LANES)) {
        for l in 0..LANES {
            lanes[l] +=
                nj[2 * l] as i32 * cj[2 * l] as i32 + nj[2 * l + 1] as i32 * cj[2 * l + 1] as i32;
        }
    }
    lanes
}

/// A block's lanes as f32, reduced as [`super::tile_gemm::dot`] reduces (`+ 0.0` included).
#[inline(always)]
fn reduce_lanes(lanes: [i32; LANES]) -> f32 {
    let mut f = lanes.map(|x| x as f32);
    pairwise(&mut f) + 0.0
}

/// The block's centroid words, `c[i] = C[code i]`.
#[inline(always)]
fn block_words(block: &[u8], values: usize, words: &[i16; 64], c: &mut [i16]) {
    let mut codes = [0u8; tq6::BLOCK_VALUES];
    tq6::block_codes(block, values, &mut codes);
    for (c, &code) in c[..values].iter_mut().zip(&codes[..values]) {
        *c = words[code as usize];
    }
}

#[inline(always)]
fn block_norm(block: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([block[0], block[1]]))
}

/// [`key_scores`], the portable way (the definition the SIMD kernels follow).
fn key_scores_portable(q: &Prepared, rows: &[&[u8]], n: usize, out: &mut [f32], ldo: usize) {
    let (values, blocks) = (q.all.block, q.all.blocks());
    let block_bytes = tq6::row_bytes(q.all.d) / blocks;
    let words = &centroid_words(values).words;
    let mut c = [0i16; tq6::BLOCK_VALUES];
    for (t, row) in rows[..n].iter().enumerate() {
        let mut sums = [0.0f32; MAX_ROWS];
        for b in 0..blocks {
            let block = &row[b * block_bytes..(b + 1) * block_bytes];
            block_words(block, values, words, &mut c);
            let norm = block_norm(block);
            for (s, sum) in sums.iter_mut().enumerate().take(q.m) {
                let lanes = block_lanes(q.words(s, b), &c[..values]);
                let k = norm * q.factor(s, b);
                *sum = reduce_lanes(lanes).mul_add(k, *sum);
            }
        }
        for (s, sum) in sums.iter().enumerate().take(q.m) {
            out[s * ldo + t] = *sum;
        }
    }
}

/// The format's centroids for blocks of `values` values (the 64-wide extension's are the
/// 128-value ones times `sqrt 2`, as `tq6` computes them).
fn centroids_f32(values: usize) -> &'static [f32; 64] {
    static C64: std::sync::OnceLock<[f32; 64]> = std::sync::OnceLock::new();
    if values == tq6::BLOCK64_VALUES {
        C64.get_or_init(|| TQ6_CENTROIDS.map(|c| c * std::f32::consts::SQRT_2))
    } else {
        &TQ6_CENTROIDS
    }
}

/// `out[s * ldo + c] = sum_t (w[s * ldw + t] norm[t, c]) centroid[code[t, c]]` over `t < n`,
/// in ascending `t`, one fused multiply-add per step, starting from `out` when `carry` (else
/// from zero): the value sums of `m` query pairs over `tq6_0` value rows of `d` values, each
/// at byte `offset` of `rows[t]`, without decoding the rows (the norm joins the weight, the
/// centroid is the format's f32 value). `rows[n..]` are only prefetched.
#[allow(clippy::too_many_arguments)]
pub(crate) fn value_sums(
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
    let values = if d == tq6::BLOCK64_VALUES {
        tq6::BLOCK64_VALUES
    } else {
        tq6::BLOCK_VALUES
    };
    let row_bytes = tq6::row_bytes(d);
    let (weights, outputs) = ((w, ldw), (out.len(), ldo));
    assert!(
        super::value_operands_fit(d, values, m, weights, rows, offset + row_bytes, n, outputs),
        "ring value rows"
    );
    if m == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel != RingKernel::Portable {
        // SAFETY: the kernel is only chosen where `simd` reported its features; rows, weights
        // and output were checked above, which is all the kernels read and write.
        unsafe {
            match kernel {
                RingKernel::Vnni => {
                    avx512::value_sums_vbmi(d, values, w, ldw, m, rows, offset, n, out, ldo, carry)
                }
                _ => avx512::value_sums_bw(d, values, w, ldw, m, rows, offset, n, out, ldo, carry),
            }
        }
        return;
    }
    let _ = kernel;
    let (centroids, block_bytes) = (centroids_f32(values), row_bytes / (d / values));
    for s in 0..m {
        if !carry {
            out[s * ldo..s * ldo + d].fill(0.0);
        }
    }
    let mut c = [0u8; tq6::BLOCK_VALUES];
    for (t, row) in rows[..n].iter().enumerate() {
        for b in 0..d / values {
            let block = &row[offset + b * block_bytes..offset + (b + 1) * block_bytes];
            tq6::block_codes(block, values, &mut c);
            let norm = block_norm(block);
            for s in 0..m {
                let a = w[s * ldw + t] * norm;
                let o = &mut out[s * ldo + b * values..s * ldo + (b + 1) * values];
                for (o, &code) in o.iter_mut().zip(&c[..values]) {
                    *o = a.mul_add(centroids[code as usize], *o);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    // The kernels index several per-query arrays in step; index loops say that more plainly.
    #![allow(clippy::needless_range_loop)]

    use super::{centroid_words, Prepared};
    use crate::attention::tile_gemm::avx512::reduce16;
    use crate::codec::tq6;
    use crate::simd::Ahead;
    use std::arch::x86_64::*;

    /// Rows scored together: their lane sums reduced by one transposing tree.
    const GROUP: usize = 16;

    /// Rows fetched ahead of the one being scored (ring rows of a head are a whole position
    /// apart, too far for the hardware's stride prefetcher).
    const AHEAD: usize = 8;

    /// The 64 codes of one unpack step as bytes in value order, VBMI: byte permutes gather
    /// each output qword's source bytes, one multishift per field picks the bits.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    #[inline]
    unsafe fn codes64_vbmi(qs: *const u8, qh: *const u8, pick: &[__m512i; 4]) -> __m512i {
        let s = _mm512_castsi256_si512(_mm256_loadu_si256(qs as *const __m256i));
        let h = _mm512_castsi128_si512(_mm_loadu_si128(qh as *const __m128i));
        let s = _mm512_multishift_epi64_epi8(pick[2], _mm512_permutexvar_epi8(pick[0], s));
        let h = _mm512_multishift_epi64_epi8(pick[3], _mm512_permutexvar_epi8(pick[1], h));
        _mm512_or_si512(
            _mm512_and_si512(s, _mm512_set1_epi8(15)),
            _mm512_slli_epi16::<4>(_mm512_and_si512(h, _mm512_set1_epi8(3))),
        )
    }

    /// The byte permutes and shifts of [`codes64_vbmi`]: output byte `i` (value `8q + r`)
    /// reads `qs` byte `4q + r / 2` and `qh` byte `2q + r / 4`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn vbmi_picks() -> [__m512i; 4] {
        let qs_pick: [u8; 64] = std::array::from_fn(|i| (4 * (i / 8) + (i % 8) % 4) as u8);
        let qh_pick: [u8; 64] = std::array::from_fn(|i| (2 * (i / 8) + (i % 8) % 2) as u8);
        let qs_shift: [u8; 64] = std::array::from_fn(|i| (4 * (i % 8)) as u8);
        let qh_shift: [u8; 64] = std::array::from_fn(|i| (2 * (i % 8)) as u8);
        [qs_pick, qh_pick, qs_shift, qh_shift]
            .map(|b| _mm512_loadu_si512(b.as_ptr() as *const __m512i))
    }

    /// 32 codes (values `32 j ..` of a block) as words, AVX-512 BW without VBMI: each value's
    /// nibble and bit pair shifted out of 32-bit copies of its bytes.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn codes32_bw(qs: *const u8, qh: *const u8) -> __m512i {
        let lo_pick = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        let lo_shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        let hi_pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        let hi_shift = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
        let sixteen = |i: usize| {
            let lo8 = _mm_loadl_epi64(qs.add(8 * i) as *const __m128i);
            let hi4 = _mm_cvtsi32_si128((qh.add(4 * i) as *const i32).read_unaligned());
            let lo = _mm512_permutexvar_epi32(lo_pick, _mm512_cvtepu8_epi32(lo8));
            let hi = _mm512_permutexvar_epi32(hi_pick, _mm512_cvtepu8_epi32(hi4));
            let lo = _mm512_and_si512(_mm512_srlv_epi32(lo, lo_shift), _mm512_set1_epi32(15));
            let hi = _mm512_and_si512(_mm512_srlv_epi32(hi, hi_shift), _mm512_set1_epi32(3));
            _mm512_cvtepi32_epi16(_mm512_or_si512(lo, _mm512_slli_epi32::<4>(hi)))
        };
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(sixteen(0)), sixteen(1))
    }

    /// The lane sums of `M` queries against one row's block (`blk` its bytes), `VNNI` and
    /// `VBMI` picking the instructions; the lanes are the portable `block_lanes`.
    #[inline(always)]
    unsafe fn block_lanes<const M: usize, const VNNI: bool, const VBMI: bool>(
        blk: *const u8,
        values: usize,
        table: (__m512i, __m512i),
        picks: &[__m512i; 4],
        n: &[*const i16; M],
        acc: &mut [__m512i; M],
        ahead: &mut Ahead,
    ) {
        let (qs, qh) = (blk.add(2), blk.add(2 + values / 2));
        // No closure here: one would not inherit the entry point's features, and its
        // intrinsics would become calls.
        let mut idx = [_mm512_setzero_si512(); tq6::BLOCK_VALUES / 32];
        let steps = values / 32;
        if VBMI {
            for half in 0..values / 64 {
                let codes = codes64_vbmi(qs.add(32 * half), qh.add(16 * half), picks);
                idx[2 * half] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(codes));
                idx[2 * half + 1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(codes));
            }
        } else {
            for (j, idx) in idx.iter_mut().enumerate().take(steps) {
                *idx = codes32_bw(qs.add(16 * j), qh.add(8 * j));
            }
        }
        for (j, &idx) in idx.iter().enumerate().take(steps) {
            ahead.step();
            ahead.step();
            let c = _mm512_permutex2var_epi16(table.0, idx, table.1);
            for s in 0..M {
                // SAFETY: query block `s` holds `values` words; `32 j + 32 <= values`.
                let q = _mm512_loadu_si512(n[s].add(32 * j) as *const __m512i);
                acc[s] = if VNNI {
                    _mm512_dpwssd_epi32(acc[s], c, q)
                } else {
                    _mm512_add_epi32(acc[s], _mm512_madd_epi16(c, q))
                };
            }
        }
    }

    /// The kernel body for `M` queries, inlined into each feature set's entry point.
    #[inline(always)]
    unsafe fn key_scores_m<const M: usize, const VNNI: bool, const VBMI: bool>(
        q: &Prepared,
        rows: &[&[u8]],
        n: usize,
        out: &mut [f32],
        ldo: usize,
    ) {
        let (values, blocks) = (q.all.block, q.all.blocks());
        let block_bytes = tq6::row_bytes(q.all.d) / blocks;
        let words = &centroid_words(values).words;
        let table = (
            _mm512_loadu_si512(words.as_ptr() as *const __m512i),
            _mm512_loadu_si512(words.as_ptr().add(32) as *const __m512i),
        );
        let picks = if VBMI {
            vbmi_picks()
        } else {
            [_mm512_setzero_si512(); 4]
        };
        let op = out.as_mut_ptr();
        let mut t0 = 0;
        while t0 < n {
            let count = GROUP.min(n - t0);
            let mut sums = [_mm512_setzero_ps(); M];
            for b in 0..blocks {
                let mut lanes = [[_mm512_setzero_ps(); GROUP]; M];
                let mut norms = [0u16; GROUP];
                let nq: [*const i16; M] = std::array::from_fn(|s| q.words(s, b).as_ptr());
                for u in 0..count {
                    let t = t0 + u;
                    // The entry AHEAD rows on is fetched a line or two per step of block 0.
                    let mut ahead = Ahead::new(match rows.get(t + AHEAD) {
                        Some(row) if b == 0 => row,
                        _ => &[],
                    });
                    let blk = rows[t].as_ptr().add(b * block_bytes);
                    norms[u] = u16::from_le_bytes([*blk, *blk.add(1)]);
                    let mut acc = [_mm512_setzero_si512(); M];
                    block_lanes::<M, VNNI, VBMI>(
                        blk, values, table, &picks, &nq, &mut acc, &mut ahead,
                    );
                    ahead.finish();
                    for s in 0..M {
                        lanes[s][u] = _mm512_cvtepi32_ps(acc[s]);
                    }
                }
                let norms = _mm512_cvtph_ps(_mm256_loadu_si256(norms.as_ptr() as *const __m256i));
                for s in 0..M {
                    let k = _mm512_mul_ps(norms, _mm512_set1_ps(q.factor(s, b)));
                    sums[s] = _mm512_fmadd_ps(reduce16(&lanes[s]), k, sums[s]);
                }
            }
            let mask: __mmask16 = if count == GROUP {
                !0
            } else {
                (1u16 << count) - 1
            };
            for s in 0..M {
                // SAFETY: `count` outputs at `s * ldo + t0`, inside `out` (checked by the caller).
                _mm512_mask_storeu_ps(op.add(s * ldo + t0), mask, sums[s]);
            }
            t0 += count;
        }
    }

    /// The 64 codes of one unpack step as bytes in value order, without VBMI: two 32-code
    /// word unpacks narrowed to bytes.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn codes64_bw(qs: *const u8, qh: *const u8) -> __m512i {
        let lo = _mm512_cvtepi16_epi8(codes32_bw(qs, qh));
        let hi = _mm512_cvtepi16_epi8(codes32_bw(qs.add(16), qh.add(8)));
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }

    /// The value kernel for `M` pairs: 64 channels (one unpack step) at a time, their `4 M`
    /// accumulators in registers over all rows; each row's 64 codes unpacked once, looked up
    /// in the f32 centroids (two two-register permutes and a blend per 16), and added with one
    /// fused multiply-add per pair.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn value_sums_m<const M: usize, const VBMI: bool>(
        d: usize,
        values: usize,
        w: &[f32],
        ldw: usize,
        rows: &[&[u8]],
        offset: usize,
        n: usize,
        out: &mut [f32],
        ldo: usize,
        carry: bool,
    ) {
        let centroids = super::centroids_f32(values).as_ptr();
        let t: [__m512; 4] = std::array::from_fn(|i| _mm512_loadu_ps(centroids.add(16 * i)));
        let picks = if VBMI {
            vbmi_picks()
        } else {
            [_mm512_setzero_si512(); 4]
        };
        let block_bytes = tq6::row_bytes(d) / (d / values);
        let (op, wp) = (out.as_mut_ptr(), w.as_ptr());
        for tile in 0..d / 64 {
            let (b, half) = (64 * tile / values, (64 * tile % values) / 64);
            let mut acc = [[_mm512_setzero_ps(); 4]; M];
            if carry {
                for s in 0..M {
                    for k in 0..4 {
                        acc[s][k] = _mm512_loadu_ps(op.add(s * ldo + 64 * tile + 16 * k));
                    }
                }
            }
            for r in 0..n {
                if tile == 0 {
                    if let Some(ahead) = rows.get(r + AHEAD) {
                        _mm_prefetch::<_MM_HINT_T1>(ahead.as_ptr().add(offset) as *const i8);
                    }
                }
                let blk = rows[r].as_ptr().add(offset + b * block_bytes);
                let norm = f16_norm(blk);
                let (qs, qh) = (blk.add(2 + 32 * half), blk.add(2 + values / 2 + 16 * half));
                let codes = if VBMI {
                    codes64_vbmi(qs, qh, &picks)
                } else {
                    codes64_bw(qs, qh)
                };
                let mut v = [_mm512_setzero_ps(); 4];
                for (k, v) in v.iter_mut().enumerate() {
                    let idx = _mm512_cvtepu8_epi32(match k {
                        0 => _mm512_extracti32x4_epi32::<0>(codes),
                        1 => _mm512_extracti32x4_epi32::<1>(codes),
                        2 => _mm512_extracti32x4_epi32::<2>(codes),
                        _ => _mm512_extracti32x4_epi32::<3>(codes),
                    });
                    let low = _mm512_permutex2var_ps(t[0], idx, t[1]);
                    let high = _mm512_permutex2var_ps(t[2], idx, t[3]);
                    let upper = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
                    *v = _mm512_mask_blend_ps(upper, low, high);
                }
                for s in 0..M {
                    // SAFETY: weight `r < n` of pair `s` (checked by the caller).
                    let a = _mm512_set1_ps(*wp.add(s * ldw + r) * norm);
                    for k in 0..4 {
                        acc[s][k] = _mm512_fmadd_ps(a, v[k], acc[s][k]);
                    }
                }
            }
            for s in 0..M {
                for k in 0..4 {
                    // SAFETY: channels `64 tile + 16 k .. + 16 < d` of pair `s`.
                    _mm512_storeu_ps(op.add(s * ldo + 64 * tile + 16 * k), acc[s][k]);
                }
            }
        }
    }

    /// A block's fp16 norm as f32.
    #[inline(always)]
    unsafe fn f16_norm(blk: *const u8) -> f32 {
        crate::codec::fp16::f16_to_f32(u16::from_le_bytes([*blk, *blk.add(1)]))
    }

    macro_rules! value_entry {
        ($name:ident, $features:literal, $vbmi:literal) => {
            /// [`super::value_sums`] for one feature set.
            ///
            /// # Safety
            /// The CPU must have the features; operands as `value_sums` checks.
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            pub(super) unsafe fn $name(
                d: usize,
                values: usize,
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
                        value_sums_m::<$m, $vbmi>(
                            d, values, w, ldw, rows, offset, n, out, ldo, carry,
                        )
                    };
                }
                by_rows!(m, go, [1, 2, 3, 4, 5, 6, 7], 8)
            }
        };
    }

    value_entry!(
        value_sums_vbmi,
        "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,f16c,fma",
        true
    );
    value_entry!(
        value_sums_bw,
        "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma",
        false
    );

    macro_rules! entry {
        ($name:ident, $features:literal, $vnni:literal, $vbmi:literal) => {
            /// [`super::key_scores`] for one feature set.
            ///
            /// # Safety
            /// The CPU must have the features; rows and output as `key_scores` checks.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(
                q: &Prepared,
                rows: &[&[u8]],
                n: usize,
                out: &mut [f32],
                ldo: usize,
            ) {
                macro_rules! go {
                    ($m:literal) => {
                        key_scores_m::<$m, $vnni, $vbmi>(q, rows, n, out, ldo)
                    };
                }
                by_rows!(q.m, go, [1, 2, 3, 4, 5, 6, 7], 8)
            }
        };
    }

    entry!(
        key_scores_vnni,
        "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512vnni,f16c,fma",
        true,
        true
    );
    entry!(
        key_scores_bw,
        "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma",
        false,
        false
    );
}

#[cfg(test)]
mod tests {
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
}
