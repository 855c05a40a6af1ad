//! `tq6_0`, the staging format: 128 rotated values in 98 bytes (6.125 bits per value).
//!
//! Block layout: `norm: fp16` (bytes 0..2), `qs[64]` (bytes 2..66: code `i`'s low nibble at bit
//! `4*(i%2)` of `qs[i/2]`), `qh[32]` (bytes 66..98: code `i`'s top two bits at bit `2*(i%4)` of
//! `qh[i/4]`). Codes index the 64 Lloyd-Max centroids of N(0, 1/128) of the unit-norm block;
//! the stored norm is `||x|| / ||c[codes]||`, so a decoded block has the input's norm up to the
//! fp16 rounding of that norm. An all-zero block (norm <= 1e-10) codes every value as 32.
//!
//! sjkvarn extension, for 64-wide heads (which the reference does not stage): a 50-byte block of
//! 64 values, `norm` + `qs[32]` + `qh[16]` in the same bit order, with the centroids and
//! midpoints of N(0, 1/64), i.e. the tables above times `sqrt(2)` (one f32 multiply each).

use super::codebooks::{TQ6_CENTROIDS, TQ6_MIDPOINTS};
use super::fp16::{f16_to_f32, f32_to_f16};

/// Values per block.
pub const BLOCK_VALUES: usize = 128;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 98;

/// Values per block of the 64-wide extension.
pub const BLOCK64_VALUES: usize = 64;
/// Bytes per block of the 64-wide extension.
pub const BLOCK64_BYTES: usize = 50;

/// Centroids and midpoints for blocks of `n` values (128: the format's; 64: scaled by sqrt 2).
struct Tables {
    centroids: [f32; 64],
    midpoints: [f32; 63],
}

fn tables(n: usize) -> &'static Tables {
    static T128: Tables = Tables {
        centroids: TQ6_CENTROIDS,
        midpoints: TQ6_MIDPOINTS,
    };
    static T64: std::sync::OnceLock<Tables> = std::sync::OnceLock::new();
    if n == BLOCK_VALUES {
        return &T128;
    }
    T64.get_or_init(|| Tables {
        centroids: TQ6_CENTROIDS.map(|c| c * std::f32::consts::SQRT_2),
        midpoints: TQ6_MIDPOINTS.map(|m| m * std::f32::consts::SQRT_2),
    })
}

/// Index of the centroid nearest to `v`: the number of (ascending) midpoints `m` with
/// `!(v < m)`, so a value on a midpoint goes up (and NaN, never below one, gets 63), as the
/// reference's binary search gives. Found in six fixed steps whose probe is a select, not a
/// branch: a branching search mispredicts about half its steps on real rows and took most
/// of a ring append's time.
#[inline]
fn nearest(midpoints: &[f32; 63], v: f32) -> usize {
    let mut pos = 0usize;
    for step in [32, 16, 8, 4, 2, 1] {
        // pos + step - 1 <= 62: pos gains at most 63 - (2 step - 1) before this step.
        let above = v < midpoints[pos + step - 1];
        pos += usize::from(!above) * step;
    }
    pos
}

/// `idx[i] = nearest(x[i] * inv)` (`nearest(0)` for every value where `scaled` is false), 16
/// values per step on AVX-512: the same six probes as [`nearest`], each a table permute.
#[inline]
fn nearest_codes(midpoints: &[f32; 63], x: &[f32], scaled: bool, inv: f32, idx: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx512() && x.len().is_multiple_of(16) && idx.len() >= x.len() {
        // SAFETY: the CPU reported AVX-512 F/BW/VL/DQ; `idx` holds `x.len()` codes (checked).
        unsafe { nearest_codes_avx512(midpoints, x, scaled, inv, idx) };
        return;
    }
    for (o, &v) in idx.iter_mut().zip(x) {
        let u = if scaled { v * inv } else { 0.0 };
        *o = nearest(midpoints, u) as u8;
    }
}

/// [`nearest_codes`] with AVX-512: the 63 midpoints (and an unused 64th entry) in four
/// registers, probed with two two-register permutes and a blend per step.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL; `x.len()` must be a multiple of 16 and `idx` must hold
/// `x.len()` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn nearest_codes_avx512(
    midpoints: &[f32; 63],
    x: &[f32],
    scaled: bool,
    inv: f32,
    idx: &mut [u8],
) {
    use std::arch::x86_64::*;
    let mut table = [f32::INFINITY; 64];
    table[..63].copy_from_slice(midpoints);
    let t: [__m512; 4] = std::array::from_fn(|i| _mm512_loadu_ps(table.as_ptr().add(16 * i)));
    let inv = _mm512_set1_ps(inv);
    for (chunk, out) in x.chunks_exact(16).zip(idx.chunks_exact_mut(16)) {
        // SAFETY: 16 floats in `chunk`, 16 bytes in `out`.
        let u = if scaled {
            _mm512_mul_ps(_mm512_loadu_ps(chunk.as_ptr()), inv)
        } else {
            _mm512_setzero_ps()
        };
        let mut pos = _mm512_setzero_si512();
        for step in [32, 16, 8, 4, 2, 1] {
            let probe_at = _mm512_add_epi32(pos, _mm512_set1_epi32(step - 1));
            let low = _mm512_permutex2var_ps(t[0], probe_at, t[1]);
            let high = _mm512_permutex2var_ps(t[2], probe_at, t[3]);
            let upper = _mm512_test_epi32_mask(probe_at, _mm512_set1_epi32(32));
            let probe = _mm512_mask_blend_ps(upper, low, high);
            // `v < m`, false for NaN, as the scalar comparison.
            let above = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(u, probe);
            pos = _mm512_mask_add_epi32(pos, !above, pos, _mm512_set1_epi32(step));
        }
        _mm_storeu_si128(out.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(pos));
    }
}

/// Encodes one block of `n` = 128 (or 64, extension) values into `2 + 3n/4` bytes.
fn encode_n(x: &[f32], n: usize, out: &mut [u8]) {
    let t = tables(n);
    let mut norm_sq = 0f32;
    for &v in &x[..n] {
        norm_sq += v * v;
    }
    let norm = norm_sq.sqrt();
    let inv = if norm > 1e-10 { 1.0 / norm } else { 0.0 };
    let mut idx = [0u8; BLOCK_VALUES];
    nearest_codes(&t.midpoints, &x[..n], norm > 1e-10, inv, &mut idx[..n]);
    let mut rn_sq = 0f32;
    for &i in &idx[..n] {
        let c = t.centroids[i as usize];
        rn_sq += c * c;
    }
    let rn = rn_sq.sqrt();
    let stored = if rn > 1e-10 { norm / rn } else { norm };
    let (qs, qh) = (2, 2 + n / 2);
    let out = &mut out[..2 + 3 * n / 4];
    out.fill(0);
    out[..2].copy_from_slice(&f32_to_f16(stored).to_le_bytes());
    for (i, &code) in idx[..n].iter().enumerate() {
        out[qs + i / 2] |= (code & 0xf) << ((i % 2) * 4);
        out[qh + i / 4] |= ((code >> 4) & 0x3) << ((i % 4) * 2);
    }
}

/// Decodes one block of `n` values: `centroid[code] * norm`.
#[inline(always)]
fn decode_n(block: &[u8], n: usize, out: &mut [f32]) {
    let t = tables(n);
    let norm = f16_to_f32(u16::from_le_bytes([block[0], block[1]]));
    let (qs, qh) = (2, 2 + n / 2);
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx512_vbmi()
        && n.is_multiple_of(64)
        && block.len() >= qh + n / 4
        && out.len() >= n
    {
        // SAFETY: the CPU reported AVX-512 F/BW/VL/DQ and VBMI; the block holds its `qs` and
        // `qh` fields (checked above) and `out` its `n` values.
        unsafe { unpack_lookup_vbmi(&t.centroids, &block[qs..], &block[qh..], n, norm, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx512() && block.len() >= qh + n / 4 && out.len() >= n {
        // SAFETY: the CPU reported AVX-512 F/BW/VL/DQ; the block holds its `qs` and `qh`
        // fields (checked above) and `out` its `n` values.
        unsafe { unpack_lookup_avx512(&t.centroids, &block[qs..], &block[qh..], n, norm, out) };
        return;
    }
    let mut codes = [0u8; BLOCK_VALUES];
    block_codes(block, n, &mut codes);
    lookup_portable(&t.centroids, &codes[..n], norm, &mut out[..n]);
}

/// The 6-bit codes of a block of `n` values, four per step: two `qs` bytes (low nibbles), one
/// `qh` byte (high pairs).
#[inline(always)]
pub(crate) fn block_codes(block: &[u8], n: usize, codes: &mut [u8]) {
    let (qs, qh) = (2, 2 + n / 2);
    for (i, c) in codes[..n].chunks_exact_mut(4).enumerate() {
        let (a, b, h) = (block[qs + 2 * i], block[qs + 2 * i + 1], block[qh + i]);
        c[0] = (a & 0xf) | (h & 3) << 4;
        c[1] = (a >> 4) | ((h >> 2) & 3) << 4;
        c[2] = (b & 0xf) | ((h >> 4) & 3) << 4;
        c[3] = (b >> 4) | (h >> 6) << 4;
    }
}

#[inline(always)]
fn lookup_portable(centroids: &[f32; 64], codes: &[u8], norm: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = centroids[c as usize] * norm;
    }
}

/// The 64 centroids in four registers and the block's norm: 16 lookups per step.
#[cfg(target_arch = "x86_64")]
struct CentroidsAvx512 {
    t: [std::arch::x86_64::__m512; 4],
    scale: std::arch::x86_64::__m512,
}

#[cfg(target_arch = "x86_64")]
impl CentroidsAvx512 {
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load(centroids: &[f32; 64], norm: f32) -> Self {
        use std::arch::x86_64::*;
        let c = centroids.as_ptr();
        // SAFETY: `centroids` has 64 values, read as four 16-value vectors.
        Self {
            t: [0, 16, 32, 48].map(|i| _mm512_loadu_ps(c.add(i))),
            scale: _mm512_set1_ps(norm),
        }
    }

    /// `centroid[idx] * norm` for 16 codes (< 64): two two-register permutes, bit 5 of the
    /// code picks between them.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn values(&self, idx: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let low = _mm512_permutex2var_ps(self.t[0], idx, self.t[1]);
        let high = _mm512_permutex2var_ps(self.t[2], idx, self.t[3]);
        let v = _mm512_mask_blend_ps(
            _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)),
            low,
            high,
        );
        _mm512_mul_ps(v, self.scale)
    }
}

/// Codes unpacked and looked up 16 at a time: value `j` of a step takes nibble `j % 2` of
/// `qs` byte `j / 2` and bit pair `j % 4` of `qh` byte `j / 4` (the portable loop's layout),
/// then the same lookup and one multiply as [`lookup_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
unsafe fn unpack_lookup_avx512(
    centroids: &[f32; 64],
    qs: &[u8],
    qh: &[u8],
    n: usize,
    norm: f32,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let table = CentroidsAvx512::load(centroids, norm);
    // SAFETY (the loop): step `i < n / 16` reads `qs[8i..8i + 8]` and `qh[4i..4i + 4]` (inside
    // the fields, as the caller checked) and writes `out[16i..16i + 16]`.
    let lo_pick = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let lo_shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    let hi_pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let hi_shift = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    let (nibble, pair) = (_mm512_set1_epi32(15), _mm512_set1_epi32(3));
    for i in 0..n / 16 {
        let lo8 = _mm_loadl_epi64(qs.as_ptr().add(8 * i) as *const __m128i);
        let hi4 = _mm_cvtsi32_si128((qh.as_ptr().add(4 * i) as *const i32).read_unaligned());
        let lo = _mm512_permutexvar_epi32(lo_pick, _mm512_cvtepu8_epi32(lo8));
        let hi = _mm512_permutexvar_epi32(hi_pick, _mm512_cvtepu8_epi32(hi4));
        let lo = _mm512_and_si512(_mm512_srlv_epi32(lo, lo_shift), nibble);
        let hi = _mm512_and_si512(_mm512_srlv_epi32(hi, hi_shift), pair);
        let idx = _mm512_or_si512(lo, _mm512_slli_epi32::<4>(hi));
        _mm512_storeu_ps(out.as_mut_ptr().add(16 * i), table.values(idx));
    }
}

/// [`unpack_lookup_avx512`] 64 codes a step with VBMI: byte permutes put each output qword's
/// source bytes (4 `qs` bytes, 2 `qh` bytes) in that qword, and one multishift per field picks
/// every value's nibble or bit pair, so a step costs a handful of instructions instead of
/// four 16-value unpacks; the lookup is the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")]
unsafe fn unpack_lookup_vbmi(
    centroids: &[f32; 64],
    qs: &[u8],
    qh: &[u8],
    n: usize,
    norm: f32,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    assert!(n.is_multiple_of(64) && qs.len() >= n / 2 && qh.len() >= n / 4 && out.len() >= n);
    let table = CentroidsAvx512::load(centroids, norm);
    // Output byte i (value 8q + r of the step, q = i / 8, r = i % 8) reads `qs` byte 4q + r / 2
    // and `qh` byte 2q + r / 4: both gathered into qword q's low bytes, then shifted out.
    let qs_pick: [u8; 64] = std::array::from_fn(|i| (4 * (i / 8) + (i % 8) % 4) as u8);
    let qh_pick: [u8; 64] = std::array::from_fn(|i| (2 * (i / 8) + (i % 8) % 2) as u8);
    let qs_shift: [u8; 64] = std::array::from_fn(|i| (4 * (i % 8)) as u8);
    let qh_shift: [u8; 64] = std::array::from_fn(|i| (2 * (i % 8)) as u8);
    let load = |b: &[u8; 64]| _mm512_loadu_si512(b.as_ptr() as *const __m512i);
    let (qs_pick, qh_pick) = (load(&qs_pick), load(&qh_pick));
    let (qs_shift, qh_shift) = (load(&qs_shift), load(&qh_shift));
    for step in 0..n / 64 {
        // SAFETY: 32 `qs` bytes and 16 `qh` bytes of this step (asserted above).
        let s = _mm512_castsi256_si512(_mm256_loadu_si256(
            qs.as_ptr().add(32 * step) as *const __m256i
        ));
        let h =
            _mm512_castsi128_si512(_mm_loadu_si128(qh.as_ptr().add(16 * step) as *const __m128i));
        let s = _mm512_multishift_epi64_epi8(qs_shift, _mm512_permutexvar_epi8(qs_pick, s));
        let h = _mm512_multishift_epi64_epi8(qh_shift, _mm512_permutexvar_epi8(qh_pick, h));
        let codes = _mm512_or_si512(
            _mm512_and_si512(s, _mm512_set1_epi8(15)),
            _mm512_slli_epi16::<4>(_mm512_and_si512(h, _mm512_set1_epi8(3))),
        );
        for k in 0..4 {
            let idx = _mm512_cvtepu8_epi32(match k {
                0 => _mm512_extracti32x4_epi32::<0>(codes),
                1 => _mm512_extracti32x4_epi32::<1>(codes),
                2 => _mm512_extracti32x4_epi32::<2>(codes),
                _ => _mm512_extracti32x4_epi32::<3>(codes),
            });
            // SAFETY: 16 values at 64 step + 16 k < n.
            _mm512_storeu_ps(out.as_mut_ptr().add(64 * step + 16 * k), table.values(idx));
        }
    }
}

/// Encodes one 128-value block.
pub fn encode_block(x: &[f32], out: &mut [u8]) {
    encode_n(x, BLOCK_VALUES, out)
}

/// Decodes one 128-value block.
#[inline(always)]
pub fn decode_block(block: &[u8], out: &mut [f32]) {
    decode_n(block, BLOCK_VALUES, out)
}

/// Encodes one 64-value block (extension for 64-wide heads).
pub fn encode_block64(x: &[f32], out: &mut [u8]) {
    encode_n(x, BLOCK64_VALUES, out)
}

/// Decodes one 64-value block (extension for 64-wide heads).
#[inline(always)]
pub fn decode_block64(block: &[u8], out: &mut [f32]) {
    decode_n(block, BLOCK64_VALUES, out)
}

/// Bytes of one staged row of `d` values: whole 128-value blocks, or one 64-value block.
pub fn row_bytes(d: usize) -> usize {
    if d == BLOCK64_VALUES {
        BLOCK64_BYTES
    } else {
        d / BLOCK_VALUES * BLOCK_BYTES
    }
}

/// Encodes a rotated row whose length is a multiple of 128 (or exactly 64, extension).
pub fn encode_row(x: &[f32], out: &mut [u8]) {
    if x.len() == BLOCK64_VALUES {
        return encode_block64(x, out);
    }
    for (b, o) in x
        .chunks_exact(BLOCK_VALUES)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        encode_block(b, o);
    }
}

/// Decodes a row of whole blocks (or one 64-value block when `out` has 64 values).
#[inline(always)]
pub fn decode_row(bytes: &[u8], out: &mut [f32]) {
    if out.len() == BLOCK64_VALUES {
        return decode_block64(bytes, out);
    }
    for (b, o) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_VALUES))
    {
        decode_block(b, o);
    }
}

#[cfg(test)]
mod tests {

    /// The decoder in use on this CPU (AVX-512 lookups where present) gives, value for value,
    /// the format's definition: centroid of the 6-bit code times the fp16 norm.
    #[test]
    fn decoding_is_centroid_times_norm() {
        let mut rng = crate::rng::SplitMix64::new(3);
        for n in [BLOCK_VALUES, BLOCK64_VALUES] {
            let bytes = if n == BLOCK_VALUES {
                BLOCK_BYTES
            } else {
                BLOCK64_BYTES
            };
            for _ in 0..50 {
                let mut block: Vec<u8> = (0..bytes).map(|_| rng.next_u64() as u8).collect();
                block[1] &= 0x3b; // a finite fp16 norm
                let mut out = vec![0f32; n];
                decode_n(&block, n, &mut out);
                let norm = f16_to_f32(u16::from_le_bytes([block[0], block[1]]));
                for (i, &o) in out.iter().enumerate() {
                    let lo = (block[2 + i / 2] >> ((i % 2) * 4)) & 0xf;
                    let hi = (block[2 + n / 2 + i / 4] >> ((i % 4) * 2)) & 0x3;
                    let want = tables(n).centroids[(lo | hi << 4) as usize] * norm;
                    assert_eq!(o.to_bits(), want.to_bits(), "value {i} of {n}");
                }
                // The portable lookup too, where the CPU made the AVX-512 one run above.
                let codes: Vec<u8> = (0..n)
                    .map(|i| {
                        let lo = (block[2 + i / 2] >> ((i % 2) * 4)) & 0xf;
                        lo | ((block[2 + n / 2 + i / 4] >> ((i % 4) * 2)) & 0x3) << 4
                    })
                    .collect();
                let mut portable = vec![0f32; n];
                lookup_portable(&tables(n).centroids, &codes, norm, &mut portable);
                assert_eq!(portable, out);
                // And the 16-at-a-time AVX-512 unpack, which VBMI CPUs skip in `decode_n`.
                #[cfg(target_arch = "x86_64")]
                if crate::simd::avx512() {
                    let mut wide = vec![0f32; n];
                    let (c, qs, qh) = (&tables(n).centroids, &block[2..], &block[2 + n / 2..]);
                    // SAFETY: AVX-512 present (checked); the block holds both fields.
                    unsafe { unpack_lookup_avx512(c, qs, qh, n, norm, &mut wide) };
                    assert_eq!(wide, out);
                }
            }
        }
    }

    use super::*;

    #[test]
    fn nearest_agrees_with_a_linear_scan() {
        for i in -4000..4000 {
            let v = i as f32 * 1e-4;
            let lin = TQ6_MIDPOINTS.iter().filter(|&&m| v >= m).count();
            assert_eq!(nearest(&TQ6_MIDPOINTS, v), lin);
        }
    }

    /// The reference's search: halve `[lo, hi)` until empty, going up on `!(v < m)`.
    fn nearest_by_bisection(midpoints: &[f32; 63], v: f32) -> usize {
        let (mut lo, mut hi) = (0usize, 63usize);
        while lo < hi {
            let m = (lo + hi) / 2;
            if v < midpoints[m] {
                hi = m;
            } else {
                lo = m + 1;
            }
        }
        lo
    }

    #[test]
    fn block_codes_equal_the_scalar_search() {
        let mut rng = crate::rng::SplitMix64::new(4);
        for mids in [TQ6_MIDPOINTS, tables(64).midpoints] {
            let mut x = rng.gaussians(4096);
            x.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e-40]);
            x.extend(mids.iter().flat_map(|&m| [m * 11.3, (m * 11.3).next_up()]));
            x.resize(x.len().next_multiple_of(16), 0.5);
            for (scaled, inv) in [(true, 1.0 / 11.3), (true, 1.0), (false, 0.0)] {
                let mut got = vec![0u8; x.len()];
                nearest_codes(&mids, &x, scaled, inv, &mut got);
                for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
                    let u = if scaled { v * inv } else { 0.0 };
                    assert_eq!(g as usize, nearest(&mids, u), "value {i}: {v:e}");
                }
            }
        }
    }

    #[test]
    fn nearest_equals_the_bisection_everywhere() {
        let t64 = tables(64).midpoints;
        for mids in [TQ6_MIDPOINTS, t64] {
            assert!(mids.windows(2).all(|w| w[0] < w[1]), "midpoints ascend");
            let mut values = vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
            values.extend([
                f32::MIN_POSITIVE,
                -f32::MIN_POSITIVE,
                1e-40,
                f32::MAX,
                f32::MIN,
            ]);
            for &m in &mids {
                // On each midpoint and the floats either side of it.
                values.extend([m, m.next_up(), m.next_down()]);
            }
            let mut rng = crate::rng::SplitMix64::new(3);
            values.extend(rng.gaussians(20_000).iter().map(|g| g * 0.1));
            for v in values {
                assert_eq!(
                    nearest(&mids, v),
                    nearest_by_bisection(&mids, v),
                    "v = {v:e}"
                );
            }
        }
    }

    #[test]
    fn zero_block_codes_the_middle_centroid() {
        let mut out = [0u8; BLOCK_BYTES];
        encode_block(&[0.0; 128], &mut out);
        assert_eq!(&out[..2], &[0, 0]);
        let mut y = [1.0f32; 128];
        decode_block(&out, &mut y);
        assert!(y.iter().all(|&v| v == 0.0));
        assert!(out[2..66].iter().all(|&b| b == 0));
        assert!(out[66..].iter().all(|&b| b == 0b1010_1010));
    }

    #[test]
    fn blocks_of_64_keep_the_norm() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 29 % 17) as f32 - 8.0) * 0.1)
            .collect();
        let mut out = [0u8; BLOCK64_BYTES];
        encode_block64(&x, &mut out);
        let mut y = [0f32; 64];
        decode_block64(&out, &mut y);
        let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>().sqrt();
        assert!((n(&x) - n(&y)).abs() < 2e-3 * n(&x));
        let err: f32 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
        assert!(
            err < 1e-3 * n(&x).powi(2),
            "relative error {}",
            err / n(&x).powi(2)
        );
    }
}
