//! Log-domain variance balancing (Sinkhorn-Knopp on spreads) of one tile, as the reference
//! defines it bit for bit.
//!
//! A tile is row-major `[R][C]`. Each of `iters` iterations divides every column by its sample
//! spread, then every row, always recomputing the tile from the original values
//! (`M / s_col / s_row`, two f32 divisions) so rounding does not accumulate. Spreads are clamped
//! to `[1e-3, 1e3]` and the accumulated log scales to `[-0.3, 10]` (absolute clamps: the codec
//! sees rotated activations of ordinary magnitude). The final scales are kept.
//!
//! Reductions follow a fixed contract so CPU and GPU sealers agree: a vector of `n` values
//! (`n % 8 == 0`) is cut into 8 contiguous chunks, each summed in order in f64, and the chunk
//! sums combined as `((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))`; the second moment uses a fused
//! multiply-add.

/// Lanes of the reduction contract.
pub const LANES: usize = 8;

/// `b < a ? b : a` and `a < b ? b : a`: the reference's min/max (first argument on ties).
#[inline]
pub(crate) fn min_f32(a: f32, b: f32) -> f32 {
    if b < a {
        b
    } else {
        a
    }
}
#[inline]
pub(crate) fn max_f32(a: f32, b: f32) -> f32 {
    if a < b {
        b
    } else {
        a
    }
}
#[inline]
fn min_f64(a: f64, b: f64) -> f64 {
    if b < a {
        b
    } else {
        a
    }
}
#[inline]
fn max_f64(a: f64, b: f64) -> f64 {
    if a < b {
        b
    } else {
        a
    }
}

#[inline]
fn reduce8(p: [f64; LANES]) -> f64 {
    ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
}

/// Sample standard deviation (`n - 1`) of `x[0], x[stride], ..., x[(n-1)*stride]`: the
/// contract's definition, which [`column_stds`] computes for many vectors at once.
#[cfg(test)]
fn sample_std(x: &[f32], n: usize, stride: usize) -> f32 {
    let chunk = n / LANES;
    let at = |l: usize, i: usize| x[(l * chunk + i) * stride] as f64;
    // Each lane's sum runs in order; the lanes advance together, so their eight dependency
    // chains overlap instead of running one after another.
    let mut p = [0f64; LANES];
    for i in 0..chunk {
        for (l, acc) in p.iter_mut().enumerate() {
            *acc += at(l, i);
        }
    }
    let mean = reduce8(p) / n as f64;
    let mut q = [0f64; LANES];
    for i in 0..chunk {
        for (l, acc) in q.iter_mut().enumerate() {
            let d = at(l, i) - mean;
            *acc = d.mul_add(d, *acc);
        }
    }
    (reduce8(q) / n.max(2).saturating_sub(1) as f64).sqrt() as f32
}

/// Scratch of [`column_stds`].
#[derive(Debug, Clone, Default)]
struct ColumnSums {
    p: Vec<f64>,
    q: Vec<f64>,
    mean: Vec<f64>,
}

/// [`sample_std`] of every column of the row-major `[rows][cols]` tile `x` into `out`, all
/// columns at once: each column's sums keep their order and the reduction its tree (the same
/// bits as one call per column), but the loops run along rows, so they read the tile in
/// order and the columns' sums fill SIMD lanes.
#[inline(always)]
fn column_stds(x: &[f32], rows: usize, cols: usize, s: &mut ColumnSums, out: &mut [f32]) {
    let chunk = rows / LANES;
    for (sums, centred) in [(&mut s.p, false), (&mut s.q, true)] {
        sums.clear();
        sums.resize(LANES * cols, 0.0);
        for i in 0..chunk {
            for l in 0..LANES {
                let row = &x[(l * chunk + i) * cols..][..cols];
                let acc = &mut sums[l * cols..][..cols];
                if centred {
                    for ((a, &v), &m) in acc.iter_mut().zip(row).zip(&s.mean) {
                        let d = v as f64 - m;
                        *a = d.mul_add(d, *a);
                    }
                } else {
                    for (a, &v) in acc.iter_mut().zip(row) {
                        *a += v as f64;
                    }
                }
            }
        }
        let lanes = |c: usize| std::array::from_fn(|l| sums[l * cols + c]);
        if centred {
            let n1 = rows.max(2).saturating_sub(1) as f64;
            for (c, o) in out[..cols].iter_mut().enumerate() {
                *o = (reduce8(lanes(c)) / n1).sqrt() as f32;
            }
        } else {
            s.mean.clear();
            s.mean
                .extend((0..cols).map(|c| reduce8(lanes(c)) / rows as f64));
        }
    }
}

/// Scratch and results of balancing one tile.
#[derive(Debug, Clone, Default)]
pub struct Balanced {
    /// The balanced tile `M / s_col / s_row`, `[R][C]`.
    pub tile: Vec<f32>,
    pub s_row: Vec<f32>,
    pub s_col: Vec<f32>,
    log_row: Vec<f64>,
    log_col: Vec<f64>,
    columns: ColumnSums,
    column_sd: Vec<f32>,
    /// `m` transposed, `[C][R]`, and the tile recomputed in that layout: its columns are the
    /// tile's rows, so the row spreads come from [`column_stds`] (the same bits as
    /// [`sample_std`] per row, with SIMD lanes running across rows).
    m_t: Vec<f32>,
    tile_t: Vec<f32>,
    row_sd: Vec<f32>,
}

impl Balanced {
    #[inline(always)]
    fn recompute(&mut self, m: &[f32], c: usize) {
        for (r, (out, src)) in self
            .tile
            .chunks_exact_mut(c)
            .zip(m.chunks_exact(c))
            .enumerate()
        {
            let sr = self.s_row[r];
            for ((o, &x), &sc) in out.iter_mut().zip(src).zip(&self.s_col) {
                *o = x / sc / sr;
            }
        }
    }

    /// [`Self::recompute`] into the transposed tile, `[C][R]`, from the transposed `m`: each
    /// entry is the same two divisions in the same order.
    #[inline(always)]
    fn recompute_transposed(&mut self, r: usize) {
        for (c, (out, src)) in self
            .tile_t
            .chunks_exact_mut(r)
            .zip(self.m_t.chunks_exact(r))
            .enumerate()
        {
            let sc = self.s_col[c];
            for ((o, &x), &sr) in out.iter_mut().zip(src).zip(&self.s_row) {
                *o = x / sc / sr;
            }
        }
    }

    /// Balances the row-major `[rows][cols]` tile `m` with `iters` column-then-row passes.
    /// Runs with hardware fused multiply-adds where the CPU has them: the same bits (a fused
    /// multiply-add is exact by definition), without a routine call per squared deviation,
    /// which took about a quarter of a seal's time.
    pub fn run(&mut self, m: &[f32], rows: usize, cols: usize, iters: u32) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512 F, AVX2 and FMA (checked just above).
                return unsafe { self.run_avx512(m, rows, cols, iters) };
            }
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { self.run_fma(m, rows, cols, iters) };
        }
        self.run_any(m, rows, cols, iters)
    }

    /// [`Self::run`] compiled for AVX-512: the same operations in the same order (so the same
    /// bits), sixteen lanes wide where the loops vectorise (the divisions of `recompute`, the
    /// column sums).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn run_avx512(&mut self, m: &[f32], rows: usize, cols: usize, iters: u32) {
        self.run_any(m, rows, cols, iters)
    }

    /// [`Self::run`] compiled with AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_fma(&mut self, m: &[f32], rows: usize, cols: usize, iters: u32) {
        self.run_any(m, rows, cols, iters)
    }

    #[inline(always)]
    fn run_any(&mut self, m: &[f32], rows: usize, cols: usize, iters: u32) {
        self.tile.clear();
        self.tile.resize(rows * cols, 0.0);
        self.s_row.clear();
        self.s_row.resize(rows, 1.0);
        self.s_col.clear();
        self.s_col.resize(cols, 1.0);
        self.log_row.clear();
        self.log_row.resize(rows, 0.0);
        self.log_col.clear();
        self.log_col.resize(cols, 0.0);
        self.recompute(m, cols);
        self.m_t.clear();
        self.m_t.resize(rows * cols, 0.0);
        for (r, row) in m.chunks_exact(cols).take(rows).enumerate() {
            for (c, &x) in row.iter().enumerate() {
                self.m_t[c * rows + r] = x;
            }
        }
        self.tile_t.clear();
        self.tile_t.resize(rows * cols, 0.0);
        self.row_sd.resize(rows, 0.0);
        let step = |log: &mut f64, sd: f32| -> f32 {
            let sd = min_f32(max_f32(sd, 1e-3), 1e3);
            *log = min_f64(max_f64(*log + (sd as f64).ln(), -0.3), 10.0);
            log.exp() as f32
        };
        for _ in 0..iters {
            self.column_sd.resize(cols, 0.0);
            column_stds(
                &self.tile,
                rows,
                cols,
                &mut self.columns,
                &mut self.column_sd,
            );
            for c in 0..cols {
                self.s_col[c] = step(&mut self.log_col[c], self.column_sd[c]);
            }
            // The row spreads of the tile with the new column scales, from its transpose.
            self.recompute_transposed(rows);
            column_stds(
                &self.tile_t,
                cols,
                rows,
                &mut self.columns,
                &mut self.row_sd,
            );
            for r in 0..rows {
                self.s_row[r] = step(&mut self.log_row[r], self.row_sd[r]);
            }
            self.recompute(m, cols);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_stds_equal_one_sample_std_per_column() {
        let mut rng = crate::rng::SplitMix64::new(9);
        let mut sums = ColumnSums::default();
        for (rows, cols) in [(128, 128), (128, 64), (64, 256), (8, 3)] {
            let mut x = rng.gaussians(rows * cols);
            x[cols + 1] = 1e6; // one loud entry
            let mut got = vec![0.0f32; cols];
            column_stds(&x, rows, cols, &mut sums, &mut got);
            for (c, &g) in got.iter().enumerate() {
                let want = sample_std(&x[c..], rows, cols);
                assert_eq!(g.to_bits(), want.to_bits(), "{rows}x{cols}, column {c}");
            }
        }
    }

    #[test]
    fn sample_std_follows_the_lane_contract() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / 64.0;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / 63.0;
        assert!((sample_std(&x, 64, 1) as f64 - var.sqrt()).abs() < 1e-6);
        let strided: Vec<f32> = x.iter().flat_map(|&v| [v, 99.0]).collect();
        assert_eq!(sample_std(&strided, 64, 2), sample_std(&x, 64, 1));
    }

    /// The transposed row spreads give the bits of the definition: column passes, then
    /// `sample_std` of each recomputed row, then the rows' scales.
    #[test]
    fn balancing_equals_the_per_row_definition() {
        let mut rng = crate::rng::SplitMix64::new(4);
        for (rows, cols) in [(128, 64), (128, 128), (64, 256), (8, 16)] {
            let mut m = rng.gaussians(rows * cols);
            m[3 * cols + 5] = 40.0;
            let mut b = Balanced::default();
            b.run(&m, rows, cols, 16);
            // The definition, written out.
            let (mut s_row, mut s_col) = (vec![1.0f32; rows], vec![1.0f32; cols]);
            let (mut log_row, mut log_col) = (vec![0.0f64; rows], vec![0.0f64; cols]);
            let recompute = |s_row: &[f32], s_col: &[f32]| -> Vec<f32> {
                (0..rows * cols)
                    .map(|i| m[i] / s_col[i % cols] / s_row[i / cols])
                    .collect()
            };
            let step = |log: &mut f64, sd: f32| -> f32 {
                let sd = min_f32(max_f32(sd, 1e-3), 1e3);
                *log = min_f64(max_f64(*log + (sd as f64).ln(), -0.3), 10.0);
                log.exp() as f32
            };
            let mut tile = recompute(&s_row, &s_col);
            for _ in 0..16 {
                for c in 0..cols {
                    s_col[c] = step(&mut log_col[c], sample_std(&tile[c..], rows, cols));
                }
                tile = recompute(&s_row, &s_col);
                for r in 0..rows {
                    s_row[r] = step(&mut log_row[r], sample_std(&tile[r * cols..], cols, 1));
                }
                tile = recompute(&s_row, &s_col);
            }
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&b.s_row), bits(&s_row), "{rows}x{cols}");
            assert_eq!(bits(&b.s_col), bits(&s_col), "{rows}x{cols}");
            assert_eq!(bits(&b.tile), bits(&tile), "{rows}x{cols}");
        }
    }

    #[test]
    fn balancing_evens_out_spreads() {
        let (r, c) = (64, 128);
        let m: Vec<f32> = (0..r * c)
            .map(|i| {
                let (row, col) = (i / c, i % c);
                ((i as f32 * 0.71).sin()) * (1.0 + (row % 7) as f32) * (1.0 + (col % 5) as f32)
            })
            .collect();
        let mut b = Balanced::default();
        b.run(&m, r, c, 16);
        let spreads: Vec<f32> = (0..r)
            .map(|row| sample_std(&b.tile[row * c..(row + 1) * c], c, 1))
            .collect();
        let (lo, hi) = spreads
            .iter()
            .fold((f32::MAX, 0f32), |(a, z), &s| (a.min(s), z.max(s)));
        assert!(hi / lo < 1.5, "row spreads {lo}..{hi}");
    }
}
