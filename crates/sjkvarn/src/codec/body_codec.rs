//! The one body-record codec a cache layer uses, chosen once from its configuration.
//!
//! The cache seals and reads records through [`BodyCodec`] without knowing how they are coded:
//! the reference SJ-KVaRN bodies ([`BodyCodec::Reference`]: scalar 2..4 bits per side, trellis
//! 3/3, 3/2, 2/2) or an sjkvarn extension ([`BodyCodec::Extension`]: 5/6/8-bit scalar sides,
//! the channel-axis trellis, non-default balancing as the paper-faithful KVarN comparator uses),
//! whose layouts are in `docs/formats.md` under "Extension". Attention reads every kind in the same absorbed-scale
//! form ([`DecodedHalf`]): `K = (u * a_K + z_K) * s_K`, `V = (u * a_V + z_V) * s_V`.

use super::fp16::f16_to_f32;
use super::layout::{Body, RecordLayout, GROUP};
use super::record::{Decoder, Sealer};
use super::units::UnitReader;
use crate::codec::extension::balance::{BalanceConfig, BalanceMode, BalanceStat};
use crate::codec::extension::body::{BodyCoding, BodySpec, DecodedHalf, TrellisAxis};
use crate::error::{CodecError, Result};

/// How one layer's records are coded.
#[derive(Debug, Clone)]
pub enum BodyCodec {
    /// The reference format (`codec::record`), balanced with `iters` passes.
    Reference { layout: RecordLayout, iters: u32 },
    /// An sjkvarn extension body.
    Extension {
        spec: BodySpec,
        balance: BalanceConfig,
    },
}

impl BodyCodec {
    /// The codec for one layer: the reference body whenever the reference defines the coding
    /// (same body on both sides, 2..4 bits, reference balancing), an extension otherwise.
    pub fn for_layer(
        head_dim: usize,
        k_bits: u32,
        v_bits: u32,
        k_coding: BodyCoding,
        v_coding: BodyCoding,
        balance: BalanceConfig,
    ) -> Result<Self> {
        if !matches!(head_dim, 64 | 128 | 256 | 512) {
            return Err(CodecError::UnsupportedHeadDim(head_dim));
        }
        let reference_balance =
            balance.mode == BalanceMode::Final && balance.stat == BalanceStat::Std;
        let body = match (k_coding, v_coding) {
            (BodyCoding::Scalar, BodyCoding::Scalar) => Some(Body::Scalar),
            (BodyCoding::Trellis(TrellisAxis::Token), BodyCoding::Trellis(TrellisAxis::Token)) => {
                Some(Body::Trellis)
            }
            _ => None,
        };
        if let (Some(body), true) = (body, reference_balance) {
            if let Ok(layout) = RecordLayout::new(head_dim, GROUP, k_bits, v_bits, body) {
                return Ok(BodyCodec::Reference {
                    layout,
                    iters: balance.passes,
                });
            }
            if body == Body::Trellis {
                // The only trellis the cache offers is the reference one: say why it refuses.
                RecordLayout::new(head_dim, GROUP, k_bits, v_bits, body)?;
            }
        }
        let spec = BodySpec::new(head_dim, k_bits, v_bits)?.with_coding(k_coding, v_coding)?;
        balance.validate()?;
        Ok(BodyCodec::Extension { spec, balance })
    }

    /// Whether this layer writes reference SJ-KVaRN records.
    pub fn is_reference(&self) -> bool {
        matches!(self, BodyCodec::Reference { layout, .. } if layout.is_reference())
    }

    pub fn record_bytes(&self) -> usize {
        match self {
            BodyCodec::Reference { layout, .. } => layout.bytes,
            BodyCodec::Extension { spec, .. } => spec.record_bytes(),
        }
    }

    /// Stored bits per cached value (K and V, scales included).
    pub fn bits_per_value(&self) -> f64 {
        match self {
            BodyCodec::Reference { layout, .. } => layout.bits_per_value(),
            BodyCodec::Extension { spec, .. } => spec.bits_per_value(),
        }
    }

    /// A sealer for this codec (scratch reused over many records).
    pub fn sealer(&self) -> RecordSealer {
        match self {
            BodyCodec::Reference { layout, iters } => {
                RecordSealer::Reference(Box::new(Sealer::new(*layout, *iters)))
            }
            BodyCodec::Extension { .. } => RecordSealer::Extension(self.clone()),
        }
    }

    /// A reader of this codec's records into reused buffers (what attention uses).
    pub fn half_reader(&self) -> HalfReader {
        match self {
            BodyCodec::Reference { layout, .. } => {
                HalfReader::Reference(Box::new(UnitReader::new(*layout)))
            }
            BodyCodec::Extension { spec, .. } => HalfReader::Extension(*spec),
        }
    }

    /// The absorbed-scale halves of a record (one half per sub-record).
    pub fn halves(&self, rec: &[u8]) -> Result<Vec<DecodedHalf>> {
        match self {
            BodyCodec::Reference { layout, .. } => Ok(vec![reference_half(layout, rec)?]),
            BodyCodec::Extension { spec, .. } => (0..spec.half_count())
                .map(|h| spec.decode_half(rec, h))
                .collect(),
        }
    }

    /// A record decoded in the Hadamard frame: `(keys, values)`, each `[G][head_dim]` (the exact
    /// values attention reads; checks and tools).
    pub fn decode_rotated(&self, rec: &[u8]) -> Result<(Vec<f32>, Vec<f32>)> {
        let d = self.head_dim();
        let (mut k, mut v) = (vec![0f32; GROUP * d], vec![0f32; GROUP * d]);
        match self {
            BodyCodec::Reference { layout, .. } => {
                if rec.len() != layout.bytes {
                    return Err(CodecError::LengthMismatch {
                        what: "body record",
                        expected: layout.bytes,
                        got: rec.len(),
                    });
                }
                Decoder::new(*layout).decode(rec, &mut k, &mut v);
            }
            BodyCodec::Extension { spec, .. } => spec.decode_rotated(rec, &mut k, &mut v)?,
        }
        Ok((k, v))
    }

    /// A record decoded to the model frame (rotated back, head by head).
    pub fn decode_model_frame(&self, rec: &[u8]) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut k, mut v) = self.decode_rotated(rec)?;
        let d = self.head_dim();
        super::rotation::rotate_heads(&mut k, d)?;
        super::rotation::rotate_heads(&mut v, d)?;
        Ok((k, v))
    }

    pub fn head_dim(&self) -> usize {
        match self {
            BodyCodec::Reference { layout, .. } => layout.head_dim,
            BodyCodec::Extension { spec, .. } => spec.head_dim,
        }
    }

    /// Width of one half (the head for reference records).
    pub fn half_width(&self) -> usize {
        match self {
            BodyCodec::Reference { layout, .. } => layout.head_dim,
            BodyCodec::Extension { spec, .. } => spec.width(),
        }
    }
}

/// Reads records of one [`BodyCodec`] into the absorbed-scale form, reusing its buffers.
#[derive(Debug, Clone)]
pub enum HalfReader {
    Reference(Box<UnitReader>),
    Extension(BodySpec),
}

impl HalfReader {
    /// Whether this reader reads `codec`'s records (so a reader kept from an earlier call
    /// can serve this one).
    pub fn serves(&self, codec: &BodyCodec) -> bool {
        match (self, codec) {
            (HalfReader::Reference(reader), BodyCodec::Reference { layout, .. }) => {
                reader.layout() == layout
            }
            (HalfReader::Extension(spec), BodyCodec::Extension { spec: other, .. }) => {
                spec == other
            }
            _ => false,
        }
    }

    /// The halves of `rec` into `out` (resized to the half count; buffers reused).
    #[inline(always)]
    pub fn read(&mut self, rec: &[u8], out: &mut Vec<DecodedHalf>) -> Result<()> {
        match self {
            HalfReader::Reference(reader) => {
                out.resize_with(1, DecodedHalf::empty);
                reader.read(rec, &mut out[0])
            }
            HalfReader::Extension(spec) => {
                out.clear();
                for h in 0..spec.half_count() {
                    out.push(spec.decode_half(rec, h)?);
                }
                Ok(())
            }
        }
    }
}

/// Seals records of one [`BodyCodec`].
#[derive(Debug, Clone)]
pub enum RecordSealer {
    Reference(Box<Sealer>),
    Extension(BodyCodec),
}

impl RecordSealer {
    /// Seals one (group, KV head) from its `[G][D]` rotated fp16 rows of K and V.
    pub fn seal(&mut self, k: &[u16], v: &[u16], out: &mut [u8]) -> Result<()> {
        match self {
            RecordSealer::Reference(s) => {
                let d = s.layout().head_dim;
                s.seal(k, v, d, out)
            }
            RecordSealer::Extension(BodyCodec::Extension { spec, balance }) => {
                let kt: Vec<f32> = k.iter().map(|&h| f16_to_f32(h)).collect();
                let vt: Vec<f32> = v.iter().map(|&h| f16_to_f32(h)).collect();
                spec.encode_rotated(&kt, &vt, balance, out)
            }
            RecordSealer::Extension(BodyCodec::Reference { .. }) => Err(
                CodecError::InvalidSetting("extension sealer built from a reference codec".into()),
            ),
        }
    }
}

/// A reference record in the absorbed-scale form attention reads.
pub(crate) fn reference_half(l: &RecordLayout, rec: &[u8]) -> Result<DecodedHalf> {
    if rec.len() != l.bytes {
        return Err(CodecError::LengthMismatch {
            what: "body record",
            expected: l.bytes,
            got: rec.len(),
        });
    }
    let dec = Decoder::new(*l);
    let (d, g) = (l.head_dim, l.group);
    let half = |off: usize| f16_to_f32(u16::from_le_bytes([rec[off], rec[off + 1]]));
    let mut k_units = vec![0f32; d * g];
    let mut v_units = vec![0f32; g * d];
    for c in 0..d {
        for t in 0..g {
            k_units[c * g + t] = dec.q(rec, t, c, false);
            v_units[t * d + c] = dec.q(rec, t, c, true);
        }
    }
    Ok(DecodedHalf {
        k_units,
        a_k: (0..d)
            .map(|c| half(l.k_scale + 2 * l.k_channel_slot(c)))
            .collect(),
        z_k: (0..d)
            .map(|c| half(l.k_zero + 2 * l.k_channel_slot(c)))
            .collect(),
        s_k: (0..g).map(|t| half(l.k_tok + 2 * t)).collect(),
        v_units,
        a_v: (0..g).map(|t| half(l.v_scale + 2 * t)).collect(),
        z_v: (0..g).map(|t| half(l.v_zero + 2 * t)).collect(),
        s_v: (0..d)
            .map(|c| half(l.v_ch + 2 * l.v_channel_slot(c)))
            .collect(),
        ..DecodedHalf::empty()
    })
}
