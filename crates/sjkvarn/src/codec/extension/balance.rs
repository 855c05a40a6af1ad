//! Sinkhorn variance balancing of one tile, in the log domain.
//!
//! Each pass divides every column by its spread, then every row by its spread, so that after a
//! few passes no row or column dominates and per-row rounding wastes no levels on a loud token or
//! channel. Two details make it robust on real caches:
//!
//! * The tile is first divided by its overall spread, so the clamps below are *relative* and the
//!   result does not depend on the tile's absolute magnitude (1e-3 and 1e4 tiles balance alike).
//! * Only the product of a row and a column scale matters, so the split between them drifts over
//!   the passes (row and column scales near 1e4 and 1e-4 were seen on real SmolLM2 keys, which
//!   overflow fp16 once absorbed). After every pass the mean log column scale is moved into the
//!   rows, so the stored column scales stay centred on 1.
//!
//! Everything is reduced sequentially in f64 in a fixed order: the same tile gives the same bits on
//! any thread count and across runs.

use crate::error::{CodecError, Result};

/// Which pass's scales are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BalanceMode {
    /// The scales after the last pass (SJ-KVaRN default, 16 passes).
    Final,
    /// The scales of the least-imbalanced pass, ties to the later one (KVarN reference, 8 passes).
    Best,
}

/// The spread statistic that is equalised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BalanceStat {
    /// Sample standard deviation (n - 1), as in KVarN.
    Std,
    /// Root mean square: keeps each row's and column's offset in the balanced quantity.
    Rms,
}

/// The member of `all` whose name is `name`, or an error naming the choices.
fn by_name<T: Copy>(
    all: &[T],
    name_of: fn(T) -> &'static str,
    name: &str,
    what: &'static str,
    allowed: &'static str,
) -> std::result::Result<T, crate::CodecError> {
    all.iter()
        .copied()
        .find(|&x| name_of(x) == name)
        .ok_or_else(|| crate::CodecError::UnknownName {
            what,
            allowed,
            got: name.into(),
        })
}

impl BalanceMode {
    pub const fn name(self) -> &'static str {
        match self {
            BalanceMode::Final => "final",
            BalanceMode::Best => "best",
        }
    }
}

impl std::str::FromStr for BalanceMode {
    type Err = crate::CodecError;

    fn from_str(name: &str) -> std::result::Result<Self, Self::Err> {
        let all = [BalanceMode::Final, BalanceMode::Best];
        by_name(&all, Self::name, name, "mode", "'final' or 'best'")
    }
}

impl BalanceStat {
    pub const fn name(self) -> &'static str {
        match self {
            BalanceStat::Std => "std",
            BalanceStat::Rms => "rms",
        }
    }
}

impl std::str::FromStr for BalanceStat {
    type Err = crate::CodecError;

    fn from_str(name: &str) -> std::result::Result<Self, Self::Err> {
        let all = [BalanceStat::Std, BalanceStat::Rms];
        by_name(&all, Self::name, name, "stat", "'std' or 'rms'")
    }
}

/// Balancing settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BalanceConfig {
    pub passes: u32,
    pub mode: BalanceMode,
    pub stat: BalanceStat,
}

impl Default for BalanceConfig {
    fn default() -> Self {
        Self {
            passes: 16,
            mode: BalanceMode::Final,
            stat: BalanceStat::Std,
        }
    }
}

impl BalanceConfig {
    /// The KVarN reference setting: 8 passes, best seen.
    pub fn kvarn_reference() -> Self {
        Self {
            passes: 8,
            mode: BalanceMode::Best,
            stat: BalanceStat::Std,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.passes > 1024 {
            return Err(CodecError::InvalidSetting(format!(
                "balance passes {} is out of range 0..=1024",
                self.passes
            )));
        }
        Ok(())
    }
}

/// Clamp on a single pass's spread, as in KVarN.
const SPREAD_CLAMP: (f64, f64) = (1e-3, 1e3);
/// Clamp on each accumulated log scale, as in KVarN.
const LOG_SCALE_CLAMP: (f64, f64) = (-0.3, 10.0);

/// Result of balancing a `rows x cols` tile: `tile[i][j] = balanced[i][j] * exp(row_log[i] + col_log[j])`.
#[derive(Debug, Clone, PartialEq)]
pub struct Balance {
    pub row_log: Vec<f64>,
    pub col_log: Vec<f64>,
    /// max/min of column spreads + max/min of row spreads of the kept balanced tile.
    pub imbalance: f64,
}

fn spread(sum: f64, sum_sq: f64, n: usize, stat: BalanceStat) -> f64 {
    match stat {
        BalanceStat::Rms => (sum_sq / n as f64).sqrt(),
        BalanceStat::Std => {
            if n < 2 {
                return 0.0;
            }
            let mean = sum / n as f64;
            ((sum_sq - mean * sum) / (n as f64 - 1.0)).max(0.0).sqrt()
        }
    }
}

/// Spread of every column of `tile * exp(-row_log[i] - col_log[j])`.
fn column_spreads(
    tile: &[f32],
    rows: usize,
    cols: usize,
    row_log: &[f64],
    col_log: &[f64],
    stat: BalanceStat,
    out: &mut [f64],
) {
    let mut sum = vec![0.0f64; cols];
    let mut sum_sq = vec![0.0f64; cols];
    for i in 0..rows {
        let r = (-row_log[i]).exp();
        let row = &tile[i * cols..(i + 1) * cols];
        for j in 0..cols {
            let v = row[j] as f64 * r;
            sum[j] += v;
            sum_sq[j] += v * v;
        }
    }
    for j in 0..cols {
        out[j] = spread(sum[j], sum_sq[j], rows, stat) * (-col_log[j]).exp();
    }
}

const LANES: usize = 8;

/// Spread of every row of `tile * exp(-row_log[i] - col_log[j])`.
fn row_spreads(
    tile: &[f32],
    rows: usize,
    cols: usize,
    row_log: &[f64],
    col_log: &[f64],
    stat: BalanceStat,
    out: &mut [f64],
) {
    let inv_col: Vec<f64> = col_log.iter().map(|c| (-c).exp()).collect();
    for i in 0..rows {
        let row = &tile[i * cols..(i + 1) * cols];
        // LANES independent partial sums (vectorisable), combined in a fixed order: still the
        // same bits on every run and thread count. Widths are multiples of LANES (64..256).
        let (mut s, mut s2) = ([0.0f64; LANES], [0.0f64; LANES]);
        for (xs, ws) in row.chunks_exact(LANES).zip(inv_col.chunks_exact(LANES)) {
            for l in 0..LANES {
                let v = xs[l] as f64 * ws[l];
                s[l] += v;
                s2[l] += v * v;
            }
        }
        for (&x, &w) in row
            .chunks_exact(LANES)
            .remainder()
            .iter()
            .zip(inv_col.chunks_exact(LANES).remainder())
        {
            let v = x as f64 * w;
            s[0] += v;
            s2[0] += v * v;
        }
        out[i] = spread(s.iter().sum(), s2.iter().sum(), cols, stat) * (-row_log[i]).exp();
    }
}

/// max/min of a set of spreads; an all-zero (constant) set counts as balanced.
fn ratio(spreads: &[f64]) -> f64 {
    let (lo, hi) = spreads
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), &s| {
            (lo.min(s), hi.max(s))
        });
    if hi == 0.0 {
        1.0
    } else if lo == 0.0 {
        f64::INFINITY
    } else {
        hi / lo
    }
}

/// Accumulates `log(clamp(spread))` into `logs`, clamped; returns nothing, updates in place.
fn absorb(logs: &mut [f64], spreads: &[f64]) {
    for (l, &s) in logs.iter_mut().zip(spreads) {
        let step = if s > 0.0 {
            s.clamp(SPREAD_CLAMP.0, SPREAD_CLAMP.1).ln()
        } else {
            0.0
        };
        *l = (*l + step).clamp(LOG_SCALE_CLAMP.0, LOG_SCALE_CLAMP.1);
    }
}

/// Balances a row-major `rows x cols` tile of finite values.
pub fn balance(tile: &[f32], rows: usize, cols: usize, config: &BalanceConfig) -> Balance {
    debug_assert_eq!(tile.len(), rows * cols);
    // Reference magnitude: the geometric mean of the non-zero row spreads. Dividing by it first
    // makes the clamps relative, so a tile balances the same at any absolute magnitude, and puts
    // the typical row at 1, where KVarN's clamps expect it (loud rows are scaled down freely,
    // quiet ones are lifted by at most e^0.3, so near-constant rows are not amplified).
    let mut row_spread = vec![0.0f64; rows];
    row_spreads(
        tile,
        rows,
        cols,
        &vec![0.0; rows],
        &vec![0.0; cols],
        config.stat,
        &mut row_spread,
    );
    let (log_sum, count) = row_spread
        .iter()
        .filter(|&&s| s > 0.0)
        .fold((0.0f64, 0usize), |(acc, n), &s| (acc + s.ln(), n + 1));
    let global_log = if count > 0 {
        log_sum / count as f64
    } else {
        0.0
    };

    // Scales relative to the globally normalised tile; global_log is folded into the rows at the end.
    let mut row_rel = vec![0.0f64; rows];
    let mut col_log = vec![0.0f64; cols];
    let mut row_full = vec![global_log; rows];
    let mut col_spread = vec![0.0f64; cols];

    let mut kept = (row_full.clone(), col_log.clone(), f64::INFINITY);
    for _ in 0..config.passes {
        column_spreads(
            tile,
            rows,
            cols,
            &row_full,
            &col_log,
            config.stat,
            &mut col_spread,
        );
        absorb(&mut col_log, &col_spread);
        row_spreads(
            tile,
            rows,
            cols,
            &row_full,
            &col_log,
            config.stat,
            &mut row_spread,
        );
        let before: Vec<f64> = row_rel.clone();
        absorb(&mut row_rel, &row_spread);
        // Keep the mean log column scale at zero; the product of scales is unchanged.
        let mean = col_log.iter().sum::<f64>() / cols as f64;
        for c in col_log.iter_mut() {
            *c -= mean;
        }
        for r in row_rel.iter_mut() {
            *r += mean;
        }
        for i in 0..rows {
            row_full[i] = global_log + row_rel[i];
        }
        if config.mode == BalanceMode::Best {
            // Row spreads after this pass follow from the update; column spreads need one sweep.
            for i in 0..rows {
                row_spread[i] *= (-(row_rel[i] - mean - before[i])).exp();
            }
            column_spreads(
                tile,
                rows,
                cols,
                &row_full,
                &col_log,
                config.stat,
                &mut col_spread,
            );
            let imbalance = ratio(&col_spread) + ratio(&row_spread);
            if imbalance <= kept.2 {
                kept = (row_full.clone(), col_log.clone(), imbalance);
            }
        }
    }
    if config.mode == BalanceMode::Final || config.passes == 0 {
        column_spreads(
            tile,
            rows,
            cols,
            &row_full,
            &col_log,
            config.stat,
            &mut col_spread,
        );
        row_spreads(
            tile,
            rows,
            cols,
            &row_full,
            &col_log,
            config.stat,
            &mut row_spread,
        );
        kept = (row_full, col_log, ratio(&col_spread) + ratio(&row_spread));
    }
    Balance {
        row_log: kept.0,
        col_log: kept.1,
        imbalance: kept.2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg_tile(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..rows * cols)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn imbalance_of_raw(tile: &[f32], rows: usize, cols: usize) -> f64 {
        let cfg = BalanceConfig {
            passes: 0,
            ..Default::default()
        };
        balance(tile, rows, cols, &cfg).imbalance
    }

    #[test]
    fn balancing_reduces_imbalance_of_skewed_tiles() {
        let (rows, cols) = (64, 128);
        let mut tile = lcg_tile(rows, cols, 3);
        for i in 0..rows {
            for j in 0..cols {
                // row magnitudes spanning three decades and a loud column
                let rs = 10f32.powf(-1.0 + 3.0 * i as f32 / (rows - 1) as f32);
                let cs = if j == 5 { 30.0 } else { 1.0 };
                tile[i * cols + j] *= rs * cs;
            }
        }
        let raw = imbalance_of_raw(&tile, rows, cols);
        for cfg in [BalanceConfig::default(), BalanceConfig::kvarn_reference()] {
            let b = balance(&tile, rows, cols, &cfg);
            // Quiet rows are lifted by at most e^0.3 by design, so the rows below the typical
            // magnitude keep their spread; everything louder is balanced.
            assert!(
                b.imbalance < raw / 20.0,
                "{cfg:?}: {} vs raw {raw}",
                b.imbalance
            );
            // the x30 column is divided by about 30
            assert!(
                (b.col_log[5] - b.col_log[6] - 30f64.ln()).abs() < 0.5,
                "{:?}",
                &b.col_log[4..7]
            );
            let mean_col = b.col_log.iter().sum::<f64>() / cols as f64;
            assert!(mean_col.abs() < 1e-9, "column scales centred");
            assert!(b.col_log.iter().all(|c| c.abs() < 11.0));
        }
    }

    #[test]
    fn magnitude_does_not_change_the_balanced_tile() {
        let (rows, cols) = (32, 128);
        let tile = lcg_tile(rows, cols, 9);
        let b1 = balance(&tile, rows, cols, &BalanceConfig::default());
        let scaled: Vec<f32> = tile.iter().map(|v| v * 1024.0).collect();
        let b2 = balance(&scaled, rows, cols, &BalanceConfig::default());
        for (a, b) in b1.col_log.iter().zip(&b2.col_log) {
            assert!((a - b).abs() < 1e-9);
        }
        for (a, b) in b1.row_log.iter().zip(&b2.row_log) {
            assert!((a + 1024f64.ln() - b).abs() < 1e-9);
        }
    }

    #[test]
    fn constant_rows_and_columns_stay_finite() {
        let (rows, cols) = (16, 128);
        let mut tile = lcg_tile(rows, cols, 1);
        for j in 0..cols {
            tile[3 * cols + j] = 2.5; // a constant row
        }
        for i in 0..rows {
            tile[i * cols + 7] = -1.0; // a constant column
        }
        for stat in [BalanceStat::Std, BalanceStat::Rms] {
            for mode in [BalanceMode::Final, BalanceMode::Best] {
                let b = balance(
                    &tile,
                    rows,
                    cols,
                    &BalanceConfig {
                        passes: 16,
                        mode,
                        stat,
                    },
                );
                assert!(b.row_log.iter().chain(&b.col_log).all(|v| v.is_finite()));
            }
        }
        let zeros = vec![0.0f32; rows * cols];
        let b = balance(&zeros, rows, cols, &BalanceConfig::default());
        assert!(b.col_log.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn best_mode_keeps_the_lowest_imbalance_seen() {
        let (rows, cols) = (64, 128);
        let mut tile = lcg_tile(rows, cols, 5);
        for v in tile[..cols].iter_mut() {
            *v *= 50.0; // one loud row
        }
        let best = balance(
            &tile,
            rows,
            cols,
            &BalanceConfig {
                passes: 8,
                mode: BalanceMode::Best,
                stat: BalanceStat::Std,
            },
        );
        for passes in 1..=8 {
            let f = balance(
                &tile,
                rows,
                cols,
                &BalanceConfig {
                    passes,
                    mode: BalanceMode::Final,
                    stat: BalanceStat::Std,
                },
            );
            assert!(
                best.imbalance <= f.imbalance * (1.0 + 1e-9),
                "pass {passes}: {} > {}",
                best.imbalance,
                f.imbalance
            );
        }
    }
}
