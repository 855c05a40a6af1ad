//! Storage of one staged head vector (one K or V row of one KV head) in the ring.
//!
//! `tq6_0` and `q8_0` rows hold Hadamard-rotated values; fp16 rows hold the model's own values,
//! so an fp16-staged cache is exact for fp16 inputs (no rotation rounding), and attention reads
//! them in the model's frame.

use super::config::Staging;
use crate::ggml::{block_scales, GgmlFormat};
use crate::tq::TqBlock;
use crate::{CodecError, Result};
use half::f16;

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

    fn tq(&self) -> TqBlock {
        TqBlock {
            bits: 6,
            len: self.head_dim.min(128),
        }
    }

    /// Whether rows are stored in the rotated frame.
    pub fn rotated(&self) -> bool {
        self.staging != Staging::F16
    }

    pub fn row_bytes(&self) -> usize {
        match self.staging {
            Staging::Tq6 => self.head_dim / self.tq().len * self.tq().bytes(),
            Staging::Q8_0 => self.head_dim / 32 * GgmlFormat::Q8_0.block_bytes(),
            Staging::F16 => 2 * self.head_dim,
        }
    }

    /// Bits per stored value.
    pub fn bits_per_value(&self) -> f64 {
        self.row_bytes() as f64 * 8.0 / self.head_dim as f64
    }

    /// Encodes one row (rotated for tq6_0/q8_0, model frame for fp16; finite values).
    pub fn encode(&self, row: &[f32], out: &mut [u8]) -> Result<()> {
        match self.staging {
            Staging::Tq6 => {
                let b = self.tq();
                for (x, o) in row.chunks_exact(b.len).zip(out.chunks_exact_mut(b.bytes())) {
                    b.encode_rotated(x, o)?;
                }
            }
            Staging::Q8_0 => {
                let f = GgmlFormat::Q8_0;
                for (x, o) in row
                    .chunks_exact(32)
                    .zip(out.chunks_exact_mut(f.block_bytes()))
                {
                    let (d, _) = block_scales(f, x);
                    if !f16::from_f32(d).is_finite() {
                        return Err(CodecError::ScaleOverflow {
                            what: "q8_0 staging scale",
                            value: d,
                        });
                    }
                    f.encode_block(x, o);
                }
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

    /// Decodes one row into `out` (same frame it was stored in).
    pub fn decode(&self, bytes: &[u8], out: &mut [f32]) {
        match self.staging {
            Staging::Tq6 => {
                let b = self.tq();
                for (o, x) in out
                    .chunks_exact_mut(b.len)
                    .zip(bytes.chunks_exact(b.bytes()))
                {
                    b.decode_rotated(x, o);
                }
            }
            Staging::Q8_0 => {
                let f = GgmlFormat::Q8_0;
                for (o, x) in out
                    .chunks_exact_mut(32)
                    .zip(bytes.chunks_exact(f.block_bytes()))
                {
                    f.decode_block(x, o);
                }
            }
            Staging::F16 => {
                for (o, x) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([x[0], x[1]]).to_f32();
                }
            }
        }
    }
}
