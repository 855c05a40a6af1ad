//! llama.cpp block formats `q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, byte-for-byte equal to the
//! `gguf` Python package's `gguf.quants.quantize` (itself equal to ggml's reference quantizers).
//!
//! Every step mirrors that reference in f32 with the same operation order (no fused multiply-add),
//! including its float-to-integer casts, so the bytes agree on zeros, constants, extremes and
//! denormals, not just on typical data.

use crate::codec::q8_0::{self, c_cast_byte, get_f16, inverse_or_zero, put_f16};

/// Values per block for every format here.
pub const QK: usize = 32;

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
        GgmlFormat::Q8_0 => (q8_0::scale_of(block), None),
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
            GgmlFormat::Q8_0 => q8_0::BLOCK_BYTES,
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
            GgmlFormat::Q8_0 => q8_0::encode_block(block, out),
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

    /// Dequantizes one block exactly as `gguf.quants.dequantize` does.
    pub fn decode_block(self, bytes: &[u8], out: &mut [f32]) {
        let d = get_f16(bytes);
        let mut q = [0u8; QK];
        match self {
            GgmlFormat::Q8_0 => q8_0::decode_block(bytes, out),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::q8_0::roundf_away;

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
