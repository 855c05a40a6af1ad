//! The rotated norm-coded block family: `turbo3`, `turbo4`, `tq5_0` and the staging format `tq6_0`.
//!
//! A block of `n` already-rotated values (128, or 64 for 64-wide heads) is divided by its L2 norm,
//! so each coordinate is close to N(0, 1/n); every coordinate is replaced by the nearest Lloyd-Max
//! centroid of that distribution. The stored fp16 scale is the *corrected* norm
//! `||x|| / ||u_hat||`, so the decoded block keeps the original norm exactly (up to fp16).
//!
//! Block bytes: `[corrected norm: fp16 LE][n codes, LSB-first, `bits` each]`.

use crate::codec::extension::bitpack;
use crate::codec::lloyd_max::{gaussian_table, nearest_index};
use crate::error::{CodecError, Result};
use half::f16;

/// Geometry of one block: code width and values per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TqBlock {
    pub bits: u32,
    pub len: usize,
}

impl TqBlock {
    pub fn new(bits: u32, len: usize) -> Result<Self> {
        if !(3..=6).contains(&bits) {
            return Err(CodecError::UnsupportedBits {
                what: "rotated norm-coded block",
                bits,
                allowed: "3, 4, 5, 6",
            });
        }
        if len != 64 && len != 128 {
            return Err(CodecError::UnsupportedRotationLength(len));
        }
        Ok(Self { bits, len })
    }

    pub fn bytes(&self) -> usize {
        2 + bitpack::packed_len(self.len, self.bits)
    }

    fn table(&self) -> &'static [f32] {
        gaussian_table(self.bits).expect("widths 3..=6 have shipped tables")
    }

    /// Encodes one block of rotated values into `out` (`self.bytes()` long). Inputs must be finite.
    pub fn encode_rotated(&self, x: &[f32], out: &mut [u8]) -> Result<()> {
        debug_assert_eq!(x.len(), self.len);
        let table = self.table();
        let norm = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
        let mut codes = [0u8; 128];
        let codes = &mut codes[..self.len];
        let stored = if norm == 0.0 {
            codes.fill(nearest_index(table, 0.0) as u8);
            0.0f32
        } else {
            // Compare in the N(0,1) frame of the table: t = x * sqrt(n) / ||x||.
            let to_table = (self.len as f64).sqrt() / norm;
            let mut decoded_sq = 0.0f64;
            for (code, &v) in codes.iter_mut().zip(x) {
                let idx = nearest_index(table, (v as f64 * to_table) as f32);
                *code = idx as u8;
                let c = table[idx] as f64;
                decoded_sq += c * c;
            }
            // ||u_hat|| with u_hat = table / sqrt(n)
            let unit_norm = (decoded_sq / self.len as f64).sqrt();
            (norm / unit_norm) as f32
        };
        let stored16 = f16::from_f32(stored);
        if !stored16.is_finite() {
            return Err(CodecError::ScaleOverflow {
                what: "block norm",
                value: stored,
            });
        }
        out[..2].copy_from_slice(&stored16.to_le_bytes());
        bitpack::pack(codes, self.bits, &mut out[2..self.bytes()]);
        Ok(())
    }

    /// Decodes one block into rotated values.
    pub fn decode_rotated(&self, block: &[u8], out: &mut [f32]) {
        let table = self.table();
        let stored = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let step = stored / (self.len as f32).sqrt();
        let mut codes = [0u8; 128];
        let codes = &mut codes[..self.len];
        bitpack::unpack(&block[2..self.bytes()], self.bits, codes);
        for (o, &c) in out.iter_mut().zip(codes.iter()) {
            *o = step * table[c as usize];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaussian(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                // sum of 12 uniforms - 6: close enough to N(0,1) for a smoke test
                (0..12)
                    .map(|_| {
                        s = s
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        (s >> 40) as f32 / (1u64 << 24) as f32
                    })
                    .sum::<f32>()
                    - 6.0
            })
            .collect()
    }

    #[test]
    fn sizes_match_the_spec() {
        assert_eq!(TqBlock::new(3, 128).unwrap().bytes(), 50);
        assert_eq!(TqBlock::new(4, 128).unwrap().bytes(), 66);
        assert_eq!(TqBlock::new(5, 128).unwrap().bytes(), 82);
        assert_eq!(TqBlock::new(6, 128).unwrap().bytes(), 98);
        assert_eq!(TqBlock::new(6, 64).unwrap().bytes(), 50);
        assert!(TqBlock::new(2, 128).is_err());
        assert!(TqBlock::new(6, 256).is_err());
    }

    #[test]
    fn keeps_the_norm_and_errors_shrink_with_bits() {
        let x = gaussian(128, 7);
        let norm: f32 = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        let mut prev = f32::INFINITY;
        for bits in 3..=6 {
            let b = TqBlock::new(bits, 128).unwrap();
            let mut buf = vec![0u8; b.bytes()];
            b.encode_rotated(&x, &mut buf).unwrap();
            let mut y = vec![0.0; 128];
            b.decode_rotated(&buf, &mut y);
            let ynorm: f32 = y.iter().map(|v| v * v).sum::<f32>().sqrt();
            assert!((ynorm - norm).abs() / norm < 1e-3, "norm kept to fp16");
            let err: f32 = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>()
                / (norm * norm);
            assert!(err < prev, "{bits} bits: {err}");
            prev = err;
        }
        assert!(prev < 0.002, "6-bit relative error {prev}");
    }

    #[test]
    fn zero_block_decodes_to_zero() {
        let b = TqBlock::new(6, 128).unwrap();
        let mut buf = vec![0u8; b.bytes()];
        b.encode_rotated(&[0.0; 128], &mut buf).unwrap();
        let mut y = vec![1.0; 128];
        b.decode_rotated(&buf, &mut y);
        assert!(y.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn oversized_block_is_an_error() {
        let b = TqBlock::new(4, 128).unwrap();
        let mut buf = vec![0u8; b.bytes()];
        let x = vec![60000.0f32; 128];
        assert!(matches!(
            b.encode_rotated(&x, &mut buf),
            Err(CodecError::ScaleOverflow { .. })
        ));
    }
}
