//! Chunked prefill as matrix products: many query rows against a layer, each block decoded
//! once per work item into dense rotated rows, then scored and summed by an f32 GEMM
//! (the `gemm` crate, one thread per product) with an online softmax between the two products.
//!
//! Decode calls (a few rows) read records in place ([`super::fold_record`]): there each decoded
//! value would serve a handful of queries, so decoding costs more than it saves. A prefill
//! chunk reuses every decoded row for thousands of queries, so decoding once and running
//! blocked products wins; the products are over the decoded rows in f32, so the result is
//! at least as close to exact attention as the in-place kernels'.
//!
//! Work items are (KV head, block of [`ROWS_PER_ITEM`] query rows), fixed by position and
//! never by the thread count, and each item runs alone in a fixed order: the result is the
//! same for every thread count.

use super::job::Job;
use super::online_softmax::{exp_nonpositive_fused, exp_sum_fused, lane_max};
use super::output::finish_sums;
use crate::codec::extension::body::GROUP;
use crate::error::CacheResult;
use crate::parallel::run_items;
use crate::simd::SimdLevel;
use half::slice::HalfFloatSliceExt;

/// Query rows from which a call takes this path (and the layer has no exact window).
pub(super) const MIN_ROWS: usize = 32;

/// Positions decoded together: four records.
const KEY_TILE: usize = 4 * GROUP;

/// Query rows scored together in one product (times the group size in pairs): enough that
/// packing a key tile for the product costs little next to the product itself.
const ROW_BLOCK: usize = 64;

/// Query rows of one work item. Each item decodes the blocks it reads once, so fewer, larger
/// items decode less; 1,024 rows still give a 4,096-row chunk four items per KV head.
const ROWS_PER_ITEM: usize = 1024;

/// Largest total of decoded key tiles (K and V rows of every KV head, f32) a call keeps for
/// all its items to share; a larger layer is decoded by each item for itself.
const SHARED_TILE_BYTES: usize = 64 << 20;

/// Off in a test that compares both paths (which give the same bits).
#[cfg(test)]
pub(super) static SHARE_TILES: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(true);

/// Whether calls may share decoded tiles (always, outside that test).
fn may_share() -> bool {
    #[cfg(test)]
    return SHARE_TILES.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(test))]
    true
}

/// One decoded key tile: rotated K rows and V rows, `[positions][d]` each.
type DenseTile = (Vec<f32>, Vec<f32>);

/// The geometry of one call.
pub(super) struct Prefill<'a> {
    pub(super) job: &'a Job<'a>,
    /// Rotated queries by KV head, `[kv_heads][n][gs][d]`.
    pub(super) rotated: &'a [f32],
    pub(super) n: usize,
    pub(super) gs: usize,
    pub(super) qh: usize,
    /// Position of query row 0.
    pub(super) base: usize,
    pub(super) scale: f32,
    pub(super) level: SimdLevel,
}

/// Key tiles decoded once per call, `[kv_head][tile]`, by the first item that reads each (every
/// item decodes the same rows, so which one does it does not change the result).
struct SharedTiles {
    tiles: Vec<std::sync::OnceLock<DenseTile>>,
    per_head: usize,
}

/// Buffers of one participant.
struct Tiles {
    k: Vec<f32>,
    v: Vec<f32>,
    logits: Vec<f32>,
    weights: Vec<f32>,
}

impl Prefill<'_> {
    /// Attention of every query row, `[n][q_heads][d]` in the model frame.
    pub(super) fn run(&self, threads: Option<usize>) -> CacheResult<Vec<f32>> {
        let (d, kvh) = (self.job.d, self.job.kvh);
        let per_head = self.n.div_ceil(ROWS_PER_ITEM);
        let pairs = ROW_BLOCK * self.gs;
        // Item `i`'s (KV head, row block): the last row blocks, which see the most positions,
        // are taken first, so that the items left for the end are the short ones.
        let item_of = |i: usize| (i % kvh, per_head - 1 - i / kvh);
        let len = self.base + self.n;
        let shared = (len * kvh * d * 2 * 4 <= SHARED_TILE_BYTES && per_head > 1 && may_share())
            .then(|| {
                let per_head = len.div_ceil(KEY_TILE);
                SharedTiles {
                    tiles: (0..kvh * per_head)
                        .map(|_| std::sync::OnceLock::new())
                        .collect(),
                    per_head,
                }
            });
        let parts = run_items(
            kvh * per_head,
            threads,
            || Tiles {
                k: vec![0.0; KEY_TILE * d],
                v: vec![0.0; KEY_TILE * d],
                logits: vec![0.0; pairs * KEY_TILE],
                weights: vec![0.0; pairs * KEY_TILE],
            },
            |tiles, item| {
                let (h, block) = item_of(item);
                let rows = block * ROWS_PER_ITEM..((block + 1) * ROWS_PER_ITEM).min(self.n);
                self.item_at(h, rows, tiles, shared.as_ref())
            },
        );
        let mut out = vec![0.0f32; self.n * self.qh * d];
        for (item, part) in parts.into_iter().enumerate() {
            let (h, block) = item_of(item);
            let rows = part?;
            for (p, o) in rows.chunks_exact(d).enumerate() {
                let (i, j) = (block * ROWS_PER_ITEM + p / self.gs, p % self.gs);
                let at = (i * self.qh + h * self.gs + j) * d;
                out[at..at + d].copy_from_slice(o);
            }
        }
        Ok(out)
    }

    fn item_at(
        &self,
        h: usize,
        rows: std::ops::Range<usize>,
        tiles: &mut Tiles,
        shared: Option<&SharedTiles>,
    ) -> CacheResult<Vec<f32>> {
        match self.level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx512` is only chosen after the CPU reported every feature the function
            // is compiled with (`simd::detected_level`, or a test that checked it).
            SimdLevel::Avx512 => unsafe { self.item_avx512(h, rows, tiles, shared) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for AVX2 and FMA.
            SimdLevel::Avx2 => unsafe { self.item_avx2(h, rows, tiles, shared) },
            _ => self.item(h, rows, tiles, shared),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    unsafe fn item_avx512(
        &self,
        h: usize,
        rows: std::ops::Range<usize>,
        tiles: &mut Tiles,
        shared: Option<&SharedTiles>,
    ) -> CacheResult<Vec<f32>> {
        self.item(h, rows, tiles, shared)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn item_avx2(
        &self,
        h: usize,
        rows: std::ops::Range<usize>,
        tiles: &mut Tiles,
        shared: Option<&SharedTiles>,
    ) -> CacheResult<Vec<f32>> {
        self.item(h, rows, tiles, shared)
    }

    /// Query rows `rows` of KV head `h`: their normalised outputs in the model frame,
    /// `[rows][gs][d]`.
    #[inline(always)]
    fn item(
        &self,
        h: usize,
        rows: std::ops::Range<usize>,
        tiles: &mut Tiles,
        shared: Option<&SharedTiles>,
    ) -> CacheResult<Vec<f32>> {
        let (d, gs) = (self.job.d, self.gs);
        let Tiles {
            k: own_k,
            v: own_v,
            logits,
            weights,
        } = tiles;
        let head = &self.rotated[h * self.n * gs * d..(h + 1) * self.n * gs * d];
        let pairs = rows.len() * gs;
        // Each pair's running maximum and weight sum; the value sums `[pairs][d]` in one
        // matrix, so the value product adds into them.
        let mut max = vec![f32::NEG_INFINITY; pairs];
        let mut sum = vec![0.0f32; pairs];
        let mut acc = vec![0.0f32; pairs * d];
        let end = self.base + rows.end; // one past the last position any row sees
        for first in (0..end).step_by(KEY_TILE) {
            let keys = KEY_TILE.min(end - first);
            let (kt, vt): (&[f32], &[f32]) = match shared {
                Some(sh) => {
                    let slot = &sh.tiles[h * sh.per_head + first / KEY_TILE];
                    if slot.get().is_none() {
                        // The whole tile (later items read further into it).
                        let count = KEY_TILE.min(self.base + self.n - first);
                        let (mut k, mut v) = (vec![0.0; count * d], vec![0.0; count * d]);
                        self.dense_rows(h, first, count, &mut k, &mut v)?;
                        // Another item may have set it meanwhile: the same rows.
                        let _ = slot.set((k, v));
                    }
                    let (k, v) = slot.get().expect("set above");
                    (k, v)
                }
                None => {
                    self.dense_rows(h, first, keys, own_k, own_v)?;
                    (own_k, own_v)
                }
            };
            for block in (rows.start..rows.end).step_by(ROW_BLOCK) {
                let block = block..(block + ROW_BLOCK).min(rows.end);
                // Columns the block's last row sees; rows before `first` see none.
                let most = (self.base + block.end).saturating_sub(first).min(keys);
                if most == 0 {
                    continue;
                }
                let np = block.len() * gs;
                let at = (block.start - rows.start) * gs; // the block's first pair
                let q = &head[block.start * gs * d..block.end * gs * d];
                // logits[np][most] = q[np][d] . k[most][d]^T (k read transposed)
                let (lg, k) = (&mut logits[..np * most], &kt[..most * d]);
                gemm([np, d, most], self.scale, q, [d, 1], k, [1, d], lg, false);
                for slot in 0..np {
                    let i = block.start + slot / gs;
                    let visible = (self.base + i + 1).saturating_sub(first).min(most);
                    let lg = &logits[slot * most..(slot + 1) * most];
                    let w = &mut weights[slot * most..(slot + 1) * most];
                    let p = at + slot;
                    // A row that sees none of the tile (or none yet) adds zeros.
                    if visible == 0 {
                        w.fill(0.0);
                        continue;
                    }
                    let new_max = max[p].max(lane_max(&lg[..visible]));
                    let rescale = exp_nonpositive_fused(max[p] - new_max);
                    if rescale != 1.0 {
                        sum[p] *= rescale;
                        acc[p * d..(p + 1) * d]
                            .iter_mut()
                            .for_each(|a| *a *= rescale);
                    }
                    max[p] = new_max;
                    sum[p] += exp_sum_fused(lg, new_max, visible, w);
                }
                // acc[np][d] += weights[np][most] . v[most][d]
                let (w, v) = (&weights[..np * most], &vt[..most * d]);
                let acc = &mut acc[at * d..(at + np) * d];
                gemm([np, most, d], 1.0, w, [most, 1], v, [d, 1], acc, true);
            }
        }
        let mut out = vec![0.0f32; pairs * d];
        for ((o, a), &s) in out.chunks_exact_mut(d).zip(acc.chunks_exact(d)).zip(&sum) {
            finish_sums(a, s, o, d)?;
        }
        Ok(out)
    }

    /// Rotated K and V rows of positions `first..first + count` of KV head `h` into `kt` and
    /// `vt`: the sink from its fp16 rows, body records decoded, ring rows from their staging.
    #[inline(always)]
    fn dense_rows(
        &self,
        h: usize,
        first: usize,
        count: usize,
        kt: &mut [f32],
        vt: &mut [f32],
    ) -> CacheResult<()> {
        let job = self.job;
        let (lj, d, kvh) = (job.lj, job.d, job.kvh);
        let end = first + count;
        let mut pos = first;
        // Sink.
        let sink_end = lj.state.len.min(job.sink);
        while pos < end.min(sink_end) {
            let at = (pos * kvh + h) * d;
            let t = (pos - first) * d;
            lj.scored_sink_k()[at..at + d].convert_to_f32_slice(&mut kt[t..t + d]);
            lj.sink_v[at..at + d].convert_to_f32_slice(&mut vt[t..t + d]);
            pos += 1;
        }
        // Body records.
        let ring_start = lj.ring_start(job.sink);
        let rb = job.codec.record_bytes();
        let pool = job.seq.pool();
        while pos < end.min(ring_start) {
            let g = (pos - job.sink) / GROUP;
            let start = job.sink + g * GROUP;
            let bytes = pool.get(lj.blocks[g]);
            let (k, v) = job.codec.decode_rotated(&bytes[h * rb..(h + 1) * rb])?;
            let upto = end.min(start + GROUP);
            let (from, to) = ((pos - start) * d, (upto - start) * d);
            let t = (pos - first) * d;
            kt[t..t + to - from].copy_from_slice(&k[from..to]);
            vt[t..t + to - from].copy_from_slice(&v[from..to]);
            pos = upto;
        }
        // Ring.
        if pos < end {
            let ring = job.seq.ring_cursor(lj, ring_start, h);
            while pos < end {
                let t = (pos - first) * d;
                ring.row(pos, false, &mut kt[t..t + d]);
                ring.row(pos, true, &mut vt[t..t + d]);
                pos += 1;
            }
        }
        Ok(())
    }
}

/// `c[m][n] = alpha a[m][k] . b[k][n]` (`c +=` that when `accumulate`) over row-major `c`,
/// `a` and `b` at the given `[row, column]` strides (`b` with strides `[1, k]` is a `[n][k]`
/// matrix read transposed). Every operand is checked to hold what the strides reach, so the
/// unsafe call stays in bounds.
#[allow(clippy::too_many_arguments)]
fn gemm(
    [m, k, n]: [usize; 3],
    alpha: f32,
    a: &[f32],
    [rsa, csa]: [usize; 2],
    b: &[f32],
    [rsb, csb]: [usize; 2],
    c: &mut [f32],
    accumulate: bool,
) {
    let reach = |rows: usize, cols: usize, rs: usize, cs: usize| {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * rs + (cols - 1) * cs + 1
        }
    };
    assert!(
        a.len() >= reach(m, k, rsa, csa) && b.len() >= reach(k, n, rsb, csb) && c.len() >= m * n,
        "gemm operands"
    );
    // SAFETY: the assertion above keeps every element the strides address inside `a`, `b`
    // and `c`; `c` is borrowed mutably, so it overlaps neither input. `c` is read only when
    // accumulating (`c = 1 c + alpha a b`), else `c = alpha a b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            csa as isize,
            rsa as isize,
            b.as_ptr(),
            csb as isize,
            rsb as isize,
            if accumulate { 1.0f32 } else { 0.0 },
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::gemm;
    use crate::rng::SplitMix64;

    /// The wrapper computes `alpha a b`, or adds it to `c`, for both layouts the prefill uses
    /// (`b` row-major, and `b` read transposed), empty products included; without
    /// `accumulate` whatever `c` held before is ignored.
    #[test]
    fn gemm_matches_the_plain_product_for_both_layouts() {
        let mut rng = SplitMix64::new(3);
        for [m, k, n] in [[192, 64, 512], [7, 33, 5], [1, 1, 1], [0, 4, 3], [3, 0, 2]] {
            let a = rng.gaussians(m * k);
            let b = rng.gaussians(k * n);
            let before = rng.gaussians(m * n);
            for transposed in [false, true] {
                // `b` as [k][n] row-major, or the same matrix stored [n][k] and read transposed.
                let (stored, strides) = if transposed {
                    let t: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
                    (t, [1, k])
                } else {
                    (b.clone(), [n, 1])
                };
                for accumulate in [false, true] {
                    let mut c = if accumulate {
                        before.clone()
                    } else {
                        vec![f32::NAN; m * n]
                    };
                    gemm(
                        [m, k, n],
                        0.5,
                        &a,
                        [k, 1],
                        &stored,
                        strides,
                        &mut c,
                        accumulate,
                    );
                    for i in 0..m {
                        for j in 0..n {
                            let mut want: f64 = 0.5
                                * (0..k)
                                    .map(|l| a[i * k + l] as f64 * b[l * n + j] as f64)
                                    .sum::<f64>();
                            if accumulate {
                                want += before[i * n + j] as f64;
                            }
                            let got = c[i * n + j] as f64;
                            assert!(
                                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{m} {k} {n} {accumulate}"
                            );
                        }
                    }
                }
            }
        }
    }
}
