//! 64-state shift-register trellis coding of runs (trellis-coded quantization).
//!
//! A run of `n` values is coded as `n` codes of `b` bits (2, 3 or 4). The codebook index at step
//! `t` is the last `6 + b` bits of the code stream: `idx_t = sum_j u_{t-j} << (j*b)` masked to
//! `6 + b` bits, so the value at `t` depends only on the codes at `t` and the one to three before
//! it, and a GPU thread can decode any position directly ([`value_at`]). The state is the last
//! 6 bits. The trellis is **tail-biting**: the codes before step 0 are the run's last codes, so no
//! start state is stored (no side bits); the run occupies exactly `n*b` bits, like scalar codes.
//!
//! The encoder is a Viterbi search for the least squared-error path. Tail-biting uses the
//! wrap-around method: a free-start pass that tracks where each survivor started (if the best
//! path already ends in the state it started from it is the optimum), then a second lap started
//! from the first lap's end metrics, keeping the best survivor that ends where it started; a
//! pinned pass is the fallback. On N(0,1) runs of 128 this matched the exact tail-biting optimum
//! (64 pinned passes, [`Viterbi::encode_codes_exact`]) in the tests.

use crate::bitpack;
use crate::error::{CodecError, Result};

/// Bits of trellis state (64 states).
pub const STATE_BITS: u32 = 6;
/// Number of states.
pub const STATES: usize = 1 << STATE_BITS;

/// A trellis codebook: `2^(6+b)` reconstruction values, indexed by the last `6 + b` stream bits.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    bits: u32,
    values: Vec<f32>,
}

fn check_bits(bits: u32) -> Result<()> {
    if (2..=4).contains(&bits) {
        Ok(())
    } else {
        Err(CodecError::UnsupportedBits {
            what: "trellis",
            bits,
            allowed: "2, 3, 4",
        })
    }
}

impl Codebook {
    pub fn new(bits: u32, values: Vec<f32>) -> Result<Self> {
        check_bits(bits)?;
        let expected = 1usize << (STATE_BITS + bits);
        if values.len() != expected {
            return Err(CodecError::LengthMismatch {
                what: "trellis codebook",
                expected,
                got: values.len(),
            });
        }
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(CodecError::NonFinite { index });
        }
        Ok(Self { bits, values })
    }

    /// Parses the shipped little-endian f32 file format.
    pub fn from_le_bytes(bits: u32, bytes: &[u8]) -> Result<Self> {
        if bytes.len() % 4 != 0 {
            return Err(CodecError::NotBlockMultiple {
                what: "codebook bytes",
                len: bytes.len(),
                block: 4,
            });
        }
        Self::new(
            bits,
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }

    pub fn to_le_bytes(&self) -> Vec<u8> {
        self.values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    pub fn bits(&self) -> u32 {
        self.bits
    }

    pub fn values(&self) -> &[f32] {
        &self.values
    }

    fn index_mask(&self) -> usize {
        (1 << (STATE_BITS + self.bits)) - 1
    }

    /// Codes needed to cover an index: `ceil((6 + b) / b)`.
    fn window(&self) -> usize {
        (STATE_BITS + self.bits).div_ceil(self.bits) as usize
    }
}

static SHIPPED: [std::sync::OnceLock<Codebook>; 3] = [
    std::sync::OnceLock::new(),
    std::sync::OnceLock::new(),
    std::sync::OnceLock::new(),
];

/// The shipped codebook for 2, 3 or 4 bits (trained by `sjkvarn-train-trellis`).
pub fn shipped(bits: u32) -> Result<&'static Codebook> {
    check_bits(bits)?;
    let bytes: &[u8] = match bits {
        2 => include_bytes!("../data/trellis_2bit.bin"),
        3 => include_bytes!("../data/trellis_3bit.bin"),
        _ => include_bytes!("../data/trellis_4bit.bin"),
    };
    Ok(SHIPPED[(bits - 2) as usize]
        .get_or_init(|| Codebook::from_le_bytes(bits, bytes).expect("shipped codebooks are valid")))
}

/// Codebook index at step `t` of a tail-biting run of unpacked codes.
fn index_at(cb: &Codebook, codes: &[u8], t: usize) -> usize {
    let n = codes.len();
    let mut idx = 0usize;
    for j in 0..cb.window() {
        let u = codes[(t + n * 4 - j) % n] as usize;
        idx |= u << (j as u32 * cb.bits);
    }
    idx & cb.index_mask()
}

/// Decodes the value at step `t` straight from a packed run of `n` codes (random access).
pub fn value_at(cb: &Codebook, packed: &[u8], n: usize, t: usize) -> f32 {
    let mut idx = 0usize;
    for j in 0..cb.window() {
        let u = bitpack::code_at(packed, cb.bits, (t + n * 4 - j) % n) as usize;
        idx |= u << (j as u32 * cb.bits);
    }
    cb.values[idx & cb.index_mask()]
}

/// Decodes a run from unpacked codes, sequentially.
pub fn decode_codes(cb: &Codebook, codes: &[u8], out: &mut [f32]) {
    let n = codes.len();
    if n == 0 {
        return;
    }
    let mask = cb.index_mask();
    // Index ending at step n-1 gives the state before step 0 (tail-biting).
    let mut idx = index_at(cb, codes, n - 1);
    for (o, &u) in out.iter_mut().zip(codes) {
        idx = ((idx << cb.bits) | u as usize) & mask;
        *o = cb.values[idx];
    }
}

/// Decodes a packed run of `out.len()` codes.
pub fn decode_packed(cb: &Codebook, packed: &[u8], out: &mut [f32]) {
    let mut codes = vec![0u8; out.len()];
    bitpack::unpack(packed, cb.bits, &mut codes);
    decode_codes(cb, &codes, out);
}

fn argmin(m: &[f32; STATES]) -> usize {
    (0..STATES).fold(0, |best, s| if m[s] < m[best] { s } else { best })
}

/// Squared error of decoding `codes` against `x`.
pub fn squared_error(cb: &Codebook, x: &[f32], codes: &[u8]) -> f32 {
    let mut y = vec![0.0f32; codes.len()];
    decode_codes(cb, codes, &mut y);
    x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum()
}

/// One trellis step for `FAN = 2^b` predecessors per state: `best[s]` and the chosen top bits
/// `pick[s]` over predecessors `p = h * (64 / FAN) + pl` of `s = pl * FAN + u`, whose branch uses
/// codebook index `h * 64 + s`. Fixed-size, branch-free selects so the loops vectorise; ties go
/// to the smallest `h`.
fn relax<const FAN: usize>(
    metric: &[f32; STATES],
    origin: &[u32; STATES],
    dist: &[f32],
    best: &mut [f32; STATES],
    pick: &mut [u32; STATES],
    best_origin: &mut [u32; STATES],
) {
    let low = STATES / FAN;
    for h in 0..FAN {
        let (from, from_origin) = (
            &metric[h * low..(h + 1) * low],
            &origin[h * low..(h + 1) * low],
        );
        let (mut spread, mut spread_origin) = ([0.0f32; STATES], [0u32; STATES]);
        for s in 0..STATES {
            spread[s] = from[s / FAN];
            spread_origin[s] = from_origin[s / FAN];
        }
        let d: &[f32; STATES] = dist[h * STATES..(h + 1) * STATES]
            .try_into()
            .expect("64 entries");
        let hh = h as u32;
        for s in 0..STATES {
            // Bit masks instead of branches keep this loop vectorised.
            let cand = spread[s] + d[s];
            let old = best[s];
            let take = 0u32.wrapping_sub((cand < old) as u32);
            best[s] = if cand < old { cand } else { old };
            pick[s] = (pick[s] & !take) | (hh & take);
            best_origin[s] = (best_origin[s] & !take) | (spread_origin[s] & take);
        }
    }
}

/// Reusable Viterbi scratch space (no allocation per run once warmed up).
#[derive(Debug, Default, Clone)]
pub struct Viterbi {
    /// Predecessor choice `h` (top `b` bits of the previous state) per step and state.
    choice: Vec<u8>,
    dist: Vec<f32>,
}

/// How the first state of a pass is constrained.
#[derive(Clone)]
enum Start {
    Free,
    Fixed(usize),
    /// Wrap-around: start metrics carried over from a previous pass over the same run.
    Carried(Box<[f32; STATES]>),
}

struct Pass {
    metric: [f32; STATES],
    origin: [u8; STATES],
}

impl Viterbi {
    pub fn new() -> Self {
        Self::default()
    }

    fn pass(&mut self, cb: &Codebook, x: &[f32], start: Start) -> Pass {
        let b = cb.bits;
        let fan = 1usize << b; // predecessors per state
        let n = x.len();
        self.choice.resize(n * STATES, 0);
        self.dist.resize(cb.values.len(), 0.0);
        let mut metric = [f32::INFINITY; STATES];
        match start {
            Start::Free => metric = [0.0; STATES],
            Start::Fixed(s) => metric[s] = 0.0,
            Start::Carried(m) => {
                let floor = m.iter().fold(f32::INFINITY, |a, &b| a.min(b));
                for (dst, src) in metric.iter_mut().zip(m.iter()) {
                    *dst = src - floor;
                }
            }
        }
        let mut origin: [u32; STATES] = std::array::from_fn(|s| s as u32);
        for (t, &xt) in x.iter().enumerate() {
            for (d, &c) in self.dist.iter_mut().zip(&cb.values) {
                let e = xt - c;
                *d = e * e;
            }
            let mut best = [f32::INFINITY; STATES];
            let mut pick = [0u32; STATES];
            let mut best_origin = [0u32; STATES];
            let args = (
                &metric,
                &origin,
                &self.dist[..],
                &mut best,
                &mut pick,
                &mut best_origin,
            );
            match fan {
                4 => relax::<4>(args.0, args.1, args.2, args.3, args.4, args.5),
                8 => relax::<8>(args.0, args.1, args.2, args.3, args.4, args.5),
                _ => relax::<16>(args.0, args.1, args.2, args.3, args.4, args.5),
            }
            origin = best_origin;
            for (c, &p) in self.choice[t * STATES..(t + 1) * STATES]
                .iter_mut()
                .zip(&pick)
            {
                *c = p as u8;
            }
            metric = best;
        }
        Pass {
            metric,
            origin: origin.map(|o| o as u8),
        }
    }

    /// Follows the survivors back from `end`, writing the codes.
    fn traceback(&self, cb: &Codebook, n: usize, end: usize, codes: &mut [u8]) {
        let b = cb.bits;
        let low_bits = STATE_BITS - b;
        let mut s = end;
        for t in (0..n).rev() {
            codes[t] = (s & ((1 << b) - 1)) as u8;
            let h = self.choice[t * STATES + s] as usize;
            s = (h << low_bits) | (s >> b);
        }
    }

    /// Tail-biting Viterbi encode of `x` into unpacked `codes`; returns the squared error.
    pub fn encode_codes(&mut self, cb: &Codebook, x: &[f32], codes: &mut [u8]) -> f32 {
        let n = x.len();
        debug_assert_eq!(codes.len(), n);
        if n == 0 {
            return 0.0;
        }
        let free = self.pass(cb, x, Start::Free);
        let overall = argmin(&free.metric);
        if free.origin[overall] as usize == overall {
            // The unconstrained optimum is already tail-biting, hence the tail-biting optimum.
            self.traceback(cb, n, overall, codes);
            return free.metric[overall];
        }
        // Second lap with the first lap's end metrics as start metrics (wrap-around Viterbi);
        // keep the best survivor that ends where it started.
        let lap = self.pass(cb, x, Start::Carried(Box::new(free.metric)));
        let mut best: Option<usize> = None;
        for s in 0..STATES {
            if lap.origin[s] as usize == s && best.is_none_or(|b| lap.metric[s] < lap.metric[b]) {
                best = Some(s);
            }
        }
        let end = match best {
            Some(s) => s,
            None => {
                let s = argmin(&lap.metric);
                self.pass(cb, x, Start::Fixed(s));
                s
            }
        };
        self.traceback(cb, n, end, codes);
        squared_error(cb, x, codes)
    }

    /// Exact tail-biting Viterbi: one pinned pass per start state (64x the work). The reference
    /// the fast encoder is measured against.
    pub fn encode_codes_exact(&mut self, cb: &Codebook, x: &[f32], codes: &mut [u8]) -> f32 {
        let (mut best, mut best_err) = (0usize, f32::INFINITY);
        for s in 0..STATES {
            let err = self.pass(cb, x, Start::Fixed(s)).metric[s];
            if err < best_err {
                best = s;
                best_err = err;
            }
        }
        self.pass(cb, x, Start::Fixed(best));
        self.traceback(cb, x.len(), best, codes);
        best_err
    }

    /// Encodes `x` into a packed run of `x.len()` codes; returns the squared error.
    pub fn encode_packed(&mut self, cb: &Codebook, x: &[f32], packed: &mut [u8]) -> f32 {
        let mut codes = vec![0u8; x.len()];
        let err = self.encode_codes(cb, x, &mut codes);
        bitpack::pack(&codes, cb.bits, packed);
        err
    }
}

/// Bytes of one packed run of `len` codes; runs must be whole bytes and at least 8 long.
pub fn run_bytes(bits: u32, len: usize) -> Result<usize> {
    check_bits(bits)?;
    if len < 8 || (len * bits as usize) % 8 != 0 {
        return Err(CodecError::InvalidSetting(format!(
            "trellis runs need at least 8 values and a whole number of bytes; got {len} values at {bits} bits"
        )));
    }
    Ok(len * bits as usize / 8)
}

/// Encodes consecutive runs of `run_len` values with the shipped codebook, runs in parallel.
pub fn encode_runs(
    bits: u32,
    values: &[f32],
    run_len: usize,
    threads: Option<usize>,
) -> Result<Vec<u8>> {
    use rayon::prelude::*;
    let rb = run_bytes(bits, run_len)?;
    if values.len() % run_len != 0 {
        return Err(CodecError::NotBlockMultiple {
            what: "trellis runs",
            len: values.len(),
            block: run_len,
        });
    }
    crate::error::check_finite(values)?;
    let cb = shipped(bits)?;
    let mut out = vec![0u8; values.len() / run_len * rb];
    crate::format::with_threads(threads, || {
        out.par_chunks_mut(rb * 64)
            .zip(values.par_chunks(run_len * 64))
            .for_each(|(bytes, vals)| {
                let mut v = Viterbi::new();
                for (b, x) in bytes.chunks_exact_mut(rb).zip(vals.chunks_exact(run_len)) {
                    v.encode_packed(cb, x, b);
                }
            })
    })?;
    Ok(out)
}

/// Decodes runs of `run_len` values into `out` (whose length fixes the number of runs).
pub fn decode_runs(
    bits: u32,
    packed: &[u8],
    run_len: usize,
    out: &mut [f32],
    threads: Option<usize>,
) -> Result<()> {
    use rayon::prelude::*;
    let rb = run_bytes(bits, run_len)?;
    if out.len() % run_len != 0 {
        return Err(CodecError::NotBlockMultiple {
            what: "trellis output",
            len: out.len(),
            block: run_len,
        });
    }
    let expected = out.len() / run_len * rb;
    if packed.len() != expected {
        return Err(CodecError::LengthMismatch {
            what: "trellis bytes",
            expected,
            got: packed.len(),
        });
    }
    let cb = shipped(bits)?;
    crate::format::with_threads(threads, || {
        packed
            .par_chunks(rb * 64)
            .zip(out.par_chunks_mut(run_len * 64))
            .for_each(|(bytes, vals)| {
                let mut codes = vec![0u8; run_len];
                for (b, y) in bytes.chunks_exact(rb).zip(vals.chunks_exact_mut(run_len)) {
                    bitpack::unpack(b, bits, &mut codes);
                    decode_codes(cb, &codes, y);
                }
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn random_codebook(bits: u32, seed: u64) -> Codebook {
        let mut r = SplitMix64::new(seed);
        Codebook::new(bits, r.gaussians(1 << (6 + bits))).unwrap()
    }

    #[test]
    fn viterbi_path_decodes_to_its_reported_error_and_is_tail_biting() {
        for bits in [2, 3, 4] {
            let cb = random_codebook(bits, 11);
            let mut r = SplitMix64::new(5);
            let mut v = Viterbi::new();
            for _ in 0..20 {
                let x = r.gaussians(128);
                let mut codes = vec![0u8; 128];
                let err = v.encode_codes(&cb, &x, &mut codes);
                let mut y = vec![0.0; 128];
                decode_codes(&cb, &codes, &mut y);
                let direct: f32 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
                assert!(
                    (direct - err).abs() <= 1e-3 * direct.max(1.0),
                    "{bits}: {direct} vs {err}"
                );
                let mut packed = vec![0u8; bitpack::packed_len(128, bits)];
                bitpack::pack(&codes, bits, &mut packed);
                for (t, &expected) in y.iter().enumerate() {
                    assert_eq!(value_at(&cb, &packed, 128, t), expected);
                }
            }
        }
    }

    #[test]
    fn exact_encoder_matches_brute_force_on_tiny_runs() {
        let cb = random_codebook(2, 3);
        let mut r = SplitMix64::new(9);
        let mut v = Viterbi::new();
        // 4 steps x 2 bits = 256 tail-biting paths: enumerate all.
        for _ in 0..30 {
            let x = r.gaussians(4);
            let mut codes = vec![0u8; 4];
            let err = v.encode_codes_exact(&cb, &x, &mut codes);
            let fast = v.encode_codes(&cb, &x, &mut [0u8; 4]);
            assert!(fast >= err * (1.0 - 1e-5));
            let mut best = f32::INFINITY;
            for word in 0..256u32 {
                let c: Vec<u8> = (0..4).map(|i| ((word >> (2 * i)) & 3) as u8).collect();
                let mut y = vec![0.0; 4];
                decode_codes(&cb, &c, &mut y);
                best = best.min(x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum());
            }
            assert!(
                err <= best * (1.0 + 1e-5) + 1e-6,
                "viterbi {err} vs optimum {best}"
            );
        }
    }

    #[test]
    fn fast_tail_biting_is_close_to_exact_on_long_runs() {
        for bits in [2, 3] {
            let cb = random_codebook(bits, 21);
            let mut r = SplitMix64::new(2);
            let mut v = Viterbi::new();
            let (mut fast, mut exact) = (0.0f64, 0.0f64);
            let mut codes = vec![0u8; 128];
            for _ in 0..40 {
                let x = r.gaussians(128);
                fast += v.encode_codes(&cb, &x, &mut codes) as f64;
                exact += v.encode_codes_exact(&cb, &x, &mut codes) as f64;
            }
            println!("{bits}-bit: fast/exact = {:.5}", fast / exact);
            assert!(fast >= exact * (1.0 - 1e-6));
            assert!(
                fast <= exact * 1.002,
                "{bits}-bit: fast {fast} vs exact {exact}"
            );
        }
    }

    #[test]
    fn codebook_validation() {
        assert!(Codebook::new(5, vec![0.0; 2048]).is_err());
        assert!(Codebook::new(2, vec![0.0; 255]).is_err());
        let mut v = vec![0.0; 256];
        v[9] = f32::NAN;
        assert!(matches!(
            Codebook::new(2, v),
            Err(CodecError::NonFinite { index: 9 })
        ));
        let cb = random_codebook(3, 1);
        assert_eq!(Codebook::from_le_bytes(3, &cb.to_le_bytes()).unwrap(), cb);
    }
}
