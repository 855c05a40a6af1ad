//! The sealed record: which bytes hold what.
//!
//! One record is one KV head over one group of `G` tokens:
//!
//! ```text
//! K payload  G*D*bits_k/8    V payload  G*D*bits_v/8
//! Kscale[D]  Kzero[D]  Ktok[G]          (fp16, per channel / per channel / per token)
//! Vch[D]     Vscale[G] Vzero[G]         (fp16, per channel / per token / per token)
//! K[t,d] = (qK[t,d] * Kscale[d] + Kzero[d]) * Ktok[t]
//! V[t,d] = (qV[t,d] * Vscale[t] + Vzero[t]) * Vch[d]
//! ```
//!
//! Code order inside a payload: 4-bit scalar sides in tensor-core fragment order (16x16 tiles in
//! the operand order of an int8 MMA, with the per-channel fields permuted to match, so a GPU
//! kernel loads them without shuffles); 2- and 3-bit scalar sides token-major; trellis sides
//! channel-major (each channel's 128-token run contiguous, which is what the trellis window
//! reads).

use crate::error::{CodecError, Result};

/// Tokens per sealed group.
pub const GROUP: usize = 128;

/// How the codes of a record are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Body {
    /// Each value rounded on its own (ties to even).
    Scalar = 0,
    /// Codes of a channel's 128-token run chosen together by a 64-state Viterbi search.
    Trellis = 1,
}

impl Body {
    /// The reference's `BODY_AUTO`: trellis for the low-bit pairs 3/3, 3/2 and 2/2, scalar
    /// otherwise (trellis wins most where scalar rounding is coarsest).
    pub fn auto(bits_k: u32, bits_v: u32) -> Body {
        let low = |b: u32| b == 2 || b == 3;
        if low(bits_k) && low(bits_v) && bits_v <= bits_k {
            Body::Trellis
        } else {
            Body::Scalar
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Body::Scalar => "scalar",
            Body::Trellis => "trellis",
        }
    }
}

/// Byte offsets of every field of a record, for one geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecordLayout {
    pub head_dim: usize,
    pub group: usize,
    pub bits_k: u32,
    pub bits_v: u32,
    pub body: Body,
    pub k_payload: usize,
    pub v_payload: usize,
    pub k_scale: usize,
    pub k_zero: usize,
    pub k_tok: usize,
    pub v_ch: usize,
    pub v_scale: usize,
    pub v_zero: usize,
    pub bytes: usize,
}

impl RecordLayout {
    /// Validates the geometry the way the reference does: `head_dim` a power of two of at
    /// least 32, `group` a multiple of 16, 2..=4 bits per side; trellis bodies need 3/3, 3/2 or
    /// 2/2 and `group` = 128. A 64-wide trellis head is accepted as an sjkvarn extension (the
    /// reference asks for a multiple of 128); see [`RecordLayout::is_reference`].
    pub fn new(
        head_dim: usize,
        group: usize,
        bits_k: u32,
        bits_v: u32,
        body: Body,
    ) -> Result<Self> {
        if head_dim < 32 || !head_dim.is_power_of_two() || head_dim > 1024 {
            return Err(CodecError::UnsupportedHeadDim(head_dim));
        }
        if group == 0 || !group.is_multiple_of(16) {
            return Err(CodecError::InvalidSetting(format!(
                "group must be a positive multiple of 16, got {group}"
            )));
        }
        for (what, bits) in [("key bits", bits_k), ("value bits", bits_v)] {
            if !(2..=4).contains(&bits) {
                return Err(CodecError::UnsupportedBits {
                    what,
                    bits,
                    allowed: "2, 3, 4",
                });
            }
        }
        if body == Body::Trellis
            && (bits_k == 4 || bits_v == 4 || bits_v > bits_k || group != GROUP || head_dim < 64)
        {
            return Err(CodecError::InvalidSetting(format!(
                "a trellis body needs 3/3, 3/2 or 2/2 bits, group 128 and head_dim >= 64 \
                 (got {bits_k}/{bits_v}, group {group}, head_dim {head_dim})"
            )));
        }
        let (d, g) = (head_dim, group);
        let k_payload = 0;
        let v_payload = k_payload + d * bits_k as usize / 8 * g;
        let k_scale = v_payload + d * bits_v as usize / 8 * g;
        let k_zero = k_scale + 2 * d;
        let k_tok = k_zero + 2 * d;
        let v_ch = k_tok + 2 * g;
        let v_scale = v_ch + 2 * d;
        let v_zero = v_scale + 2 * g;
        let bytes = v_zero + 2 * g;
        Ok(Self {
            head_dim,
            group,
            bits_k,
            bits_v,
            body,
            k_payload,
            v_payload,
            k_scale,
            k_zero,
            k_tok,
            v_ch,
            v_scale,
            v_zero,
            bytes,
        })
    }

    /// Whether the reference codec accepts this geometry (everything but 64-wide trellis).
    pub fn is_reference(&self) -> bool {
        self.body == Body::Scalar || self.head_dim.is_multiple_of(128)
    }

    /// Stored bits per cached value (K and V, scales included).
    pub fn bits_per_value(&self) -> f64 {
        8.0 * self.bytes as f64 / (2.0 * (self.head_dim * self.group) as f64)
    }

    pub fn bits(&self, is_v: bool) -> u32 {
        if is_v {
            self.bits_v
        } else {
            self.bits_k
        }
    }

    /// Whether a side is stored in tensor-core fragment order (4-bit scalar only).
    pub fn fragment_order(&self, is_v: bool) -> bool {
        self.body == Body::Scalar
            && self.bits(is_v) == 4
            && self.head_dim.is_multiple_of(16)
            && self.group.is_multiple_of(16)
    }

    /// Bit offset of the code of token `t`, channel `d` inside the K or V payload.
    pub fn code_bit(&self, t: usize, d: usize, is_v: bool) -> usize {
        let bits = self.bits(is_v) as usize;
        if self.body == Body::Trellis {
            return (d * self.group + t) * bits;
        }
        if !self.fragment_order(is_v) {
            return (t * self.head_dim + d) * bits;
        }
        // Fragment order: tile (t/16, d/16); inside a tile, 32 lanes of one 32-bit word each,
        // eight 4-bit codes per word. Keys are the A operand (token rows), values the B operand.
        let (tile_t, tt, tile_d, dd) = (t >> 4, t & 15, d >> 4, d & 15);
        let (lane, reg, half) = if is_v {
            (
                4 * (dd & 7) + ((tt >> 1) & 3),
                (dd >> 3) + 2 * (tt >> 3),
                tt & 1,
            )
        } else {
            (
                4 * (tt & 7) + ((dd >> 1) & 3),
                (tt >> 3) + 2 * (dd >> 3),
                dd & 1,
            )
        };
        let word = (tile_t * (self.head_dim / 16) + tile_d) * 32 + lane;
        word * 32 + (reg + 4 * half) * 4
    }

    /// Slot of channel `d` in `Kscale` / `Kzero` (permuted for fragment-ordered keys).
    pub fn k_channel_slot(&self, d: usize) -> usize {
        if !self.fragment_order(false) {
            return d;
        }
        let (tile, dd) = (d >> 4, d & 15);
        let (pair, e) = (dd >> 1, dd & 1);
        (pair & 3) * (self.head_dim / 4) + tile * 4 + (pair >> 2) * 2 + e
    }

    /// Slot of channel `d` in `Vch` (permuted for fragment-ordered values).
    pub fn v_channel_slot(&self, d: usize) -> usize {
        if !self.fragment_order(true) {
            return d;
        }
        let (tile, dd) = (d >> 4, d & 15);
        (dd & 7) * (self.head_dim / 8) + tile * 2 + (dd >> 3)
    }

    /// `(rows, cols)` of a side's tile: K is `[D][G]` (rows = channels), V `[G][D]` (rows =
    /// tokens); rows carry the affine, columns the balancing scale stored last.
    pub fn tile_shape(&self, is_v: bool) -> (usize, usize) {
        if is_v {
            (self.group, self.head_dim)
        } else {
            (self.head_dim, self.group)
        }
    }

    /// Offsets of a side's per-row `(scale, zero)` fields.
    pub fn row_fields(&self, is_v: bool) -> (usize, usize) {
        if is_v {
            (self.v_scale, self.v_zero)
        } else {
            (self.k_scale, self.k_zero)
        }
    }

    /// The K or V payload of a record.
    pub fn payload<'a>(&self, record: &'a [u8], is_v: bool) -> &'a [u8] {
        if is_v {
            &record[self.v_payload..self.k_scale]
        } else {
            &record[self.k_payload..self.v_payload]
        }
    }
}

/// ORs the low `bits` bits of `v` into the LSB-first bit stream at `bit` (`bits` <= 8).
#[inline]
pub(crate) fn pack(stream: &mut [u8], bit: usize, bits: u32, v: u32) {
    let (byte, shift) = (bit >> 3, bit & 7);
    let w = (v & ((1 << bits) - 1)) << shift;
    stream[byte] |= w as u8;
    if shift + bits as usize > 8 {
        stream[byte + 1] |= (w >> 8) as u8;
    }
}

/// Reads `bits` bits at `bit` of an LSB-first stream.
#[inline]
pub(crate) fn unpack(stream: &[u8], bit: usize, bits: u32) -> u32 {
    let (byte, shift) = (bit >> 3, bit & 7);
    let mut w = stream[byte] as u32;
    if shift + bits as usize > 8 {
        w |= (stream[byte + 1] as u32) << 8;
    }
    (w >> shift) & ((1 << bits) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_sizes_match_the_reference_table() {
        let cases = [
            (4, 4, Body::Scalar, 35_072),
            (3, 3, Body::Trellis, 26_880),
            (3, 2, Body::Trellis, 22_784),
            (2, 2, Body::Trellis, 18_688),
        ];
        for (k, v, body, bytes) in cases {
            assert_eq!(
                RecordLayout::new(256, 128, k, v, body).unwrap().bytes,
                bytes
            );
        }
        assert_eq!(Body::auto(3, 2), Body::Trellis);
        assert_eq!(Body::auto(2, 3), Body::Scalar);
        assert_eq!(Body::auto(4, 4), Body::Scalar);
        assert!(RecordLayout::new(256, 128, 4, 3, Body::Trellis).is_err());
        assert!(RecordLayout::new(96, 128, 4, 4, Body::Scalar).is_err());
    }

    #[test]
    fn every_code_has_its_own_bits() {
        for (k, v, body) in [
            (4, 4, Body::Scalar),
            (3, 2, Body::Scalar),
            (3, 2, Body::Trellis),
        ] {
            for d in [64usize, 128] {
                let l = RecordLayout::new(d, 128, k, v, body).unwrap();
                for is_v in [false, true] {
                    let bits = l.bits(is_v) as usize;
                    let mut seen = vec![false; 128 * d];
                    for t in 0..128 {
                        for c in 0..d {
                            let b = l.code_bit(t, c, is_v);
                            assert_eq!(b % bits, 0);
                            assert!(!std::mem::replace(&mut seen[b / bits], true));
                        }
                    }
                    let mut slots: Vec<usize> = (0..d)
                        .map(|c| {
                            if is_v {
                                l.v_channel_slot(c)
                            } else {
                                l.k_channel_slot(c)
                            }
                        })
                        .collect();
                    slots.sort_unstable();
                    assert_eq!(slots, (0..d).collect::<Vec<_>>());
                }
            }
        }
    }
}
