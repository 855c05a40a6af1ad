//! Sealing one (group, KV head) into a record, and reading it back.
//!
//! The seal input is `G` rotated fp16 rows of K and of V. Each side is balanced
//! ([`super::balance`]); K as a `[D][G]` tile (rows = channels), V as `[G][D]` (rows = tokens).
//! Each balanced row gets an asymmetric min/max affine (`step = max((hi - lo) / qmax, 1e-10)`),
//! and the stored per-row scale and zero are `fp16(row scale * step)` and `fp16(row scale * lo)`:
//! the row balancing scale is absorbed into them. Scalar codes round `(x - lo) / step` to
//! nearest, ties to even, against the unrounded f32 `lo` and `step`. Trellis sides code each
//! channel's run of `(x - lo) / step` and then refit the row affine ([`super::trellis`]). The
//! column scales are stored last (`Ktok`, `Vch`).

use super::balance::{max_f32, min_f32, Balanced};
use super::fp16::{f16_to_f32, f32_to_f16};
use super::layout::{pack, unpack, Body, RecordLayout};
use super::trellis::{codebook, codebook_f32, window, Viterbi};
use crate::error::{CodecError, Result};

/// Balancing iterations of the format.
pub const ITERS: u32 = 16;

fn put_half(rec: &mut [u8], off: usize, v: f32) {
    rec[off..off + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
}

#[inline]
fn get_half(rec: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([rec[off], rec[off + 1]]))
}

/// Seals groups of one layout; owns its scratch so sealing many groups allocates once.
#[derive(Debug, Clone)]
pub struct Sealer {
    layout: RecordLayout,
    iters: u32,
    tile: Vec<f32>,
    balanced: Balanced,
    lo: Vec<f32>,
    step: Vec<f32>,
    y: Vec<f32>,
    codes: Vec<u8>,
    viterbi: Viterbi,
    cb: [Vec<f32>; 2],
}

impl Sealer {
    pub fn new(layout: RecordLayout, iters: u32) -> Self {
        let cb = if layout.body == Body::Trellis {
            [
                codebook_f32(layout.bits_k, false),
                codebook_f32(layout.bits_v, true),
            ]
        } else {
            [Vec::new(), Vec::new()]
        };
        Self {
            layout,
            iters,
            tile: Vec::new(),
            balanced: Balanced::default(),
            lo: Vec::new(),
            step: Vec::new(),
            y: vec![0.0; layout.group],
            codes: vec![0; layout.group],
            viterbi: Viterbi::default(),
            cb,
        }
    }

    pub fn layout(&self) -> &RecordLayout {
        &self.layout
    }

    /// Seals `G` rows of K and V (fp16 bits, rotated; row `t` at `t * stride`) into `rec`.
    pub fn seal(&mut self, k: &[u16], v: &[u16], stride: usize, rec: &mut [u8]) -> Result<()> {
        let l = self.layout;
        let (d, g) = (l.head_dim, l.group);
        let need = (g - 1) * stride + d;
        if stride < d || k.len() < need || v.len() < need {
            return Err(CodecError::LengthMismatch {
                what: "seal input rows",
                expected: need,
                got: k.len().min(v.len()),
            });
        }
        if rec.len() != l.bytes {
            return Err(CodecError::LengthMismatch {
                what: "record",
                expected: l.bytes,
                got: rec.len(),
            });
        }
        rec.fill(0);
        self.tile.resize(d * g, 0.0);
        for t in 0..g {
            for c in 0..d {
                self.tile[c * g + t] = f16_to_f32(k[t * stride + c]);
            }
        }
        let tile = std::mem::take(&mut self.tile);
        self.balanced.run(&tile, d, g, self.iters);
        self.quantize_side(false, rec);
        let mut tile = tile;
        for t in 0..g {
            for c in 0..d {
                tile[t * d + c] = f16_to_f32(v[t * stride + c]);
            }
        }
        self.balanced.run(&tile, g, d, self.iters);
        self.tile = tile;
        self.quantize_side(true, rec);
        Ok(())
    }

    fn quantize_side(&mut self, is_v: bool, rec: &mut [u8]) {
        let l = self.layout;
        let (rows, cols) = l.tile_shape(is_v);
        let bits = l.bits(is_v);
        let qmax = (1u32 << bits) - 1;
        let trellis = l.body == Body::Trellis;
        let (scale_off, zero_off) = l.row_fields(is_v);
        let payload_off = if is_v { l.v_payload } else { l.k_payload };
        self.lo.resize(rows, 0.0);
        self.step.resize(rows, 0.0);
        for r in 0..rows {
            let row = &self.balanced.tile[r * cols..(r + 1) * cols];
            let (mut lo, mut hi) = (row[0], row[0]);
            for &x in &row[1..] {
                lo = min_f32(lo, x);
                hi = max_f32(hi, x);
            }
            let step = max_f32((hi - lo) / qmax as f32, 1e-10);
            let slot = if is_v { r } else { l.k_channel_slot(r) };
            let s_row = self.balanced.s_row[r];
            put_half(rec, scale_off + 2 * slot, s_row * step);
            put_half(rec, zero_off + 2 * slot, s_row * lo);
            self.lo[r] = lo;
            self.step[r] = step;
            if trellis {
                continue;
            }
            let payload = &mut rec[payload_off..];
            for (c, &x) in row.iter().enumerate() {
                let (t, ch) = if is_v { (r, c) } else { (c, r) };
                let q = ((x - lo) / step).round_ties_even().clamp(0.0, qmax as f32) as u32;
                pack(payload, l.code_bit(t, ch, is_v), bits, q);
            }
        }
        if trellis {
            self.code_trellis(is_v, rec);
            self.refit(is_v, rec);
        }
        for c in 0..cols {
            let off = if is_v {
                l.v_ch + 2 * l.v_channel_slot(c)
            } else {
                l.k_tok + 2 * c
            };
            put_half(rec, off, self.balanced.s_col[c]);
        }
    }

    /// One Viterbi run per channel over the tokens, targets normalised by each row's affine.
    fn code_trellis(&mut self, is_v: bool, rec: &mut [u8]) {
        let l = self.layout;
        let (g, d, bits) = (l.group, l.head_dim, l.bits(is_v));
        let cols = if is_v { d } else { g };
        let payload_off = if is_v { l.v_payload } else { l.k_payload };
        let cb = &self.cb[is_v as usize];
        for ch in 0..d {
            for t in 0..g {
                let (r, c) = if is_v { (t, ch) } else { (ch, t) };
                self.y[t] = (self.balanced.tile[r * cols + c] - self.lo[r]) / self.step[r];
            }
            self.viterbi.search(&self.y, bits, cb, &mut self.codes);
            let payload = &mut rec[payload_off..];
            for (t, &code) in self.codes.iter().enumerate() {
                pack(payload, (ch * g + t) * bits as usize, bits, code as u32);
            }
        }
    }

    /// Moment-matching refit of each row's affine to the decoded codebook values; degenerate
    /// rows keep the min/max affine.
    fn refit(&self, is_v: bool, rec: &mut [u8]) {
        let l = self.layout;
        let (rows, cols) = l.tile_shape(is_v);
        let bits = l.bits(is_v);
        let table = codebook(bits, is_v);
        let (scale_off, zero_off) = l.row_fields(is_v);
        let n = cols as f64;
        for r in 0..rows {
            let (mut sx, mut sy, mut sxx, mut syy) = (0f64, 0f64, 0f64, 0f64);
            for c in 0..cols {
                let (t, ch) = if is_v { (r, c) } else { (c, r) };
                let x = self.balanced.tile[r * cols + c] as f64;
                let payload = l.payload(rec, is_v);
                let yh = f16_to_f32(table[window(payload, bits, ch, t, l.group)]) as f64;
                sx += x;
                sy += yh;
                sxx += x * x;
                syy += yh * yh;
            }
            // `positive` is false for NaN too: such rows keep the min/max affine.
            let positive = |x: f64| x.partial_cmp(&0.0) == Some(std::cmp::Ordering::Greater);
            let vy = n * syy - sy * sy;
            if !positive(vy) {
                continue;
            }
            let vx = n * sxx - sx * sx;
            if !positive(vx) {
                continue;
            }
            let a = (vx / vy).sqrt();
            let b = (sx - a * sy) / n;
            if !positive(a) || b.is_nan() || a > 1e30 || b.abs() > 1e30 {
                continue;
            }
            let slot = if is_v { r } else { l.k_channel_slot(r) };
            let s_row = self.balanced.s_row[r];
            put_half(rec, scale_off + 2 * slot, s_row * a as f32);
            put_half(rec, zero_off + 2 * slot, s_row * b as f32);
        }
    }
}

/// Decodes codes and fields of a record: the exact values attention must reproduce.
#[derive(Debug, Clone)]
pub struct Decoder {
    layout: RecordLayout,
    cb: [Vec<f32>; 2],
}

impl Decoder {
    pub fn new(layout: RecordLayout) -> Self {
        let cb = if layout.body == Body::Trellis {
            [
                codebook_f32(layout.bits_k, false),
                codebook_f32(layout.bits_v, true),
            ]
        } else {
            [Vec::new(), Vec::new()]
        };
        Self { layout, cb }
    }

    pub fn layout(&self) -> &RecordLayout {
        &self.layout
    }

    /// The code value `q` of token `t`, channel `d` (integer code, or codebook value).
    #[inline]
    pub fn q(&self, rec: &[u8], t: usize, d: usize, is_v: bool) -> f32 {
        let l = &self.layout;
        let bits = l.bits(is_v);
        let payload = l.payload(rec, is_v);
        match l.body {
            Body::Trellis => self.cb[is_v as usize][window(payload, bits, d, t, l.group)],
            Body::Scalar => unpack(payload, l.code_bit(t, d, is_v), bits) as f32,
        }
    }

    /// Rotated key row `t`: `(q * Kscale[d] + Kzero[d]) * Ktok[t]`.
    pub fn k_row(&self, rec: &[u8], t: usize, out: &mut [f32]) {
        let l = &self.layout;
        let tok = get_half(rec, l.k_tok + 2 * t);
        for (d, o) in out.iter_mut().enumerate().take(l.head_dim) {
            let slot = l.k_channel_slot(d);
            let q = self.q(rec, t, d, false);
            *o = (q * get_half(rec, l.k_scale + 2 * slot) + get_half(rec, l.k_zero + 2 * slot))
                * tok;
        }
    }

    /// Rotated value row `t`: `(q * Vscale[t] + Vzero[t]) * Vch[d]`.
    pub fn v_row(&self, rec: &[u8], t: usize, out: &mut [f32]) {
        let l = &self.layout;
        let (sc, zp) = (
            get_half(rec, l.v_scale + 2 * t),
            get_half(rec, l.v_zero + 2 * t),
        );
        for (d, o) in out.iter_mut().enumerate().take(l.head_dim) {
            let q = self.q(rec, t, d, true);
            *o = (q * sc + zp) * get_half(rec, l.v_ch + 2 * l.v_channel_slot(d));
        }
    }

    /// Every row of a record: `k` and `v` are `[G][D]`, bit-identical to [`Self::k_row`] /
    /// [`Self::v_row`] row by row, but with the per-channel fields read once.
    pub fn decode(&self, rec: &[u8], k: &mut [f32], v: &mut [f32]) {
        let l = &self.layout;
        let (d, g) = (l.head_dim, l.group);
        let kscale: Vec<f32> = (0..d)
            .map(|c| get_half(rec, l.k_scale + 2 * l.k_channel_slot(c)))
            .collect();
        let kzero: Vec<f32> = (0..d)
            .map(|c| get_half(rec, l.k_zero + 2 * l.k_channel_slot(c)))
            .collect();
        let vch: Vec<f32> = (0..d)
            .map(|c| get_half(rec, l.v_ch + 2 * l.v_channel_slot(c)))
            .collect();
        for t in 0..g {
            let tok = get_half(rec, l.k_tok + 2 * t);
            let (sc, zp) = (
                get_half(rec, l.v_scale + 2 * t),
                get_half(rec, l.v_zero + 2 * t),
            );
            let krow = &mut k[t * d..(t + 1) * d];
            for (c, o) in krow.iter_mut().enumerate() {
                *o = (self.q(rec, t, c, false) * kscale[c] + kzero[c]) * tok;
            }
            let vrow = &mut v[t * d..(t + 1) * d];
            for (c, o) in vrow.iter_mut().enumerate() {
                *o = (self.q(rec, t, c, true) * sc + zp) * vch[c];
            }
        }
    }
}
