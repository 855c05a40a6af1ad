//! The sjkvarn v1 scalar body record, kept as an extension for what the SJ-KVaRN reference does
//! not define (5/6/8-bit sides, the `best`/`rms` balancing of the paper-faithful KVarN
//! comparator): one KV head, one 128-token group, K and V rounded after balancing. The reference
//! record is `crate::codec`.
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
//! Metadata is `(2R+G)*2 + (R+2G)*2` bytes per sub-record.
//!
//! Codes are the integers `q` (K channel-major, V token-major). Trellis bodies are the
//! reference's only ([`crate::codec`]).

use crate::codec::extension::balance::{balance, BalanceConfig};
use crate::codec::extension::bitpack;
use crate::codec::hadamard::{rotate_rows, rotation_size};
use crate::error::{check_finite, CodecError, Result};
use half::f16;

/// Tokens per sealed group.
pub const GROUP: usize = 128;

/// Bit widths the scalar body supports.
pub const BODY_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];

/// The axis of a trellis run: the reference's token axis (each channel's 128 tokens) is the only
/// one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrellisAxis {
    Token,
}

/// How one side (K or V) of a record is coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyCoding {
    Scalar,
    Trellis(TrellisAxis),
}

impl BodyCoding {
    pub const fn name(self) -> &'static str {
        match self {
            BodyCoding::Scalar => "scalar",
            BodyCoding::Trellis(TrellisAxis::Token) => "trellis",
        }
    }
}

impl std::str::FromStr for BodyCoding {
    type Err = crate::CodecError;

    /// `"scalar"` or `"trellis"` (also `"trellis-token"`).
    fn from_str(name: &str) -> std::result::Result<Self, Self::Err> {
        match name {
            "scalar" => Ok(BodyCoding::Scalar),
            "trellis" | "trellis-token" => Ok(BodyCoding::Trellis(TrellisAxis::Token)),
            _ => Err(crate::CodecError::UnknownName {
                what: "body",
                allowed: "'scalar' or 'trellis' (the reference's 3/3, 3/2, 2/2)",
                got: name.into(),
            }),
        }
    }
}

/// Geometry of a body record: head size, K/V bit widths and K/V coding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodySpec {
    pub head_dim: usize,
    pub k_bits: u32,
    pub v_bits: u32,
    pub k_coding: BodyCoding,
    pub v_coding: BodyCoding,
}

/// One half of a decoded record: unit values (integer codes or trellis codebook values) and
/// the fp16 scales, as f32. See [`BodySpec::decode_half`].
#[derive(Debug, Clone)]
pub struct DecodedHalf {
    /// `[R][G]`, channel-major.
    pub k_units: Vec<f32>,
    pub a_k: Vec<f32>,
    pub z_k: Vec<f32>,
    pub s_k: Vec<f32>,
    /// `[G][R]`, token-major.
    pub v_units: Vec<f32>,
    pub a_v: Vec<f32>,
    pub z_v: Vec<f32>,
    pub s_v: Vec<f32>,
    /// 4-bit scalar sides in fragment order are not unpacked: attention reads their codes
    /// straight from the record, at this byte range of it, and `k_units` / `v_units` are unused.
    pub k_fragments: Option<std::ops::Range<usize>>,
    pub v_fragments: Option<std::ops::Range<usize>>,
    /// Trellis sides held as their codebook values in 16-bit fixed point, `[R][G]`
    /// channel-major: unit `u[c][t] = words[c * G + t] * step`, with `word_steps = Some([K step,
    /// V step])`; `k_units` / `v_units` are then unused. Attention sums them with integer dot
    /// products (`attention::word_dots`).
    pub k_words: Vec<i16>,
    pub v_words: Vec<i16>,
    pub word_steps: Option<[f32; 2]>,
}

impl DecodedHalf {
    /// No values yet: buffers a reader fills and reuses.
    pub fn empty() -> Self {
        Self {
            k_units: Vec::new(),
            a_k: Vec::new(),
            z_k: Vec::new(),
            s_k: Vec::new(),
            v_units: Vec::new(),
            a_v: Vec::new(),
            z_v: Vec::new(),
            s_v: Vec::new(),
            k_fragments: None,
            v_fragments: None,
            k_words: Vec::new(),
            v_words: Vec::new(),
            word_steps: None,
        }
    }
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
            k_coding: BodyCoding::Scalar,
            v_coding: BodyCoding::Scalar,
        })
    }

    /// The same geometry with K and V coded as given: scalar only (trellis bodies are the
    /// reference's 3/3, 3/2 and 2/2 on both sides, [`crate::codec::BodyCodec`]).
    pub fn with_coding(self, k_coding: BodyCoding, v_coding: BodyCoding) -> Result<Self> {
        if k_coding != BodyCoding::Scalar || v_coding != BodyCoding::Scalar {
            return Err(CodecError::InvalidSetting(format!(
                "trellis bodies are the SJ-KVaRN reference's: 3/3, 3/2 or 2/2 with the trellis on \
                 both sides (got {}/{} bits, {k_coding:?}/{v_coding:?})",
                self.k_bits, self.v_bits
            )));
        }
        Ok(Self {
            k_coding,
            v_coding,
            ..self
        })
    }

    /// Rotation (and balancing) width `R`.
    pub fn width(&self) -> usize {
        rotation_size(self.head_dim).expect("validated in new")
    }

    fn halves(&self) -> usize {
        self.head_dim / self.width()
    }

    pub(crate) fn k_code_bytes(&self) -> usize {
        bitpack::packed_len(self.width() * GROUP, self.k_bits)
    }

    pub(crate) fn v_code_bytes(&self) -> usize {
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

/// The fp16 step `a` and offset `z` of every row of a coded tile.
pub(crate) struct RowAffine {
    pub(crate) a: Vec<f16>,
    pub(crate) z: Vec<f16>,
}

fn affine_to_f16(a: f32, z: f32) -> Result<(f16, f16)> {
    let (a16, z16) = (f16::from_f32(a), f16::from_f32(z));
    if !a16.is_finite() || !z16.is_finite() {
        return Err(CodecError::ScaleOverflow {
            what: "body row scale",
            value: if a16.is_finite() { z } else { a },
        });
    }
    Ok((a16, z16))
}

/// Per-row asymmetric min/max rounding of `x` (rows x cols, already divided by the column
/// scales); integer codes row-major.
pub(crate) fn round_rows(x: &[f32], cols: usize, bits: u32, codes: &mut [u8]) -> Result<RowAffine> {
    let rows = x.len() / cols;
    let (mut a_out, mut z_out) = (vec![f16::ZERO; rows], vec![f16::ZERO; rows]);
    let top = ((1u32 << bits) - 1) as f32;
    for (i, row) in x.chunks_exact(cols).enumerate() {
        let (lo, hi) = row
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        let (a, z) = affine_to_f16((hi - lo) / top, lo)?;
        let (af, zf) = (a.to_f32(), z.to_f32());
        let inv_a = if af > 0.0 { 1.0 / af } else { 0.0 };
        for (c, &v) in codes[i * cols..(i + 1) * cols].iter_mut().zip(row) {
            *c = ((v - zf) * inv_a).round().clamp(0.0, top) as u8;
        }
        a_out[i] = a;
        z_out[i] = z;
    }
    Ok(RowAffine { a: a_out, z: z_out })
}

/// Codes one tile (`x` already divided by the column scales) into `packed`.
fn encode_tile(x: &[f32], cols: usize, bits: u32, packed: &mut [u8]) -> Result<RowAffine> {
    let mut codes = vec![0u8; x.len()];
    let affine = round_rows(x, cols, bits, &mut codes)?;
    bitpack::pack(&codes, bits, packed);
    Ok(affine)
}

/// The integer codes of a coded tile as f32, row-major.
fn decode_tile_units(packed: &[u8], rows: usize, cols: usize, bits: u32) -> Vec<f32> {
    let mut codes = vec![0u8; rows * cols];
    bitpack::unpack(packed, bits, &mut codes);
    codes.iter().map(|&c| c as f32).collect()
}

pub(crate) fn divide_columns(tile: &[f32], cols: usize, col_scale: &[f16]) -> Vec<f32> {
    let inv: Vec<f32> = col_scale.iter().map(|s| 1.0 / s.to_f32()).collect();
    tile.chunks_exact(cols)
        .flat_map(|row| row.iter().zip(&inv).map(|(v, i)| v * i))
        .collect()
}

/// Column scales of a balanced tile, rounded to fp16 (always positive and finite: the column
/// log scales are centred and clamped, so they lie within about e^±10.3).
pub(crate) fn column_scales(
    tile: &[f32],
    rows: usize,
    cols: usize,
    config: &BalanceConfig,
) -> Vec<f16> {
    let b = balance(tile, rows, cols, config);
    b.col_log
        .iter()
        .map(|&c| f16::from_f32(c.exp() as f32).max(f16::from_bits(1)))
        .collect()
}

pub(crate) fn write_f16s(out: &mut [u8], values: &[f16]) -> usize {
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
    /// Half `half` of a record: metadata, values and (with `keys`) the key units.
    fn decode_sub_record(&self, record: &[u8], half: usize, keys: bool) -> Result<DecodedHalf> {
        if record.len() != self.record_bytes() || half >= self.halves() {
            return Err(CodecError::LengthMismatch {
                what: "body record",
                expected: self.record_bytes(),
                got: record.len(),
            });
        }
        let r = self.width();
        let sub = self.sub_record_bytes();
        let rec = &record[half * sub..(half + 1) * sub];
        let (k_codes, rest) = rec.split_at(self.k_code_bytes());
        let (v_codes, meta) = rest.split_at(self.v_code_bytes());
        let m = &meta[(2 * r + GROUP) * 2..];
        let k_units = if keys {
            decode_tile_units(k_codes, r, GROUP, self.k_bits)
        } else {
            Vec::new()
        };
        Ok(DecodedHalf {
            k_units,
            a_k: read_f32s(meta, r),
            z_k: read_f32s(&meta[2 * r..], r),
            s_k: read_f32s(&meta[4 * r..], GROUP),
            v_units: decode_tile_units(v_codes, GROUP, r, self.v_bits),
            a_v: read_f32s(m, GROUP),
            z_v: read_f32s(&m[2 * GROUP..], GROUP),
            s_v: read_f32s(&m[4 * GROUP..], r),
            ..DecodedHalf::empty()
        })
    }

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
            let xk = divide_columns(&k_tile, GROUP, &s_k);
            let RowAffine { a: a_k, z: z_k } = encode_tile(&xk, GROUP, self.k_bits, k_codes)?;

            // V: rows = tokens, columns = channels; stored column scales are per channel.
            let s_v = column_scales(&v_tile, GROUP, r, config);
            let xv = divide_columns(&v_tile, r, &s_v);
            let RowAffine { a: a_v, z: z_v } = encode_tile(&xv, r, self.v_bits, v_codes)?;

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
        for half in 0..self.halves() {
            let h = self.decode_half(record, half)?;
            let c0 = half * r;
            for c in 0..r {
                for t in 0..GROUP {
                    k[t * d + c0 + c] = (h.k_units[c * GROUP + t] * h.a_k[c] + h.z_k[c]) * h.s_k[t];
                }
            }
            for t in 0..GROUP {
                for c in 0..r {
                    v[t * d + c0 + c] = (h.v_units[t * r + c] * h.a_v[t] + h.z_v[t]) * h.s_v[c];
                }
            }
        }
        Ok(())
    }

    /// Number of independently balanced halves (2 for a 512-wide head, else 1).
    pub fn half_count(&self) -> usize {
        self.halves()
    }

    /// The codes and scales of one half of a record, in the absorbed-scale form attention uses:
    /// `K[t, c] = (k_units[c*G + t] * a_k[c] + z_k[c]) * s_k[t]`,
    /// `V[t, c] = (v_units[t*R + c] * a_v[t] + z_v[t]) * s_v[c]` (rotated frame, `c < R`).
    pub fn decode_half(&self, record: &[u8], half: usize) -> Result<DecodedHalf> {
        self.decode_sub_record(record, half, true)
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

    #[test]
    fn trellis_sides_are_the_reference_bodies_only() {
        let spec = BodySpec::new(64, 3, 2).unwrap();
        let t = BodyCoding::Trellis(TrellisAxis::Token);
        for (k, v) in [(t, t), (t, BodyCoding::Scalar), (BodyCoding::Scalar, t)] {
            assert!(spec.with_coding(k, v).is_err());
        }
        assert!(spec
            .with_coding(BodyCoding::Scalar, BodyCoding::Scalar)
            .is_ok());
    }
}
