//! The reference codec's deterministic test inputs and hash, for conformance tests.
//!
//! `JakeATX/sj-kvarn-codec` pins its format with FNV-1a 64 hashes of records sealed from inputs
//! its `tests/vector_inputs.h` describes: xorshift64, sums of four uniforms, 3% outlier channels
//! and per-token factors, every value an integer times 2^-12 (exact in f32 on every platform).
//! This is our own implementation of that generator, shared by the crate's conformance tests and
//! the CUDA host tests.

use super::fp16::f32_to_f16;

/// The reference's FNV-1a 64 offset basis (it differs from the usual one in its last digit).
pub const FNV0: u64 = 1469598103934665603;

/// FNV-1a 64 of `bytes`, continuing from `h`.
pub fn fnv(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(1099511628211);
    }
    h
}

/// FNV-1a 64 of the little-endian bytes of `values`, continuing from `h`.
pub fn fnv_f32(values: &[f32], mut h: u64) -> u64 {
    for v in values {
        h = fnv(&v.to_le_bytes(), h);
    }
    h
}

/// xorshift64 with the reference's integer-exact value construction.
#[derive(Debug, Clone)]
pub struct Inputs(pub u64);

impl Inputs {
    pub fn next_u32(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as u32
    }

    /// Roughly Gaussian integer in [-2048, 2044]: four uniforms summed.
    pub fn gauss(&mut self) -> i32 {
        (0..4).map(|_| (self.next_u32() & 1023) as i32 - 512).sum()
    }

    pub fn value(&mut self, channel_factor: i32, token_factor: i32) -> f32 {
        (self.gauss() * channel_factor * token_factor) as f32 * (1.0 / 4096.0)
    }

    /// One (group, head) seal input of `g` fp16 rows of `d` values: `(K, V)`.
    pub fn group(d: usize, g: usize, seed: u32) -> (Vec<u16>, Vec<u16>) {
        let mut s = Inputs(0x9E3779B97F4A7C15 ^ seed as u64);
        let mut side = || {
            let factors: Vec<i32> = (0..d)
                .map(|_| {
                    if s.next_u32() % 100 < 3 {
                        24 + (s.next_u32() & 7) as i32
                    } else {
                        1 + (s.next_u32() & 3) as i32
                    }
                })
                .collect();
            let mut x = vec![0u16; g * d];
            for t in 0..g {
                let tf = 1 + (s.next_u32() & 3) as i32;
                for c in 0..d {
                    x[t * d + c] = f32_to_f16(s.value(factors[c], tf));
                }
            }
            x
        };
        let k = side();
        let v = side();
        (k, v)
    }

    /// `rows` rotated staging rows of `n` values; the last row is all zero (the zero-norm
    /// branch).
    pub fn rows(rows: usize, n: usize) -> Vec<f32> {
        let mut s = Inputs(0xD1B54A32D192ED03);
        let mut x = vec![0f32; rows * n];
        for r in 0..rows {
            let tf = 1 + (s.next_u32() & 7) as i32;
            for i in 0..n {
                x[r * n + i] = s.value(1, tf);
            }
        }
        x[(rows - 1) * n..].fill(0.0);
        x
    }

    /// `n` roughly Gaussian f32 of spread `scale`.
    pub fn gaussians(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| self.gauss() as f32 * (scale / 591.0))
            .collect()
    }
}
