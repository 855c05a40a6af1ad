//! The SJ-KVaRN trellis code: 64 states, one run per channel along the 128 tokens of a group.
//!
//! A run of `b`-bit codes is a contiguous field of the channel's bit stream. The codebook index
//! (the *window*) of code `i` is the `6 + b` stream bits ending with it: the current code in the
//! top `b` bits over the six bits before it (older codes lower). Bits before the start of the
//! run read as zero, so the search starts in state 0 and needs no side information. A decoder
//! finds any value from the code and the six bits before it.
//!
//! The encoder is a Viterbi search for the least squared error against the trained fp16
//! codebook (separate tables for keys and values), with single-rounded f32 costs and ties going
//! to the smaller code. Afterwards each row's affine is refitted by matching the mean and spread
//! of the decoded values to those of the row.

use super::codebooks::{CB2_K, CB2_V, CB3_K, CB3_V};
use super::fp16::f16_to_f32;
use super::layout::unpack;

/// History bits of the window (the state).
pub const HISTORY_BITS: u32 = 6;
/// Trellis states.
pub const STATES: usize = 1 << HISTORY_BITS;
/// Length of one run (the tokens of a group).
pub const RUN: usize = 128;

/// The fp16 codebook of a side: `2^(6 + bits)` entries.
pub fn codebook(bits: u32, is_v: bool) -> &'static [u16] {
    match (bits, is_v) {
        (3, false) => &CB3_K,
        (3, true) => &CB3_V,
        (_, false) => &CB2_K,
        (_, true) => &CB2_V,
    }
}

/// The codebook of a side as f32 (exact widening).
pub fn codebook_f32(bits: u32, is_v: bool) -> Vec<f32> {
    codebook(bits, is_v)
        .iter()
        .map(|&h| f16_to_f32(h))
        .collect()
}

/// Largest magnitude of a codebook word ([`codebook_words`]): a word times any `i16` operand
/// stays at or below `2^28`, so eight such products fit an `i32`.
pub const WORD_LIMIT: i32 = 1 << 13;

/// The codebook of a side in 16-bit fixed point, for integer dot products: `(words, step)`
/// with `words[w] = round_ties_even(C[w] / step)`, `step` the smallest power of two that keeps
/// every `|words[w]| <= WORD_LIMIT`. fp16 entries of magnitude `>= 2^11 step` are exact; smaller
/// ones are off by at most `step / 2` (about `1e-4` of the largest entry).
pub fn codebook_words(bits: u32, is_v: bool) -> (Vec<i16>, f32) {
    let values = codebook_f32(bits, is_v);
    let largest = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut step = 1.0f32;
    while largest / step > WORD_LIMIT as f32 {
        step *= 2.0;
    }
    while largest / (step / 2.0) <= WORD_LIMIT as f32 {
        step /= 2.0;
    }
    let words = values
        .iter()
        .map(|&v| (v / step).round_ties_even() as i16)
        .collect();
    (words, step)
}

/// Window (codebook index) of code `i` of run `run` in a channel-major payload of runs of
/// `run_len` codes.
#[inline(always)]
pub fn window(payload: &[u8], bits: u32, run: usize, i: usize, run_len: usize) -> usize {
    let bit = (run * run_len + i) * bits as usize;
    let width = HISTORY_BITS + bits;
    let full_history = (width as usize - 1) / bits as usize;
    if i >= full_history {
        // The window is the contiguous field of `6 + bits` bits ending with this code.
        let start = bit - HISTORY_BITS as usize;
        let (byte, shift) = (start >> 3, start & 7);
        let lo = payload[byte] as u32;
        let hi = payload.get(byte + 1).copied().unwrap_or(0) as u32;
        return (((lo | hi << 8) >> shift) & ((1 << width) - 1)) as usize;
    }
    let mut w = unpack(payload, bit, bits) << HISTORY_BITS;
    for k in 1..=i {
        w |= unpack(payload, bit - k * bits as usize, bits) << (HISTORY_BITS - (k as u32) * bits);
    }
    w as usize
}

/// Scratch of the Viterbi search, reused across runs.
#[derive(Debug, Clone)]
pub struct Viterbi {
    metric: [f32; STATES],
    next: [f32; STATES],
    choice: Vec<u8>,
}

impl Default for Viterbi {
    fn default() -> Self {
        Self {
            metric: [0.0; STATES],
            next: [0.0; STATES],
            choice: vec![0; RUN * STATES],
        }
    }
}

impl Viterbi {
    /// Least-squares codes of `y` (targets in units of the row step) against codebook `cb`
    /// (`2^(6+bits)` f32 values), written to `codes`.
    pub fn search(&mut self, y: &[f32], bits: u32, cb: &[f32], codes: &mut [u8]) {
        let n = y.len();
        if self.choice.len() < n * STATES {
            self.choice.resize(n * STATES, 0);
        }
        self.metric = [0.0; STATES];
        for i in (0..n).rev() {
            let target = y[i];
            let mut best = [f32::INFINITY; STATES];
            let mut arg = [0u8; STATES];
            // Ascending codes with a strict `<`: ties keep the smaller code.
            for j in 0..1usize << bits {
                let base = STATES * j;
                for s in 0..STATES {
                    let w = base + s;
                    let d = target - cb[w];
                    let c = d * d + self.metric[w >> bits];
                    if c < best[s] {
                        best[s] = c;
                        arg[s] = j as u8;
                    }
                }
            }
            self.next = best;
            self.choice[i * STATES..(i + 1) * STATES].copy_from_slice(&arg);
            std::mem::swap(&mut self.metric, &mut self.next);
        }
        let mut s = 0usize;
        for (i, code) in codes.iter_mut().enumerate().take(n) {
            let j = self.choice[i * STATES + s] as usize;
            *code = j as u8;
            s = (s + STATES * j) >> bits;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::layout::pack;

    #[test]
    fn codebook_words_use_the_full_range_and_round_each_entry() {
        for bits in [2u32, 3] {
            for is_v in [false, true] {
                let (words, step) = codebook_words(bits, is_v);
                let values = codebook_f32(bits, is_v);
                let top = words.iter().map(|w| (*w as i32).abs()).max().unwrap();
                assert!(
                    top <= WORD_LIMIT && top > WORD_LIMIT / 2,
                    "{bits} {is_v}: {top}"
                );
                for (&w, &v) in words.iter().zip(&values) {
                    assert!((w as f32 * step - v).abs() <= step / 2.0, "{bits} {is_v}");
                }
            }
        }
    }

    #[test]
    fn window_reads_the_code_over_its_history() {
        for bits in [2u32, 3] {
            let codes: Vec<u32> = (0..RUN as u32 * 2)
                .map(|i| (i * 5 + 3) % (1 << bits))
                .collect();
            let mut payload = vec![0u8; codes.len() * bits as usize / 8];
            for (i, &c) in codes.iter().enumerate() {
                pack(&mut payload, i * bits as usize, bits, c);
            }
            for run in 0..2 {
                for i in 0..RUN {
                    let mut want = 0u32;
                    for k in 0..=(HISTORY_BITS / bits) as usize {
                        if k <= i {
                            let shift = HISTORY_BITS as i32 - (k as i32) * bits as i32;
                            let c = codes[run * RUN + i - k];
                            want |= if shift >= 0 { c << shift } else { c >> -shift };
                        }
                    }
                    want &= (1 << (HISTORY_BITS + bits)) - 1;
                    assert_eq!(window(&payload, bits, run, i, RUN), want as usize);
                }
            }
        }
    }

    #[test]
    fn viterbi_beats_independent_nearest_choice() {
        let cb = codebook_f32(3, false);
        let y: Vec<f32> = (0..RUN)
            .map(|i| 3.5 + 2.5 * ((i as f32) * 0.9).sin())
            .collect();
        let mut codes = vec![0u8; RUN];
        Viterbi::default().search(&y, 3, &cb, &mut codes);
        let mut payload = vec![0u8; RUN * 3 / 8];
        for (i, &c) in codes.iter().enumerate() {
            pack(&mut payload, i * 3, 3, c as u32);
        }
        let err: f32 = (0..RUN)
            .map(|i| (y[i] - cb[window(&payload, 3, 0, i, RUN)]).powi(2))
            .sum();
        // Plain 3-bit rounding of values in [1, 6] has an MSE of 1/12 per value.
        assert!(
            err / (RUN as f32) < 1.0 / 12.0,
            "trellis mse {}",
            err / RUN as f32
        );
    }
}
