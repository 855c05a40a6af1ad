//! The queries of the `tq6_0` ring kernels in integer form, and the centroid words their codes
//! index: what the portable and the AVX-512 kernels share.

use crate::codec::codebooks::TQ6_CENTROIDS;
use crate::codec::tq6;

/// Largest `|n|` of a query block: eight lane products `n * C` stay below `2^31`.
pub(crate) const QUERY_LIMIT: f32 = 16383.0;

/// Query blocks whose largest entry is below this are taken as zero.
pub(crate) const QUERY_FLOOR: f32 = 1.0 / (1u128 << 100) as f32;

/// Largest `|C|` of a centroid word.
pub(crate) const CENTROID_LIMIT: f32 = 16384.0;

/// Lanes of a block's integer sum.
pub(crate) const LANES: usize = 16;

/// The centroid words of blocks of `values` (128, or 64 for the 64-wide extension, whose
/// centroids are the format's times `sqrt 2`) and `1 / scale`, the float each word step is.
pub(crate) struct CentroidWords {
    pub(crate) words: [i16; 64],
    pub(crate) unit: f32,
}

pub(crate) fn centroid_words(values: usize) -> &'static CentroidWords {
    static W128: std::sync::OnceLock<CentroidWords> = std::sync::OnceLock::new();
    static W64: std::sync::OnceLock<CentroidWords> = std::sync::OnceLock::new();
    let build = |factor: f32| {
        let centroids = TQ6_CENTROIDS.map(|c| c * factor);
        let most = centroids.iter().fold(0.0f32, |m, c| m.max(c.abs()));
        let scale = CENTROID_LIMIT / most;
        CentroidWords {
            words: centroids.map(|c| (c * scale).round() as i16),
            unit: 1.0 / scale,
        }
    };
    if values == tq6::BLOCK64_VALUES {
        W64.get_or_init(|| build(std::f32::consts::SQRT_2))
    } else {
        W128.get_or_init(|| build(1.0))
    }
}

/// Query rows in fixed point, per `tq6_0` block: `n` (`[rows][d]`) and `factor`
/// (`[rows][blocks]`, `s_q / s_C`). Reused call after call.
#[derive(Default)]
pub(crate) struct FixedQueries {
    pub(crate) n: Vec<i16>,
    pub(crate) factor: Vec<f32>,
    pub(crate) rows: usize,
    pub(crate) d: usize,
    pub(crate) block: usize,
}

impl FixedQueries {
    /// Frees the buffers when they hold more than `bytes` (a long prefill's query rows), so a
    /// workspace kept between calls does not keep them; `prepare` sizes them again.
    pub(crate) fn trim(&mut self, bytes: usize) {
        let held = self.n.capacity() * 2 + self.factor.capacity() * 4;
        if held > bytes {
            *self = Self::default();
        }
    }

    /// Rounds `rows` query rows of `d` values (`stride` apart) block by block.
    pub(crate) fn prepare(&mut self, queries: &[f32], stride: usize, rows: usize, d: usize) {
        let block = if d == tq6::BLOCK64_VALUES {
            tq6::BLOCK64_VALUES
        } else {
            tq6::BLOCK_VALUES
        };
        assert!(d.is_multiple_of(block), "ring query rows");
        let unit = centroid_words(block).unit;
        let blocks = d / block;
        self.n.resize(rows * d, 0);
        self.factor.resize(rows * blocks, 0.0);
        for r in 0..rows {
            let q = &queries[r * stride..r * stride + d];
            for (b, x) in q.chunks_exact(block).enumerate() {
                let finite = x.iter().all(|v| v.is_finite());
                let most = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                // The largest entry goes to +-QUERY_LIMIT (`v * inv` rounds to at most that);
                // an all-zero block scores 0, a non-finite one NaN, as float sums would.
                let (scale, inv) = match (finite, most >= QUERY_FLOOR) {
                    (false, _) => (f32::NAN, 0.0),
                    // Below 2^-100 (`inv` would overflow) the block's products are negligible.
                    (true, false) => (0.0, 0.0),
                    (true, true) => (most / QUERY_LIMIT, QUERY_LIMIT / most),
                };
                let n = &mut self.n[r * d + b * block..r * d + (b + 1) * block];
                for (o, &v) in n.iter_mut().zip(x) {
                    *o = round_small(v * inv) as i16;
                }
                self.factor[r * blocks + b] = scale * unit;
            }
        }
        (self.rows, self.d, self.block) = (rows, d, block);
    }

    pub(crate) fn blocks(&self) -> usize {
        self.d / self.block
    }
}

/// `x` rounded to the nearest integer, ties to even, for `|x| < 2^22`: adding and taking away
/// `1.5 * 2^23` leaves no fraction bits (one IEEE rounding, the same on every CPU), without
/// the library call `round_ties_even` is where SSE4.1 is not assumed.
#[inline(always)]
pub(crate) fn round_small(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// Queries `first..first + m` of a [`FixedQueries`].
pub(crate) struct Prepared<'a> {
    pub(crate) all: &'a FixedQueries,
    pub(crate) first: usize,
    pub(crate) m: usize,
}

impl Prepared<'_> {
    /// Query `s`'s words of block `b`.
    #[inline(always)]
    pub(crate) fn words(&self, s: usize, b: usize) -> &[i16] {
        let (d, values) = (self.all.d, self.all.block);
        &self.all.n[(self.first + s) * d + b * values..][..values]
    }

    #[inline(always)]
    pub(crate) fn factor(&self, s: usize, b: usize) -> f32 {
        self.all.factor[(self.first + s) * self.all.blocks() + b]
    }
}
