//! llama.cpp block formats `q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, byte-for-byte equal to the
//! `gguf` Python package's `gguf.quants.quantize` (itself equal to ggml's reference quantizers).
//!
//! Every step mirrors that reference in f32 with the same operation order (no fused multiply-add),
//! including its float-to-integer casts, so the bytes agree on zeros, constants, extremes and
//! denormals, not just on typical data.

use half::f16;

/// Values per block for every format here.
pub const QK: usize = 32;

/// The cast numpy performs for `float32 -> (u)int8` on x86: NaN, infinities and values outside
/// the 32-bit range become 0, anything else truncates toward zero and keeps the low byte.
fn c_cast_byte(v: f32) -> u8 {
    if !v.is_finite() || v.abs() >= 2_147_483_648.0 {
        0
    } else {
        (v as i32) as u8
    }
}

/// `np.where(d == 0, 0, 1 / d)`
fn inverse_or_zero(d: f32) -> f32 {
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
fn roundf_away(n: f32) -> f32 {
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

/// The value with the largest magnitude (first one on ties), sign kept, as `argmax(abs)`.
fn signed_absmax(block: &[f32]) -> f32 {
    let mut best = block[0];
    for &v in &block[1..] {
        if v.abs() > best.abs() {
            best = v;
        }
    }
    best
}

fn min_max(block: &[f32]) -> (f32, f32) {
    block
        .iter()
        .fold((block[0], block[0]), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

fn put_f16(out: &mut [u8], v: f32) {
    out[..2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

fn get_f16(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Low nibbles hold values 0..16, high nibbles values 16..32.
fn pack_nibbles(q: &[u8; QK], out: &mut [u8]) {
    for j in 0..QK / 2 {
        out[j] = (q[j] & 0x0F) | (q[j + QK / 2] << 4);
    }
}

fn unpack_nibbles(packed: &[u8], q: &mut [u8; QK]) {
    for j in 0..QK / 2 {
        q[j] = packed[j] & 0x0F;
        q[j + QK / 2] = packed[j] >> 4;
    }
}

/// Bit 4 of each of the 32 codes, as a little-endian u32.
fn pack_high_bits(q: &[u8; QK], out: &mut [u8]) {
    let mut qh = 0u32;
    for (j, &v) in q.iter().enumerate() {
        qh |= (((v >> 4) & 1) as u32) << j;
    }
    out[..4].copy_from_slice(&qh.to_le_bytes());
}

fn unpack_high_bits(b: &[u8], q: &mut [u8; QK]) {
    let qh = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((qh >> j) & 1) as u8) << 4;
    }
}

/// Returns the f32 scale(s) a block would store, so callers can refuse fp16 overflow first.
pub fn block_scales(format: GgmlFormat, block: &[f32]) -> (f32, Option<f32>) {
    match format {
        GgmlFormat::Q8_0 => (
            block.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0,
            None,
        ),
        GgmlFormat::Q4_0 => (signed_absmax(block) / -8.0, None),
        GgmlFormat::Q5_0 => (signed_absmax(block) / -16.0, None),
        GgmlFormat::Q4_1 | GgmlFormat::Q5_1 => {
            let (lo, hi) = min_max(block);
            let levels = if format == GgmlFormat::Q4_1 {
                15.0
            } else {
                31.0
            };
            ((hi - lo) / levels, Some(lo))
        }
    }
}

/// The five ggml formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlFormat {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
}

impl GgmlFormat {
    /// Bytes per 32-value block.
    pub const fn block_bytes(self) -> usize {
        match self {
            GgmlFormat::Q8_0 => 34,
            GgmlFormat::Q4_0 => 18,
            GgmlFormat::Q4_1 => 20,
            GgmlFormat::Q5_0 => 22,
            GgmlFormat::Q5_1 => 24,
        }
    }

    /// Quantizes one block of 32 finite values into `out` (`block_bytes()` long).
    pub fn encode_block(self, block: &[f32], out: &mut [u8]) {
        debug_assert_eq!(block.len(), QK);
        let mut q = [0u8; QK];
        match self {
            GgmlFormat::Q8_0 => {
                let (d, _) = block_scales(self, block);
                let id = inverse_or_zero(d);
                put_f16(out, d);
                for (o, &x) in out[2..34].iter_mut().zip(block) {
                    *o = c_cast_byte(roundf_away(x * id));
                }
            }
            GgmlFormat::Q4_0 | GgmlFormat::Q5_0 => {
                let (d, _) = block_scales(self, block);
                let id = inverse_or_zero(d);
                let (bias, top) = if self == GgmlFormat::Q4_0 {
                    (8.5f32, 15u8)
                } else {
                    (16.5f32, 31u8)
                };
                for (v, &x) in q.iter_mut().zip(block) {
                    *v = c_cast_byte((x * id + bias).trunc()).min(top);
                }
                put_f16(out, d);
                if self == GgmlFormat::Q4_0 {
                    pack_nibbles(&q, &mut out[2..18]);
                } else {
                    pack_high_bits(&q, &mut out[2..6]);
                    pack_nibbles(&q, &mut out[6..22]);
                }
            }
            GgmlFormat::Q4_1 | GgmlFormat::Q5_1 => {
                let (d, lo) = block_scales(self, block);
                let lo = lo.unwrap_or(0.0);
                let id = inverse_or_zero(d);
                let top = if self == GgmlFormat::Q4_1 { 15u8 } else { 31u8 };
                for (v, &x) in q.iter_mut().zip(block) {
                    *v = c_cast_byte(((x - lo) * id + 0.5).trunc()).min(top);
                }
                put_f16(out, d);
                put_f16(&mut out[2..], lo);
                if self == GgmlFormat::Q4_1 {
                    pack_nibbles(&q, &mut out[4..20]);
                } else {
                    pack_high_bits(&q, &mut out[4..8]);
                    pack_nibbles(&q, &mut out[8..24]);
                }
            }
        }
    }

    /// `q8_0` blocks of a row of finite values (a multiple of 32 long): the bytes of
    /// [`Self::encode_block`] per block, compiled 16 lanes wide where the CPU has AVX-512 (every
    /// step is per value or a maximum, so the width does not change them). A block whose scale
    /// does not fit fp16 stops the row: `Err(scale)`, with `out` partly written.
    pub fn encode_q8_0_row(row: &[f32], out: &mut [u8]) -> Result<(), f32> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (checked just above).
            return unsafe { q8_0_row_avx512(row, out) };
        }
        q8_0_row(row, out)
    }

    /// `q8_0` blocks of a row decoded (`code * scale`, the values of [`Self::decode_block`]),
    /// 16 at a time where the SIMD level is AVX-512: the ring's rows as attention reads them.
    pub fn decode_q8_0_row(bytes: &[u8], out: &mut [f32]) {
        let f = GgmlFormat::Q8_0;
        let blocks = out.len() / QK;
        assert!(bytes.len() >= blocks * f.block_bytes(), "q8_0 row bytes");
        #[cfg(target_arch = "x86_64")]
        if crate::simd::avx512() {
            // SAFETY: the AVX-512 level is only chosen where the CPU reported AVX-512 F and
            // F16C; `bytes` holds the blocks of `out` (asserted).
            return unsafe { q8_0_decode_avx512(bytes, out, blocks) };
        }
        for (o, x) in out
            .chunks_exact_mut(QK)
            .zip(bytes.chunks_exact(f.block_bytes()))
        {
            f.decode_block(x, o);
        }
    }

    /// Dequantizes one block exactly as `gguf.quants.dequantize` does.
    pub fn decode_block(self, bytes: &[u8], out: &mut [f32]) {
        let d = get_f16(bytes);
        let mut q = [0u8; QK];
        match self {
            GgmlFormat::Q8_0 => {
                for (o, &b) in out.iter_mut().zip(&bytes[2..34]) {
                    *o = (b as i8) as f32 * d;
                }
            }
            GgmlFormat::Q4_0 => {
                unpack_nibbles(&bytes[2..18], &mut q);
                for (o, &v) in out.iter_mut().zip(&q) {
                    *o = d * (v as i32 - 8) as f32;
                }
            }
            GgmlFormat::Q5_0 => {
                unpack_nibbles(&bytes[6..22], &mut q);
                unpack_high_bits(&bytes[2..6], &mut q);
                for (o, &v) in out.iter_mut().zip(&q) {
                    *o = d * (v as i32 - 16) as f32;
                }
            }
            GgmlFormat::Q4_1 | GgmlFormat::Q5_1 => {
                let m = get_f16(&bytes[2..]);
                if self == GgmlFormat::Q4_1 {
                    unpack_nibbles(&bytes[4..20], &mut q);
                } else {
                    unpack_nibbles(&bytes[8..24], &mut q);
                    unpack_high_bits(&bytes[4..8], &mut q);
                }
                for (o, &v) in out.iter_mut().zip(&q) {
                    *o = d * v as f32 + m;
                }
            }
        }
    }
}

/// [`GgmlFormat::encode_q8_0_row`] compiled for AVX-512.
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
    let f = GgmlFormat::Q8_0;
    for (x, o) in row
        .chunks_exact(QK)
        .zip(out.chunks_exact_mut(f.block_bytes()))
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
            for (b, &v) in o[2..34].iter_mut().zip(x) {
                let n = v * id;
                let a = n.abs();
                let whole = a as i32 as f32;
                let r = whole + if a - whole >= 0.5 { 1.0 } else { 0.0 };
                *b = (if n < 0.0 { -r } else { r }) as i32 as u8;
            }
        } else {
            // A subnormal scale (its inverse overflows): the general steps.
            for (b, &v) in o[2..34].iter_mut().zip(x) {
                *b = c_cast_byte(roundf_away(v * id));
            }
        }
    }
    Ok(())
}

/// [`GgmlFormat::decode_q8_0_row`] on AVX-512: per block the fp16 scale converted (F16C,
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
        let blk = src.add(b * 34);
        let scale =
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                u16::from_le_bytes([*blk, *blk.add(1)]) as i32,
            )));
        let s = _mm512_set1_ps(scale);
        for k in 0..2 {
            let codes = _mm_loadu_si128(blk.add(2 + 16 * k) as *const __m128i);
            let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
            _mm512_storeu_ps(dst.add(b * QK + 16 * k), _mm512_mul_ps(v, s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [GgmlFormat; 5] = [
        GgmlFormat::Q8_0,
        GgmlFormat::Q4_0,
        GgmlFormat::Q4_1,
        GgmlFormat::Q5_0,
        GgmlFormat::Q5_1,
    ];

    /// The row encoder writes the bytes of `encode_block` per block on every path: halves,
    /// zeros, denormals, extremes; and stops at a block whose scale overflows fp16.
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
        let f = GgmlFormat::Q8_0;
        let mut want = vec![0u8; 8 * 34];
        for (x, o) in row.chunks_exact(QK).zip(want.chunks_exact_mut(34)) {
            f.encode_block(x, o);
        }
        let mut got = vec![0u8; 8 * 34];
        GgmlFormat::encode_q8_0_row(&row, &mut got).unwrap();
        assert_eq!(got, want);
        let mut portable = vec![0u8; 8 * 34];
        q8_0_row(&row, &mut portable).unwrap();
        assert_eq!(portable, want);
        row[200] = 1e7; // scale 78,740: past fp16
        assert!(GgmlFormat::encode_q8_0_row(&row, &mut got).is_err());
    }

    /// The row decoder gives the values of `decode_block` per block, subnormal and
    /// extreme scales included.
    #[test]
    fn q8_0_row_decoding_equals_the_blocks() {
        let mut rng = crate::rng::SplitMix64::new(13);
        let mut bytes = Vec::new();
        for b in 0..8u32 {
            let mut block = [0u8; 34];
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
        for (x, o) in bytes.chunks_exact(34).zip(want.chunks_exact_mut(QK)) {
            GgmlFormat::Q8_0.decode_block(x, o);
        }
        GgmlFormat::decode_q8_0_row(&bytes, &mut got);
        assert!(want
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn round_to_nearest_is_away_from_zero() {
        assert_eq!(roundf_away(2.5), 3.0);
        assert_eq!(roundf_away(-2.5), -3.0);
        assert_eq!(roundf_away(2.4999), 2.0);
        assert_eq!(c_cast_byte(-1.0), 255);
        assert_eq!(c_cast_byte(f32::NAN), 0);
        assert_eq!(c_cast_byte(300.0), 44);
    }

    /// The inline rounding gives gguf's floor formula's bits for every kind of value.
    #[test]
    fn rounding_matches_the_floor_formula() {
        let floor_formula = |n: f32| {
            let a = n.abs();
            let floored = a.floor();
            let b = floored + (2.0 * (a - floored)).floor();
            b * if n > 0.0 {
                1.0
            } else if n < 0.0 {
                -1.0
            } else {
                0.0
            }
        };
        let mut rng = crate::rng::SplitMix64::new(4);
        let mut values: Vec<f32> = rng.gaussians(20_000).iter().map(|x| x * 90.0).collect();
        for k in -300..300 {
            let h = k as f32 + 0.5;
            values.extend([h, h.next_down(), h.next_up(), k as f32]);
        }
        for e in 20..30 {
            let p = (1u32 << e) as f32;
            values.extend([p, p - 0.5, p + 1.0, -(p - 0.5), p.next_down(), p.next_up()]);
        }
        values.extend([0.0, -0.0, f32::MIN_POSITIVE, 1e-30, f32::MAX, -f32::MAX]);
        for &v in &values {
            assert_eq!(roundf_away(v).to_bits(), floor_formula(v).to_bits(), "{v}");
        }
    }

    #[test]
    fn error_is_within_one_step() {
        let block: Vec<f32> = (0..32)
            .map(|i| ((i * 7919) % 97) as f32 / 10.0 - 4.8)
            .collect();
        for f in ALL {
            let mut buf = vec![0u8; f.block_bytes()];
            f.encode_block(&block, &mut buf);
            let mut back = [0f32; 32];
            f.decode_block(&buf, &mut back);
            let step = match f {
                GgmlFormat::Q8_0 => 4.8 / 127.0,
                GgmlFormat::Q4_0 => 4.8 / 8.0,
                GgmlFormat::Q5_0 => 4.8 / 16.0,
                GgmlFormat::Q4_1 => 9.6 / 15.0,
                GgmlFormat::Q5_1 => 9.6 / 31.0,
            };
            for (a, b) in block.iter().zip(&back) {
                assert!((a - b).abs() <= step * 1.01, "{f:?}: {a} vs {b}");
            }
        }
    }
}
