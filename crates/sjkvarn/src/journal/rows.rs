//! Every row layout of the ring (and of a sink stored in the staging type): one staged head
//! vector, one K or V row of one KV head.
//!
//! Every staging type holds Hadamard-rotated rows, as the reference does: `tq6_0` (the
//! reference's 98-byte blocks, [`crate::codec::tq6`]; a 64-wide head uses the 50-byte
//! extension block), rotated fp16, and the `q8_0` extension ([`crate::codec::q8_0`]). Keys and
//! values may use different types ([`RingRows`]). [`Staging::code`] is the one numbering of
//! the kinds.

use super::state::{STAGING_F16, STAGING_Q8_0, STAGING_TQ6_0};
use crate::codec::{q8_0, tq6};
use crate::error::{CacheError, CacheResult};
use crate::{CodecError, Result};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// How staged (unsealed) ring rows are stored. Every staging type holds rotated rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staging {
    /// The reference's `tq6_0`: per-128 norm, 64 Lloyd-Max centroids, 6.125 bits/value
    /// (default; 64-wide heads use the 64-value extension block).
    Tq6,
    /// llama.cpp q8_0 on rotated values, 8.5 bits/value (sjkvarn extension).
    Q8_0,
    /// Rotated fp16 (the reference's opt-in exact staging).
    F16,
}

impl Staging {
    /// Every staging kind, in [`Staging::code`] order.
    pub const ALL: [Staging; 3] = [Staging::Tq6, Staging::F16, Staging::Q8_0];

    pub const fn name(self) -> &'static str {
        match self {
            Staging::Tq6 => "tq6_0",
            Staging::Q8_0 => "q8_0",
            Staging::F16 => "f16",
        }
    }

    /// The kind's one number, wherever a kind is stored: the `SJKVSEQ` header (the
    /// reference's `tq6_0` 0 and `f16` 1, the `q8_0` extension 2), the snapshot's
    /// configuration block and the CUDA kernels' `SJ_STAGING_*` (`kernel_abi` takes its
    /// constants from here; a host test checks `cuda/sj_layer.cuh` against them).
    pub const fn code(self) -> u8 {
        (match self {
            Staging::Tq6 => STAGING_TQ6_0,
            Staging::F16 => STAGING_F16,
            Staging::Q8_0 => STAGING_Q8_0,
        }) as u8
    }

    pub fn from_code(code: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.code() as u32 == code)
    }

    pub fn from_name(name: &str) -> CacheResult<Self> {
        match name {
            "fp16" => Ok(Staging::F16),
            _ => Self::ALL
                .into_iter()
                .find(|s| s.name() == name)
                .ok_or_else(|| {
                    CacheError::InvalidConfig(format!(
                        "staging must be 'tq6_0', 'q8_0', 'f16', 'K/V' (e.g. 'q8_0/tq6_0') or \
                         'auto', got '{name}'"
                    ))
                }),
        }
    }
}

impl std::str::FromStr for Staging {
    type Err = CacheError;

    fn from_str(name: &str) -> CacheResult<Self> {
        Self::from_name(name)
    }
}

impl std::fmt::Display for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

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
            Staging::Q8_0 => q8_0::row_bytes(self.head_dim),
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
                q8_0::encode_row(row, out).map_err(|d| CodecError::ScaleOverflow {
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
            Staging::Q8_0 => q8_0::decode_row(bytes, out),
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
