//! `staging = "auto"`: the staging type each side of a layer needs, measured on that layer's own
//! first rows (the first append, usually the prompt's first chunk).
//!
//! Keys: what matters is the error the attention logits see, and softmax ignores a shift shared
//! by every position. So errors and rows are centred over positions, per head, before they are
//! compared: a channel whose large offset every token shares costs nothing by itself, but a
//! per-token quantizer's error grows with the whole row, offset included, and swamps the small
//! part that tells positions apart (SmolLM2's keys). Score: `sqrt(sum |E - mean E|^2 /
//! sum |K - mean K|^2)`, the worst head's. Values: the attention output keeps offsets, so the
//! score is the plain relative error `sqrt(sum |E|^2 / sum |V|^2)`, the worst head's.
//!
//! Each side gets the smallest candidate (`tq6_0`, `q8_0`, `f16`) whose score is at most the
//! budget. Staging types are not part of sealed records, so any pick keeps the format.

use super::rows::RowCodec;
use super::rows::Staging;

/// Candidates, smallest first.
pub const CANDIDATES: [Staging; 3] = [Staging::Tq6, Staging::Q8_0, Staging::F16];

/// Default budget: on Gaussian rows `tq6_0` scores about 0.025 and `q8_0` about 0.005.
pub const DEFAULT_BUDGET: f32 = 0.04;

/// Fewest positions (after the first) a pick is measured on; a shorter first append stages
/// both sides as `q8_0` and says so.
pub const MIN_ROWS: usize = 16;

/// What `auto` measured on a layer and what it picked.
#[derive(Debug, Clone, PartialEq)]
pub struct StagingPick {
    pub k: Staging,
    pub v: Staging,
    /// Score of each candidate (in [`CANDIDATES`] order) on the keys and on the values; NaN
    /// when too few rows were measured, infinite when a candidate cannot hold the rows.
    pub k_scores: [f32; 3],
    pub v_scores: [f32; 3],
    /// Positions measured.
    pub rows: usize,
    pub budget: f32,
    /// Taken from a saved state (which keeps the pick, not its scores).
    pub restored: bool,
}

impl StagingPick {
    /// A pick read back from a saved state.
    pub fn restored(k: Staging, v: Staging) -> Self {
        Self {
            k,
            v,
            k_scores: [f32::NAN; 3],
            v_scores: [f32::NAN; 3],
            rows: 0,
            budget: f32::NAN,
            restored: true,
        }
    }

    /// One line: what was picked and why.
    pub fn explain(&self) -> String {
        if self.restored {
            return format!(
                "{}/{}: restored from a saved state (picked when the layer was first filled)",
                self.k.name(),
                self.v.name()
            );
        }
        if self.rows < MIN_ROWS {
            return format!(
                "{}/{}: only {} positions to measure (at least {MIN_ROWS} needed), so the safe \
                 choice",
                self.k.name(),
                self.v.name(),
                self.rows
            );
        }
        let scores = |s: &[f32; 3]| {
            CANDIDATES
                .iter()
                .zip(s)
                .map(|(c, x)| format!("{} {x:.4}", c.name()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "keys {} (centred logit error: {}), values {} (relative error: {}); budget {}, \
             {} positions",
            self.k.name(),
            scores(&self.k_scores),
            self.v.name(),
            scores(&self.v_scores),
            self.budget,
            self.rows
        )
    }
}

/// Picks the staging of both sides from rotated rows `k`, `v` (`[n][heads][d]`), skipping the
/// first position (a BOS row is an outlier nothing else looks like).
pub fn pick(k: &[f32], v: &[f32], heads: usize, d: usize, budget: f32) -> StagingPick {
    let n = k.len() / (heads * d);
    let rows = n.saturating_sub(1);
    if rows < MIN_ROWS {
        return StagingPick {
            k: Staging::Q8_0,
            v: Staging::Q8_0,
            k_scores: [f32::NAN; 3],
            v_scores: [f32::NAN; 3],
            rows,
            budget,
            restored: false,
        };
    }
    let (k, v) = (&k[heads * d..], &v[heads * d..]);
    let k_scores = CANDIDATES.map(|c| worst_head(k, heads, d, c, true));
    let v_scores = CANDIDATES.map(|c| worst_head(v, heads, d, c, false));
    let first_within = |scores: &[f32; 3]| {
        CANDIDATES
            .iter()
            .zip(scores)
            .find(|(_, &s)| s <= budget)
            .map_or(Staging::F16, |(&c, _)| c)
    };
    StagingPick {
        k: first_within(&k_scores),
        v: first_within(&v_scores),
        k_scores,
        v_scores,
        rows,
        budget,
        restored: false,
    }
}

/// The largest score over heads of `staging` on `rows` (`[n][heads][d]`).
fn worst_head(rows: &[f32], heads: usize, d: usize, staging: Staging, centre: bool) -> f32 {
    let codec = RowCodec::new(staging, d);
    let n = rows.len() / (heads * d);
    let mut bytes = vec![0u8; codec.row_bytes()];
    let mut back = vec![0.0f32; d];
    let mut worst = 0.0f32;
    for h in 0..heads {
        let row = |t: usize| &rows[(t * heads + h) * d..(t * heads + h + 1) * d];
        let mut err = vec![0.0f64; n * d];
        for t in 0..n {
            if codec.encode(row(t), &mut bytes).is_err() {
                return f32::INFINITY;
            }
            codec.decode(&bytes, &mut back);
            for ((e, &b), &x) in err[t * d..(t + 1) * d].iter_mut().zip(&back).zip(row(t)) {
                *e = b as f64 - x as f64;
            }
        }
        let (mut mean_x, mut mean_e) = (vec![0.0f64; d], vec![0.0f64; d]);
        if centre {
            for t in 0..n {
                for c in 0..d {
                    mean_x[c] += row(t)[c] as f64 / n as f64;
                    mean_e[c] += err[t * d + c] / n as f64;
                }
            }
        }
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for t in 0..n {
            for c in 0..d {
                num += (err[t * d + c] - mean_e[c]).powi(2);
                den += (row(t)[c] as f64 - mean_x[c]).powi(2);
            }
        }
        let score = if den > 0.0 {
            (num / den).sqrt() as f32
        } else if num > 0.0 {
            f32::INFINITY
        } else {
            0.0
        };
        worst = worst.max(score);
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::rotation::rotate_heads;
    use crate::rng::SplitMix64;

    /// `[n][heads][d]` rotated rows: Gaussian, plus (when `outliers`) a few channels with
    /// large offsets every position shares, as real models' keys have.
    fn rows(n: usize, heads: usize, d: usize, outliers: bool, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        let mut x = rng.gaussians(n * heads * d);
        if outliers {
            for t in 0..n {
                for h in 0..heads {
                    for (c, offset) in [(3usize, 40.0f32), (17, -25.0), (40, 30.0)] {
                        x[(t * heads + h) * d + c] += offset;
                    }
                }
            }
        }
        for r in x.chunks_exact_mut(d) {
            rotate_heads(r, d).unwrap();
        }
        x
    }

    #[test]
    fn gaussian_keys_stage_in_six_bits() {
        let (k, v) = (rows(257, 2, 128, false, 1), rows(257, 2, 128, false, 2));
        let p = pick(&k, &v, 2, 128, DEFAULT_BUDGET);
        assert_eq!((p.k, p.v), (Staging::Tq6, Staging::Tq6), "{}", p.explain());
        assert!(p.k_scores[0] < DEFAULT_BUDGET && p.k_scores[1] < p.k_scores[0]);
    }

    #[test]
    fn keys_with_outlier_channels_stage_in_eight_bits() {
        let (k, v) = (rows(257, 2, 128, true, 3), rows(257, 2, 128, false, 4));
        let p = pick(&k, &v, 2, 128, DEFAULT_BUDGET);
        assert_eq!((p.k, p.v), (Staging::Q8_0, Staging::Tq6), "{}", p.explain());
        assert!(p.k_scores[0] > DEFAULT_BUDGET, "{}", p.explain());
    }

    #[test]
    fn too_few_rows_take_the_safe_choice() {
        let (k, v) = (rows(8, 1, 64, false, 5), rows(8, 1, 64, false, 6));
        let p = pick(&k, &v, 1, 64, DEFAULT_BUDGET);
        assert_eq!((p.k, p.v, p.rows), (Staging::Q8_0, Staging::Q8_0, 7));
        assert!(p.explain().contains("only 7 positions"));
    }
}
