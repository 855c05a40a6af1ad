//! The `q8_0` block, the one place its layout is written: 32 values as an fp16 scale
//! `d = max|x| / 127` followed by 32 signed codes `round(x / d)` (half away from zero), value
//! `code * d`. It is llama.cpp's `q8_0` byte for byte (the comparator format in
//! [`super::comparators::ggml`]) and the ring rows of the default journal
//! ([`crate::journal::rows`]); the CUDA kernels' `SJ_Q8_0_*` constants are checked against
//! these by a host test.
//!
//! Every step mirrors gguf's reference quantizer in f32 with the same operation order (no fused
//! multiply-add), including its float-to-integer casts, so the bytes agree on zeros, constants,
//! extremes and denormals, not just on typical data.

use half::f16;

/// Values per block.
pub const BLOCK_VALUES: usize = 32;
/// Offset of the 32 codes in a block (after the fp16 scale).
pub const CODES_OFFSET: usize = 2;
/// Bytes per block: the fp16 scale, then the codes.
pub const BLOCK_BYTES: usize = CODES_OFFSET + BLOCK_VALUES;

/// Bytes of a row of `values` values (a multiple of [`BLOCK_VALUES`]).
pub const fn row_bytes(values: usize) -> usize {
    values / BLOCK_VALUES * BLOCK_BYTES
}

/// The fp16 scale at the start of a block, as f32.
#[inline(always)]
pub fn block_scale(block: &[u8]) -> f32 {
    f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// The scale a block of values would store, before its fp16 rounding.
pub fn scale_of(block: &[f32]) -> f32 {
    block.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0
}

/// The cast numpy performs for `float32 -> (u)int8` on x86: NaN, infinities and values outside
/// the 32-bit range become 0, anything else truncates toward zero and keeps the low byte.
pub(crate) fn c_cast_byte(v: f32) -> u8 {
    if !v.is_finite() || v.abs() >= 2_147_483_648.0 {
        0
    } else {
        (v as i32) as u8
    }
}

/// `np.where(d == 0, 0, 1 / d)`
pub(crate) fn inverse_or_zero(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// ggml's round-half-away-from-zero, written the way gguf writes it:
/// `floor(a) + floor(2 (a - floor(a)))` for `a = |n|`. Below `2^23` the floor is a truncation
/// and the second term is `1` exactly when the (exact) fraction is at least one half, which
/// baseline x86-64 computes inline (`floor` would be a routine call per value); from `2^23`
/// on every f32 is an integer.
pub(crate) fn roundf_away(n: f32) -> f32 {
    let a = n.abs();
    let b = if a < 8_388_608.0 {
        let floored = a as i32 as f32;
        floored + if a - floored >= 0.5 { 1.0 } else { 0.0 }
    } else {
        a.floor()
    };
    // np.sign(NaN) is NaN; np.sign(0) is 0
    let sign = if n.is_nan() {
        f32::NAN
    } else if n > 0.0 {
        1.0
    } else if n < 0.0 {
        -1.0
    } else {
        0.0
    };
    sign * b
}

pub(crate) fn put_f16(out: &mut [u8], v: f32) {
    out[..2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

pub(crate) fn get_f16(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Quantizes one block of 32 finite values into `out` ([`BLOCK_BYTES`] long).
pub fn encode_block(block: &[f32], out: &mut [u8]) {
    debug_assert_eq!(block.len(), BLOCK_VALUES);
    let d = scale_of(block);
    let id = inverse_or_zero(d);
    put_f16(out, d);
    for (o, &x) in out[CODES_OFFSET..BLOCK_BYTES].iter_mut().zip(block) {
        *o = c_cast_byte(roundf_away(x * id));
    }
}

/// Dequantizes one block exactly as `gguf.quants.dequantize` does.
pub fn decode_block(bytes: &[u8], out: &mut [f32]) {
    let d = block_scale(bytes);
    for (o, &b) in out.iter_mut().zip(&bytes[CODES_OFFSET..BLOCK_BYTES]) {
        *o = (b as i8) as f32 * d;
    }
}

/// `q8_0` blocks of a row of finite values (a multiple of 32 long): the bytes of
/// [`encode_block`] per block, compiled 16 lanes wide where the CPU has AVX-512 (every
/// step is per value or a maximum, so the width does not change them). A block whose scale
/// does not fit fp16 stops the row: `Err(scale)`, with `out` partly written.
pub fn encode_row(row: &[f32], out: &mut [u8]) -> Result<(), f32> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512 F (checked just above).
        return unsafe { q8_0_row_avx512(row, out) };
    }
    q8_0_row(row, out)
}

/// `q8_0` blocks of a row decoded (`code * scale`, the values of [`decode_block`]),
/// 16 at a time where the SIMD level is AVX-512: the ring's rows as attention reads them.
pub fn decode_row(bytes: &[u8], out: &mut [f32]) {
    let blocks = out.len() / BLOCK_VALUES;
    assert!(bytes.len() >= blocks * BLOCK_BYTES, "q8_0 row bytes");
    #[cfg(target_arch = "x86_64")]
    if crate::simd::avx512() {
        // SAFETY: the AVX-512 level is only chosen where the CPU reported AVX-512 F and
        // F16C; `bytes` holds the blocks of `out` (asserted).
        return unsafe { q8_0_decode_avx512(bytes, out, blocks) };
    }
    for (o, x) in out
        .chunks_exact_mut(BLOCK_VALUES)
        .zip(bytes.chunks_exact(BLOCK_BYTES))
    {
        decode_block(x, o);
    }
}

/// [`encode_row`] compiled for AVX-512.
///
/// # Safety
/// The CPU must have AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn q8_0_row_avx512(row: &[f32], out: &mut [u8]) -> Result<(), f32> {
    q8_0_row(row, out)
}

#[inline(always)]
fn q8_0_row(row: &[f32], out: &mut [u8]) -> Result<(), f32> {
    for (x, o) in row
        .chunks_exact(BLOCK_VALUES)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        // The largest magnitude as an integer maximum of the bit patterns (the same value as
        // `block_scales`' fold for finite values, and it vectorises).
        let top = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
        let d = f32::from_bits(top) / 127.0;
        if !f16::from_f32(d).is_finite() {
            return Err(d);
        }
        let id = inverse_or_zero(d);
        put_f16(o, d);
        if id.is_finite() {
            // |v id| <= 127 (and a little): `roundf_away` below 2^23 and `c_cast_byte` of a
            // finite value in range, without their branches for the other cases.
            for (b, &v) in o[CODES_OFFSET..BLOCK_BYTES].iter_mut().zip(x) {
                let n = v * id;
                let a = n.abs();
                let whole = a as i32 as f32;
                let r = whole + if a - whole >= 0.5 { 1.0 } else { 0.0 };
                *b = (if n < 0.0 { -r } else { r }) as i32 as u8;
            }
        } else {
            // A subnormal scale (its inverse overflows): the general steps.
            for (b, &v) in o[CODES_OFFSET..BLOCK_BYTES].iter_mut().zip(x) {
                *b = c_cast_byte(roundf_away(v * id));
            }
        }
    }
    Ok(())
}

/// [`decode_row`] on AVX-512: per block the fp16 scale converted (F16C,
/// exact) and the codes widened and multiplied by it, 16 values per instruction.
///
/// # Safety
/// The CPU must have AVX-512 F and F16C; `bytes` must hold `blocks` blocks and `out` their
/// values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn q8_0_decode_avx512(bytes: &[u8], out: &mut [f32], blocks: usize) {
    use std::arch::x86_64::*;
    let (src, dst) = (bytes.as_ptr(), out.as_mut_ptr());
    for b in 0..blocks {
        // SAFETY (whole block): block `b` lies inside `bytes`, its values inside `out`.
        let blk = src.add(b * BLOCK_BYTES);
        let scale =
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                u16::from_le_bytes([*blk, *blk.add(1)]) as i32,
            )));
        let s = _mm512_set1_ps(scale);
        for k in 0..2 {
            let codes = _mm_loadu_si128(blk.add(CODES_OFFSET + 16 * k) as *const __m128i);
            let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
            _mm512_storeu_ps(dst.add(b * BLOCK_VALUES + 16 * k), _mm512_mul_ps(v, s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row encoder writes the bytes of `encode_block` per block, on every path.
    #[test]
    fn q8_0_rows_equal_their_blocks() {
        let mut rng = crate::rng::SplitMix64::new(12);
        let mut row = rng.gaussians(256);
        row[..32].fill(0.0);
        row[40] = 127.0;
        row[41] = 0.5;
        row[42] = -2.5;
        row[70] = 1e-40;
        row[100] = 6.0e6;
        row[130] = -3.4e3;
        row[224..256].fill(1e-40); // a subnormal scale
        row[230] = -3e-40;
        let mut want = vec![0u8; 8 * BLOCK_BYTES];
        for (x, o) in row
            .chunks_exact(BLOCK_VALUES)
            .zip(want.chunks_exact_mut(BLOCK_BYTES))
        {
            encode_block(x, o);
        }
        let mut got = vec![0u8; 8 * BLOCK_BYTES];
        encode_row(&row, &mut got).unwrap();
        assert_eq!(got, want);
        let mut portable = vec![0u8; 8 * BLOCK_BYTES];
        q8_0_row(&row, &mut portable).unwrap();
        assert_eq!(portable, want);
        row[200] = 1e7; // scale 78,740: past fp16
        assert!(encode_row(&row, &mut got).is_err());
    }

    /// The row decoder gives the values of `decode_block` per block, subnormal and
    /// extreme scales included.
    #[test]
    fn q8_0_row_decoding_equals_the_blocks() {
        let mut rng = crate::rng::SplitMix64::new(13);
        let mut bytes = Vec::new();
        for b in 0..8u32 {
            let mut block = [0u8; BLOCK_BYTES];
            let scale: u16 = match b {
                0 => 0x0001, // smallest subnormal
                1 => 0x7bff, // largest finite
                2 => 0x8000, // negative zero
                _ => (rng.next_u64() as u16) & 0x7bff,
            };
            block[..2].copy_from_slice(&scale.to_le_bytes());
            for c in &mut block[2..] {
                *c = rng.next_u64() as u8;
            }
            block[2] = 0x80; // -128
            block[3] = 0x7f;
            bytes.extend_from_slice(&block);
        }
        let (mut want, mut got) = (vec![0.0f32; 256], vec![0.0f32; 256]);
        for (x, o) in bytes
            .chunks_exact(BLOCK_BYTES)
            .zip(want.chunks_exact_mut(BLOCK_VALUES))
        {
            decode_block(x, o);
        }
        decode_row(&bytes, &mut got);
        assert!(want
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
