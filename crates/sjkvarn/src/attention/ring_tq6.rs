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

#[cfg(target_arch = "x86_64")]
mod avx512;
mod queries;

pub(crate) use queries::FixedQueries;
use queries::{centroid_words, Prepared, LANES};

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
        super::operands::value_operands_fit(
            d,
            values,
            m,
            weights,
            rows,
            offset + row_bytes,
            n,
            outputs
        ),
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

#[cfg(test)]
mod tests;
