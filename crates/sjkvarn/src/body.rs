//! Scalar body record: one KV head, one 128-token group, K and V rounded after balancing.
//!
//! Dequantization with the balancing scales absorbed, all factors fp16:
//! `K[c,t] = (q * a_K[c] + z_K[c]) * s_K[t]` (keys rounded per channel over the group's tokens)
//! `V[t,c] = (q * a_V[t] + z_V[t]) * s_V[c]` (values rounded per token).
//! Per-row rounding is invariant to the row scale, so only the balancing's column scales are
//! stored (`s_K` per token, `s_V` per channel); the row scales are absorbed into `a` and `z`. The
//! stored fp16 scales are the ones rounding sees, so fp16 rounding of a scale costs no accuracy.
//!
//! Sub-record for a rotation width `R` (the whole head up to 256; each half of a 512 head):
//! `[K codes R*G*kb/8][V codes G*R*vb/8][a_K R][z_K R][s_K G][a_V G][z_V G][s_V R]` (fp16 LE),
//! K codes channel-major (each channel's 128 tokens in a row), V codes token-major, LSB-first.
//! Metadata is `(2R+G)*2 + (R+2G)*2` bytes per sub-record.

use crate::balance::{balance, BalanceConfig};
use crate::bitpack;
use crate::error::{check_finite, CodecError, Result};
use crate::hadamard::{rotate_rows, rotation_size};
use half::f16;

/// Tokens per sealed group.
pub const GROUP: usize = 128;

/// Bit widths the scalar body supports.
pub const BODY_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];

/// Geometry of a body record: head size and K/V bit widths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodySpec {
    pub head_dim: usize,
    pub k_bits: u32,
    pub v_bits: u32,
}

fn check_bits(bits: u32) -> Result<()> {
    if BODY_BITS.contains(&bits) {
        Ok(())
    } else {
        Err(CodecError::UnsupportedBits {
            what: "scalar body",
            bits,
            allowed: "2, 3, 4, 5, 6, 8",
        })
    }
}

impl BodySpec {
    pub fn new(head_dim: usize, k_bits: u32, v_bits: u32) -> Result<Self> {
        rotation_size(head_dim)?;
        check_bits(k_bits)?;
        check_bits(v_bits)?;
        Ok(Self {
            head_dim,
            k_bits,
            v_bits,
        })
    }

    /// Rotation (and balancing) width `R`.
    pub fn width(&self) -> usize {
        rotation_size(self.head_dim).expect("validated in new")
    }

    fn halves(&self) -> usize {
        self.head_dim / self.width()
    }

    fn k_code_bytes(&self) -> usize {
        bitpack::packed_len(self.width() * GROUP, self.k_bits)
    }

    fn v_code_bytes(&self) -> usize {
        bitpack::packed_len(self.width() * GROUP, self.v_bits)
    }

    /// fp16 scale bytes of one record (all halves).
    pub fn metadata_bytes(&self) -> usize {
        let r = self.width();
        self.halves() * ((2 * r + GROUP) * 2 + (r + 2 * GROUP) * 2)
    }

    fn sub_record_bytes(&self) -> usize {
        self.k_code_bytes() + self.v_code_bytes() + self.metadata_bytes() / self.halves()
    }

    /// Bytes of one record (K and V of one KV head, one group).
    pub fn record_bytes(&self) -> usize {
        self.halves() * self.sub_record_bytes()
    }

    /// Values a record holds (K and V).
    pub fn values(&self) -> usize {
        2 * GROUP * self.head_dim
    }

    /// Bits per stored value including the fp16 scales.
    pub fn bits_per_value(&self) -> f64 {
        self.record_bytes() as f64 * 8.0 / self.values() as f64
    }
}

/// Codes (row-major) and the fp16 step `a` and offset `z` of every row.
struct RoundedRows<'a> {
    codes: &'a mut [u8],
    a: Vec<f16>,
    z: Vec<f16>,
}

/// Per-row asymmetric min/max rounding of a row-major `rows x cols` tile divided by the column
/// scales `col_scale`.
fn round_rows<'a>(
    tile: &[f32],
    cols: usize,
    col_scale: &[f32],
    bits: u32,
    codes: &'a mut [u8],
) -> Result<RoundedRows<'a>> {
    let rows = tile.len() / cols;
    let (mut a_out, mut z_out) = (vec![f16::ZERO; rows], vec![f16::ZERO; rows]);
    let top = ((1u32 << bits) - 1) as f32;
    let inv: Vec<f32> = col_scale.iter().map(|s| 1.0 / s).collect();
    let mut row = vec![0.0f32; cols];
    for i in 0..rows {
        for j in 0..cols {
            row[j] = tile[i * cols + j] * inv[j];
        }
        let (lo, hi) = row
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        let a = f16::from_f32((hi - lo) / top);
        let z = f16::from_f32(lo);
        if !a.is_finite() || !z.is_finite() {
            return Err(CodecError::ScaleOverflow {
                what: "body row scale",
                value: if a.is_finite() { lo } else { (hi - lo) / top },
            });
        }
        let (af, zf) = (a.to_f32(), z.to_f32());
        let inv_a = if af > 0.0 { 1.0 / af } else { 0.0 };
        for j in 0..cols {
            codes[i * cols + j] = ((row[j] - zf) * inv_a).round().clamp(0.0, top) as u8;
        }
        a_out[i] = a;
        z_out[i] = z;
    }
    Ok(RoundedRows {
        codes,
        a: a_out,
        z: z_out,
    })
}

/// Column scales of a balanced tile, rounded to fp16 (always positive and finite: the column
/// log scales are centred and clamped, so they lie within about e^±10.3).
fn column_scales(tile: &[f32], rows: usize, cols: usize, config: &BalanceConfig) -> Vec<f16> {
    let b = balance(tile, rows, cols, config);
    b.col_log
        .iter()
        .map(|&c| f16::from_f32(c.exp() as f32).max(f16::from_bits(1)))
        .collect()
}

fn write_f16s(out: &mut [u8], values: &[f16]) -> usize {
    for (chunk, v) in out.chunks_exact_mut(2).zip(values) {
        chunk.copy_from_slice(&v.to_le_bytes());
    }
    values.len() * 2
}

fn read_f32s(bytes: &[u8], n: usize) -> Vec<f32> {
    bytes[..2 * n]
        .chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect()
}

impl BodySpec {
    fn check_tile(&self, what: &'static str, tile: &[f32]) -> Result<()> {
        let expected = GROUP * self.head_dim;
        if tile.len() != expected {
            return Err(CodecError::LengthMismatch {
                what,
                expected,
                got: tile.len(),
            });
        }
        check_finite(tile)
    }

    /// Encodes one record from rotated K and V tiles, each row-major `[G tokens][head_dim]`.
    /// `out` must be `record_bytes()` long; on error it may be partly written.
    pub fn encode_rotated(
        &self,
        k: &[f32],
        v: &[f32],
        config: &BalanceConfig,
        out: &mut [u8],
    ) -> Result<()> {
        self.check_tile("K tile", k)?;
        self.check_tile("V tile", v)?;
        config.validate()?;
        if out.len() != self.record_bytes() {
            return Err(CodecError::LengthMismatch {
                what: "record buffer",
                expected: self.record_bytes(),
                got: out.len(),
            });
        }
        let (r, d) = (self.width(), self.head_dim);
        let sub = self.sub_record_bytes();
        let mut k_tile = vec![0.0f32; r * GROUP]; // [channel][token]
        let mut v_tile = vec![0.0f32; GROUP * r]; // [token][channel]
        let mut codes = vec![0u8; r * GROUP];
        for (half, rec) in out.chunks_exact_mut(sub).enumerate() {
            let c0 = half * r;
            for t in 0..GROUP {
                for c in 0..r {
                    k_tile[c * GROUP + t] = k[t * d + c0 + c];
                }
                v_tile[t * r..(t + 1) * r].copy_from_slice(&v[t * d + c0..t * d + c0 + r]);
            }
            let (k_codes, rest) = rec.split_at_mut(self.k_code_bytes());
            let (v_codes, meta) = rest.split_at_mut(self.v_code_bytes());

            // K: rows = channels, columns = tokens; stored column scales are per token.
            let s_k = column_scales(&k_tile, r, GROUP, config);
            let s_k32: Vec<f32> = s_k.iter().map(|s| s.to_f32()).collect();
            let rk = round_rows(&k_tile, GROUP, &s_k32, self.k_bits, &mut codes)?;
            bitpack::pack(rk.codes, self.k_bits, k_codes);
            let (a_k, z_k) = (rk.a, rk.z);

            // V: rows = tokens, columns = channels; stored column scales are per channel.
            let s_v = column_scales(&v_tile, GROUP, r, config);
            let s_v32: Vec<f32> = s_v.iter().map(|s| s.to_f32()).collect();
            let rv = round_rows(&v_tile, r, &s_v32, self.v_bits, &mut codes)?;
            bitpack::pack(rv.codes, self.v_bits, v_codes);
            let (a_v, z_v) = (rv.a, rv.z);

            let mut at = 0;
            for part in [&a_k, &z_k, &s_k, &a_v, &z_v, &s_v] {
                at += write_f16s(&mut meta[at..], part);
            }
        }
        Ok(())
    }

    /// Decodes one record into rotated K and V tiles, each `[G][head_dim]`.
    pub fn decode_rotated(&self, record: &[u8], k: &mut [f32], v: &mut [f32]) -> Result<()> {
        if record.len() != self.record_bytes() {
            return Err(CodecError::LengthMismatch {
                what: "body record",
                expected: self.record_bytes(),
                got: record.len(),
            });
        }
        let expected = GROUP * self.head_dim;
        for (what, len) in [("K output", k.len()), ("V output", v.len())] {
            if len != expected {
                return Err(CodecError::LengthMismatch {
                    what,
                    expected,
                    got: len,
                });
            }
        }
        let (r, d) = (self.width(), self.head_dim);
        let sub = self.sub_record_bytes();
        let mut codes = vec![0u8; r * GROUP];
        for (half, rec) in record.chunks_exact(sub).enumerate() {
            let c0 = half * r;
            let (k_codes, rest) = rec.split_at(self.k_code_bytes());
            let (v_codes, meta) = rest.split_at(self.v_code_bytes());
            let a_k = read_f32s(meta, r);
            let z_k = read_f32s(&meta[2 * r..], r);
            let s_k = read_f32s(&meta[4 * r..], GROUP);
            let m = &meta[(2 * r + GROUP) * 2..];
            let a_v = read_f32s(m, GROUP);
            let z_v = read_f32s(&m[2 * GROUP..], GROUP);
            let s_v = read_f32s(&m[4 * GROUP..], r);

            bitpack::unpack(k_codes, self.k_bits, &mut codes);
            for c in 0..r {
                for t in 0..GROUP {
                    k[t * d + c0 + c] = (codes[c * GROUP + t] as f32 * a_k[c] + z_k[c]) * s_k[t];
                }
            }
            bitpack::unpack(v_codes, self.v_bits, &mut codes);
            for t in 0..GROUP {
                for c in 0..r {
                    v[t * d + c0 + c] = (codes[t * r + c] as f32 * a_v[t] + z_v[t]) * s_v[c];
                }
            }
        }
        Ok(())
    }

    /// Encodes from K and V in the model's frame: rotates copies, then [`Self::encode_rotated`].
    pub fn encode(
        &self,
        k: &[f32],
        v: &[f32],
        config: &BalanceConfig,
        out: &mut [u8],
    ) -> Result<()> {
        self.check_tile("K tile", k)?;
        self.check_tile("V tile", v)?;
        let (mut kr, mut vr) = (k.to_vec(), v.to_vec());
        rotate_rows(&mut kr, self.head_dim)?;
        rotate_rows(&mut vr, self.head_dim)?;
        self.encode_rotated(&kr, &vr, config, out)
    }

    /// Decodes into the model's frame: [`Self::decode_rotated`], then rotates back.
    pub fn decode(&self, record: &[u8], k: &mut [f32], v: &mut [f32]) -> Result<()> {
        self.decode_rotated(record, k, v)?;
        rotate_rows(k, self.head_dim)?;
        rotate_rows(v, self.head_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_sizes_follow_the_formula() {
        for d in [64usize, 128, 256] {
            let s = BodySpec::new(d, 4, 4).unwrap();
            assert_eq!(
                s.metadata_bytes(),
                (2 * d + GROUP) * 2 + (d + 2 * GROUP) * 2
            );
            assert_eq!(s.record_bytes(), d * GROUP + s.metadata_bytes());
        }
        let s = BodySpec::new(256, 4, 4).unwrap();
        assert_eq!(s.metadata_bytes(), 2304);
        assert!((s.bits_per_value() - 4.28125).abs() < 1e-12);
        let s = BodySpec::new(256, 3, 2).unwrap();
        assert_eq!(s.record_bytes(), 256 * 128 * 5 / 8 + 2304);
        // 512-wide heads: two independently balanced 256 halves
        let s = BodySpec::new(512, 4, 4).unwrap();
        assert_eq!(s.metadata_bytes(), 2 * 2304);
    }

    #[test]
    fn rejects_bad_geometry_and_input() {
        assert!(matches!(
            BodySpec::new(96, 4, 4),
            Err(CodecError::UnsupportedHeadDim(96))
        ));
        assert!(matches!(
            BodySpec::new(128, 1, 4),
            Err(CodecError::UnsupportedBits { .. })
        ));
        assert!(matches!(
            BodySpec::new(128, 4, 7),
            Err(CodecError::UnsupportedBits { .. })
        ));
        let s = BodySpec::new(64, 4, 4).unwrap();
        let mut out = vec![0u8; s.record_bytes()];
        let good = vec![0.5f32; GROUP * 64];
        let mut bad = good.clone();
        bad[77] = f32::NAN;
        let cfg = BalanceConfig::default();
        assert_eq!(
            s.encode(&good, &bad, &cfg, &mut out),
            Err(CodecError::NonFinite { index: 77 })
        );
        assert!(matches!(
            s.encode(&good[1..], &good, &cfg, &mut out),
            Err(CodecError::LengthMismatch { .. })
        ));
        assert!(matches!(
            s.decode(&out[1..], &mut good.clone(), &mut good.clone()),
            Err(CodecError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn constant_and_zero_tiles_round_trip_exactly() {
        let s = BodySpec::new(128, 2, 2).unwrap();
        let cfg = BalanceConfig::default();
        for value in [0.0f32, 1.5, -3.25] {
            let tile = vec![value; GROUP * 128];
            let mut rec = vec![0u8; s.record_bytes()];
            s.encode_rotated(&tile, &tile, &cfg, &mut rec).unwrap();
            let (mut k, mut v) = (vec![9.0; tile.len()], vec![9.0; tile.len()]);
            s.decode_rotated(&rec, &mut k, &mut v).unwrap();
            assert_eq!(k, tile);
            assert_eq!(v, tile);
        }
    }
}
