//! `tq6_0`, the staging format: 128 rotated values in 98 bytes (6.125 bits per value).
//!
//! Block layout: `norm: fp16` (bytes 0..2), `qs[64]` (bytes 2..66: code `i`'s low nibble at bit
//! `4*(i%2)` of `qs[i/2]`), `qh[32]` (bytes 66..98: code `i`'s top two bits at bit `2*(i%4)` of
//! `qh[i/4]`). Codes index the 64 Lloyd-Max centroids of N(0, 1/128) of the unit-norm block;
//! the stored norm is `||x|| / ||c[codes]||`, so a decoded block has the input's norm up to the
//! fp16 rounding of that norm. An all-zero block (norm <= 1e-10) codes every value as 32.

use super::codebooks::{TQ6_CENTROIDS, TQ6_MIDPOINTS};
use super::fp16::{f16_to_f32, f32_to_f16};

/// Values per block.
pub const BLOCK_VALUES: usize = 128;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 98;

/// Index of the centroid nearest to `v` (binary search over the midpoints; a value on a
/// midpoint goes up).
#[inline]
fn nearest(v: f32) -> usize {
    let (mut lo, mut hi) = (0usize, 63usize);
    while lo < hi {
        let m = (lo + hi) / 2;
        if v < TQ6_MIDPOINTS[m] {
            hi = m;
        } else {
            lo = m + 1;
        }
    }
    lo
}

/// Encodes one 128-value block.
pub fn encode_block(x: &[f32], out: &mut [u8]) {
    let mut norm_sq = 0f32;
    for &v in &x[..BLOCK_VALUES] {
        norm_sq += v * v;
    }
    let norm = norm_sq.sqrt();
    let inv = if norm > 1e-10 { 1.0 / norm } else { 0.0 };
    let mut idx = [0u8; BLOCK_VALUES];
    for (i, &v) in x[..BLOCK_VALUES].iter().enumerate() {
        let u = if norm > 1e-10 { v * inv } else { 0.0 };
        idx[i] = nearest(u) as u8;
    }
    let mut rn_sq = 0f32;
    for &i in &idx {
        let c = TQ6_CENTROIDS[i as usize];
        rn_sq += c * c;
    }
    let rn = rn_sq.sqrt();
    let stored = if rn > 1e-10 { norm / rn } else { norm };
    let out = &mut out[..BLOCK_BYTES];
    out.fill(0);
    out[..2].copy_from_slice(&f32_to_f16(stored).to_le_bytes());
    for (i, &code) in idx.iter().enumerate() {
        out[2 + i / 2] |= (code & 0xf) << ((i % 2) * 4);
        out[66 + i / 4] |= ((code >> 4) & 0x3) << ((i % 4) * 2);
    }
}

/// Decodes one block: `centroid[code] * norm`.
pub fn decode_block(block: &[u8], out: &mut [f32]) {
    let norm = f16_to_f32(u16::from_le_bytes([block[0], block[1]]));
    for (i, o) in out[..BLOCK_VALUES].iter_mut().enumerate() {
        let lo = (block[2 + i / 2] >> ((i % 2) * 4)) & 0xf;
        let hi = (block[66 + i / 4] >> ((i % 4) * 2)) & 0x3;
        *o = TQ6_CENTROIDS[(lo | hi << 4) as usize] * norm;
    }
}

/// Encodes a rotated row whose length is a multiple of 128.
pub fn encode_row(x: &[f32], out: &mut [u8]) {
    for (b, o) in x
        .chunks_exact(BLOCK_VALUES)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        encode_block(b, o);
    }
}

/// Decodes a row of whole blocks.
pub fn decode_row(bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_VALUES))
    {
        decode_block(b, o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_agrees_with_a_linear_scan() {
        for i in -4000..4000 {
            let v = i as f32 * 1e-4;
            let lin = TQ6_MIDPOINTS.iter().filter(|&&m| v >= m).count();
            assert_eq!(nearest(v), lin);
        }
    }

    #[test]
    fn zero_block_codes_the_middle_centroid() {
        let mut out = [0u8; BLOCK_BYTES];
        encode_block(&[0.0; 128], &mut out);
        assert_eq!(&out[..2], &[0, 0]);
        let mut y = [1.0f32; 128];
        decode_block(&out, &mut y);
        assert!(y.iter().all(|&v| v == 0.0));
        assert!(out[2..66].iter().all(|&b| b == 0));
        assert!(out[66..].iter().all(|&b| b == 0b1010_1010));
    }
}
