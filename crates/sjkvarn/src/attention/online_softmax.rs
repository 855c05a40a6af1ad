//! Online-softmax state of one (query row, query head), and the fixed-order arithmetic it
//! uses: an exponential and sums written as plain multiply-and-add steps, so the vectorised
//! and the scalar builds of every SIMD level give the same bits.

/// Lanes of the fixed-order reductions (one 16-lane vector).
const LANES: usize = 16;

/// Running maximum, weight sum and (rotated-frame) value sum of one query.
#[derive(Clone)]
pub(crate) struct Softmax {
    pub(crate) max: f32,
    pub(crate) sum: f32,
    /// Value sum in the rotated frame.
    pub(crate) acc: Vec<f32>,
}

impl Softmax {
    pub(crate) fn new(d: usize) -> Self {
        Self {
            max: f32::NEG_INFINITY,
            sum: 0.0,
            acc: vec![0.0; d],
        }
    }

    pub(crate) fn clear(&mut self) {
        self.max = f32::NEG_INFINITY;
        self.sum = 0.0;
        self.acc.fill(0.0);
    }

    /// Folds a block of logits in: writes the weight of each of the first `visible` logits
    /// after rescaling the running sums; returns `false` (and changes nothing) when
    /// `visible == 0`.
    #[inline(always)]
    pub(crate) fn fold(&mut self, logits: &[f32], visible: usize, weights: &mut [f32]) -> bool {
        if visible == 0 {
            return false;
        }
        let new_max = self.max.max(lane_max(&logits[..visible]));
        let rescale = exp_nonpositive(self.max - new_max);
        if rescale != 1.0 {
            self.sum *= rescale;
            self.acc.iter_mut().for_each(|v| *v *= rescale);
        }
        self.max = new_max;
        for (w, &x) in weights[..visible].iter_mut().zip(&logits[..visible]) {
            *w = exp_nonpositive(x - new_max);
        }
        self.sum += lane_sum(&weights[..visible]);
        true
    }
}

/// `merged = merged (+) part` for every pair: the log-sum-exp merge of two partial softmax
/// states (an empty part changes nothing; an empty `merged` takes the part as it is).
pub(crate) fn merge_states(merged: &mut [Softmax], part: &[Softmax]) {
    for (m, p) in merged.iter_mut().zip(part) {
        if p.max == f32::NEG_INFINITY {
            continue;
        }
        if m.max == f32::NEG_INFINITY {
            m.max = p.max;
            m.sum = p.sum;
            m.acc.copy_from_slice(&p.acc);
            continue;
        }
        let max = m.max.max(p.max);
        let (em, ep) = (exp_nonpositive(m.max - max), exp_nonpositive(p.max - max));
        m.sum = m.sum * em + p.sum * ep;
        for (a, &b) in m.acc.iter_mut().zip(&p.acc) {
            *a = *a * em + b * ep;
        }
        m.max = max;
    }
}

/// Constants of both exponentials: `log2 e`; `ln 2` split so that `n * LN2_HI` is exact
/// (355 / 512) plus the rest; `1.5 * 2^23`, whose addition rounds to an integer; the Cephes
/// `expf` polynomial's coefficients, highest degree first.
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const ROUNDER: f32 = 12_582_912.0;
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` for `x <= 0` (softmax weights and rescales), within about 2 ulp; arguments below -87
/// (including -inf) give `e^-87`, about 1.6e-38: negligible next to the block's weight of 1.
///
/// Cody-Waite reduction `x = n ln 2 + r` and a degree-6 polynomial for `e^r` (the Cephes
/// `expf` coefficients), then `2^n` built in the exponent bits. Only multiplies, adds and bit
/// operations, none fused, so it vectorises and gives the same bits in every build.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    let x = if x < -87.0 { -87.0 } else { x };
    let shifted = x * LOG2E + ROUNDER;
    let n = shifted - ROUNDER;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = EXP_POLY[1..].iter().fold(EXP_POLY[0], |p, &c| p * r + c);
    scale_by_power_of_two((p * (r * r) + r) + 1.0, shifted)
}

/// [`exp_nonpositive`] with fused multiply-adds (the same reduction and polynomial), for the
/// prefill products, whose f32 GEMMs already leave the decode path's bit-for-bit rules: about
/// half the operations where the CPU has FMA. `f32::mul_add` is exactly rounded on every
/// build (a library call where the instruction set has none), so every SIMD level still gives
/// the same bits.
#[inline(always)]
pub(crate) fn exp_nonpositive_fused(x: f32) -> f32 {
    let x = if x < -87.0 { -87.0 } else { x };
    let shifted = x.mul_add(LOG2E, ROUNDER);
    let n = shifted - ROUNDER;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let p = EXP_POLY[1..]
        .iter()
        .fold(EXP_POLY[0], |p, &c| p.mul_add(r, c));
    scale_by_power_of_two(p.mul_add(r * r, r) + 1.0, shifted)
}

/// `y 2^n`, `n` the integer that `shifted = x log2(e) + ROUNDER` holds in its low bits.
#[inline(always)]
fn scale_by_power_of_two(y: f32, shifted: f32) -> f32 {
    let n = shifted.to_bits() as i32 - ROUNDER.to_bits() as i32;
    y * f32::from_bits(((n + 127) as u32) << 23)
}

/// Writes `w[i] = exp(x[i] - max)` for the first `visible` entries and zeros after them, and
/// returns their sum (the order of [`lane_sum`]) in the same pass.
#[inline(always)]
pub(crate) fn exp_sum_fused(x: &[f32], max: f32, visible: usize, w: &mut [f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let (head, tail) = w.split_at_mut(visible);
    let mut wc = head.chunks_exact_mut(LANES);
    let mut xc = x[..visible].chunks_exact(LANES);
    for (wv, xv) in wc.by_ref().zip(xc.by_ref()) {
        for l in 0..LANES {
            let e = exp_nonpositive_fused(xv[l] - max);
            wv[l] = e;
            lanes[l] += e;
        }
    }
    let mut rest = 0.0f32;
    for (o, &v) in wc.into_remainder().iter_mut().zip(xc.remainder()) {
        *o = exp_nonpositive_fused(v - max);
        rest += *o;
    }
    tail.fill(0.0);
    pairwise(&mut lanes) + rest
}

/// Sum in a fixed order: 16 lane sums over ascending 16-value chunks, a pairwise reduction of
/// the lanes, then the remainder's ascending sum added last.
#[inline(always)]
pub(crate) fn lane_sum(xs: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let mut tail = 0.0f32;
    for &x in chunks.remainder() {
        tail += x;
    }
    for c in chunks {
        for l in 0..LANES {
            lanes[l] += c[l];
        }
    }
    pairwise(&mut lanes) + tail
}

/// Largest value (`-inf` for none); the order does not matter for finite values.
#[inline(always)]
pub(crate) fn lane_max(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let mut tail = f32::NEG_INFINITY;
    for &x in chunks.remainder() {
        tail = if x > tail { x } else { tail };
    }
    for c in chunks {
        for l in 0..LANES {
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    lanes.iter().fold(tail, |m, &x| if x > m { x } else { m })
}

/// Lanes `l` and `l + 8` added, then `l + 4`, `l + 2`, `l + 1`: lane 0 holds the total.
#[inline(always)]
pub(crate) fn pairwise(lanes: &mut [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
        width /= 2;
    }
    lanes[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both exponentials stay within a few ulp of the standard library's over the softmax range.
    #[test]
    fn exp_matches_the_standard_library() {
        for exp in [exp_nonpositive, exp_nonpositive_fused] {
            let mut worst = 0.0f64;
            for i in 0..=200_000 {
                let x = -87.0 * i as f32 / 200_000.0;
                let (got, want) = (exp(x) as f64, (x as f64).exp());
                worst = worst.max(((got - want) / want).abs());
            }
            assert!(
                worst < 3.0 * f32::EPSILON as f64,
                "worst relative error {worst:e}"
            );
            assert_eq!(exp(0.0), 1.0);
            assert!(exp(f32::NEG_INFINITY) < 2e-38);
            assert!(exp(f32::NAN).is_nan());
        }
    }

    /// The fused pass writes the exponentials the separate ones give (up to rounding) and
    /// their sum, zeros past `visible`.
    #[test]
    fn fused_exp_sum_matches_the_plain_one() {
        let xs: Vec<f32> = (0..135).map(|i| -(((i * 37) % 101) as f32) / 9.0).collect();
        for visible in [0usize, 1, 15, 16, 17, 128, 135] {
            let mut w = vec![f32::NAN; 135];
            let sum = exp_sum_fused(&xs, -0.5, visible, &mut w);
            let mut want = 0.0f64;
            for (i, (&wi, &x)) in w.iter().zip(&xs).enumerate() {
                if i < visible {
                    let e = ((x + 0.5) as f64).exp();
                    assert!((wi as f64 - e).abs() <= 3e-7 * e, "{visible} {i}");
                    want += e;
                } else {
                    assert_eq!(wi, 0.0, "{visible} {i}");
                }
            }
            assert!(
                (sum as f64 - want).abs() <= 1e-5 * want.max(1.0),
                "{visible}"
            );
        }
    }

    /// The fixed-order sum and max agree with plain ones (up to rounding for the sum).
    #[test]
    fn lane_reductions_match_plain_ones() {
        let xs: Vec<f32> = (0..135)
            .map(|i| ((i * 37) % 101) as f32 / 7.0 - 5.0)
            .collect();
        for n in [0usize, 1, 15, 16, 17, 128, 135] {
            let plain: f64 = xs[..n].iter().map(|&x| x as f64).sum();
            assert!((lane_sum(&xs[..n]) as f64 - plain).abs() < 1e-4, "{n}");
            let max = xs[..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(lane_max(&xs[..n]), max, "{n}");
        }
    }
}
