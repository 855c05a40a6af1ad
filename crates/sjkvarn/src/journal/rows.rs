//! Storage of one staged head vector (one K or V row of one KV head) in the ring.
//!
//! Every staging type holds Hadamard-rotated rows, as the reference does: `tq6_0` (the
//! reference's 98-byte blocks; a 64-wide head uses the 50-byte extension block), rotated fp16,
//! and the `q8_0` extension. Keys and values may use different types ([`RingRows`]).

use super::config::Staging;
use crate::codec::comparators::ggml::GgmlFormat;
use crate::codec::tq6;
use crate::{CodecError, Result};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Encoder/decoder of ring rows for one staging format and head size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowCodec {
    pub staging: Staging,
    pub head_dim: usize,
}

impl RowCodec {
    pub fn new(staging: Staging, head_dim: usize) -> Self {
        Self { staging, head_dim }
    }

    pub fn row_bytes(&self) -> usize {
        match self.staging {
            Staging::Tq6 => tq6::row_bytes(self.head_dim),
            Staging::Q8_0 => self.head_dim / 32 * GgmlFormat::Q8_0.block_bytes(),
            Staging::F16 => 2 * self.head_dim,
        }
    }

    /// Bits per stored value.
    pub fn bits_per_value(&self) -> f64 {
        self.row_bytes() as f64 * 8.0 / self.head_dim as f64
    }

    /// Encodes one rotated row of finite values. A row whose stored scale would overflow fp16
    /// is refused instead of writing an infinite norm.
    pub fn encode(&self, row: &[f32], out: &mut [u8]) -> Result<()> {
        match self.staging {
            Staging::Tq6 => {
                tq6::encode_row(row, out);
                let block = tq6::row_bytes(self.head_dim).min(tq6::BLOCK_BYTES);
                for b in out.chunks_exact(block) {
                    if !f16::from_le_bytes([b[0], b[1]]).is_finite() {
                        let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
                        return Err(CodecError::ScaleOverflow {
                            what: "tq6_0 staging norm",
                            value: norm,
                        });
                    }
                }
            }
            Staging::Q8_0 => {
                GgmlFormat::encode_q8_0_row(row, out).map_err(|d| CodecError::ScaleOverflow {
                    what: "q8_0 staging scale",
                    value: d,
                })?;
            }
            Staging::F16 => {
                for (x, o) in row.iter().zip(out.chunks_exact_mut(2)) {
                    let h = f16::from_f32(*x);
                    if !h.is_finite() {
                        return Err(CodecError::ScaleOverflow {
                            what: "fp16 staging",
                            value: *x,
                        });
                    }
                    o.copy_from_slice(&h.to_le_bytes());
                }
            }
        }
        Ok(())
    }

    /// Decodes one row into `out` (rotated).
    #[inline(always)]
    pub fn decode(&self, bytes: &[u8], out: &mut [f32]) {
        match self.staging {
            Staging::Tq6 => tq6::decode_row(bytes, out),
            Staging::Q8_0 => GgmlFormat::decode_q8_0_row(bytes, out),
            Staging::F16 => {
                // 16 values at a time through the slice conversion (F16C where present).
                let mut halves = [f16::ZERO; 16];
                for (o, x) in out.chunks_mut(16).zip(bytes.chunks(32)) {
                    for (h, b) in halves.iter_mut().zip(x.chunks_exact(2)) {
                        *h = f16::from_le_bytes([b[0], b[1]]);
                    }
                    halves[..o.len()].convert_to_f32_slice(o);
                }
            }
        }
    }
}

/// The row codecs of one layer's ring: keys and values may be staged in different types. One
/// ring entry (a position of one KV head) is the K row followed by the V row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingRows {
    pub k: RowCodec,
    pub v: RowCodec,
}

impl RingRows {
    pub fn new(k: Staging, v: Staging, head_dim: usize) -> Self {
        Self {
            k: RowCodec::new(k, head_dim),
            v: RowCodec::new(v, head_dim),
        }
    }

    /// The codec of the K (`value = false`) or V side.
    #[inline(always)]
    pub fn side(&self, value: bool) -> RowCodec {
        if value {
            self.v
        } else {
            self.k
        }
    }

    /// Bytes of one entry (K row + V row).
    #[inline(always)]
    pub fn entry_bytes(&self) -> usize {
        self.k.row_bytes() + self.v.row_bytes()
    }

    /// Where the K or V row of entry `entry` lies in a buffer of entries.
    #[inline(always)]
    pub fn range(&self, entry: usize, value: bool) -> std::ops::Range<usize> {
        let start = entry * self.entry_bytes() + if value { self.k.row_bytes() } else { 0 };
        start..start + self.side(value).row_bytes()
    }

    /// Mean stored bits per value over both sides.
    pub fn bits_per_value(&self) -> f64 {
        (self.k.bits_per_value() + self.v.bits_per_value()) / 2.0
    }
}
