// The kernels index several per-query arrays in step; index loops say that more plainly.
#![allow(clippy::needless_range_loop)]

use super::queries::{centroid_words, Prepared};
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
    [qs_pick, qh_pick, qs_shift, qh_shift].map(|b| _mm512_loadu_si512(b.as_ptr() as *const __m512i))
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
                block_lanes::<M, VNNI, VBMI>(blk, values, table, &picks, &nq, &mut acc, &mut ahead);
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
                    value_sums_m::<$m, $vbmi>(d, values, w, ldw, rows, offset, n, out, ldo, carry)
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
