//! Deterministic codebook training for the trellis coder (generalized Lloyd).
//!
//! Each iteration assigns every training run its tail-biting Viterbi path, then moves every
//! codebook entry to the mean of the samples that used it. Runs are processed in fixed chunks
//! whose sums are reduced in chunk order, so the result is bit-identical on any thread count.

use crate::rng::SplitMix64;
use crate::trellis::{decode_codes, Codebook, Viterbi, STATE_BITS};
use rayon::prelude::*;

/// Training settings; the defaults produce the shipped codebooks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainConfig {
    pub bits: u32,
    pub seed: u64,
    /// Training runs of `run_len` N(0,1) samples.
    pub runs: usize,
    pub run_len: usize,
    pub iterations: usize,
}

impl TrainConfig {
    pub fn shipped(bits: u32) -> Self {
        Self {
            bits,
            seed: 0x5EED_0000 + bits as u64,
            runs: 16_384,
            run_len: 128,
            iterations: 64,
        }
    }
}

const CHUNK: usize = 64;

/// Seeded N(0,1) training runs, `runs * run_len` values.
pub fn gaussian_runs(seed: u64, runs: usize, run_len: usize) -> Vec<f32> {
    SplitMix64::new(seed).gaussians(runs * run_len)
}

/// Mean squared error per value of coding `data` (runs of `run_len`) with `cb`.
pub fn mse(cb: &Codebook, data: &[f32], run_len: usize) -> f64 {
    let parts: Vec<f64> = data
        .par_chunks(run_len * CHUNK)
        .map(|chunk| {
            let mut v = Viterbi::new();
            let mut codes = vec![0u8; run_len];
            chunk
                .chunks_exact(run_len)
                .map(|x| v.encode_codes(cb, x, &mut codes) as f64)
                .sum()
        })
        .collect();
    parts.iter().sum::<f64>() / data.len() as f64
}

/// One Lloyd step: returns the updated codebook and the MSE of the assignment.
pub fn lloyd_step(cb: &Codebook, data: &[f32], run_len: usize) -> (Codebook, f64) {
    let entries = cb.values().len();
    let parts: Vec<(Vec<f64>, Vec<u64>, f64)> = data
        .par_chunks(run_len * CHUNK)
        .map(|chunk| {
            let mut v = Viterbi::new();
            let (mut sum, mut count) = (vec![0.0f64; entries], vec![0u64; entries]);
            let mut codes = vec![0u8; run_len];
            let mut err = 0.0f64;
            for x in chunk.chunks_exact(run_len) {
                err += v.encode_codes(cb, x, &mut codes) as f64;
                for (t, &xt) in x.iter().enumerate() {
                    let idx = index_of(cb, &codes, t);
                    sum[idx] += xt as f64;
                    count[idx] += 1;
                }
            }
            (sum, count, err)
        })
        .collect();
    let (mut sum, mut count, mut err) = (vec![0.0f64; entries], vec![0u64; entries], 0.0f64);
    for (s, c, e) in parts {
        for i in 0..entries {
            sum[i] += s[i];
            count[i] += c[i];
        }
        err += e;
    }
    let values = (0..entries)
        .map(|i| {
            if count[i] > 0 {
                (sum[i] / count[i] as f64) as f32
            } else {
                cb.values()[i]
            }
        })
        .collect();
    let next = Codebook::new(cb.bits(), values).expect("means of finite samples are finite");
    (next, err / data.len() as f64)
}

fn index_of(cb: &Codebook, codes: &[u8], t: usize) -> usize {
    let (b, n) = (cb.bits(), codes.len());
    let window = (STATE_BITS + b).div_ceil(b) as usize;
    let mut idx = 0usize;
    for j in 0..window {
        idx |= (codes[(t + 4 * n - j) % n] as usize) << (j as u32 * b);
    }
    idx & ((1 << (STATE_BITS + b)) - 1)
}

/// Trains a codebook; `progress(iteration, mse)` is called after every iteration.
pub fn train(config: &TrainConfig, mut progress: impl FnMut(usize, f64)) -> Codebook {
    let data = gaussian_runs(config.seed, config.runs, config.run_len);
    let mut init = SplitMix64::new(config.seed ^ 0xC0DE_B00C);
    let mut cb = Codebook::new(config.bits, init.gaussians(1 << (STATE_BITS + config.bits)))
        .expect("gaussian init is finite");
    for it in 0..config.iterations {
        let (next, err) = lloyd_step(&cb, &data, config.run_len);
        progress(it, err);
        cb = next;
    }
    cb
}

/// Decodes a run from codes (re-exported for tools that evaluate codebooks).
pub fn decode(cb: &Codebook, codes: &[u8], out: &mut [f32]) {
    decode_codes(cb, codes, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_is_deterministic_across_thread_counts_and_improves() {
        let cfg = TrainConfig {
            bits: 2,
            seed: 3,
            runs: 256,
            run_len: 128,
            iterations: 3,
        };
        let mut first = Vec::new();
        let one =
            crate::format::with_threads(Some(1), || train(&cfg, |_, e| first.push(e))).unwrap();
        let two = crate::format::with_threads(Some(2), || train(&cfg, |_, _| {})).unwrap();
        assert_eq!(one.to_le_bytes(), two.to_le_bytes());
        assert!(first.windows(2).all(|w| w[1] < w[0]), "{first:?}");
    }

    #[test]
    fn index_of_matches_the_decoder() {
        let mut r = SplitMix64::new(4);
        let cb = Codebook::new(3, r.gaussians(512)).unwrap();
        let codes: Vec<u8> = (0..128).map(|i| (i * 5 % 8) as u8).collect();
        let mut y = vec![0.0; 128];
        decode_codes(&cb, &codes, &mut y);
        for (t, &expected) in y.iter().enumerate() {
            assert_eq!(cb.values()[index_of(&cb, &codes, t)], expected);
        }
    }
}
