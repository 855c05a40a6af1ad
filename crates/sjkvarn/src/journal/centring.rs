//! Centred keys: keys stored minus the sink's mean key (softmax does not see an offset every
//! position shares, while the coded keys lose the large shared component that costs them
//! precision).

use crate::error::CacheResult;
use half::f16;

/// The key offset of a layer whose keys are centred ([`CacheConfig::centre_keys`](super::CacheConfig::centre_keys)): fixed once
/// the sink is complete, subtracted from every ring and record key before coding and from the
/// sink's keys that attention scores. Every backend computes it with this code.
#[derive(Debug, Clone)]
pub struct Centring {
    pub mean: Vec<f32>,
    pub sink_k: Vec<f16>,
}

impl Centring {
    /// The offset of a complete sink `sink_k` (`[sink][kv_heads][d]`, as appended): per head
    /// the mean of positions `1..sink` (position 0 is an outlier key in most models), and the
    /// sink's keys minus it. Depends on the stored sink alone, so a restored state recomputes
    /// the same offset bit for bit.
    pub fn of_sink(sink_k: &[f16], sink: usize, h: usize, d: usize) -> CacheResult<Self> {
        let mut sum = vec![0.0f64; h * d];
        for row in sink_k.chunks_exact(h * d).take(sink).skip(1) {
            for (acc, x) in sum.iter_mut().zip(row) {
                *acc += x.to_f64();
            }
        }
        let count = (sink - 1) as f64;
        let mean: Vec<f32> = sum.iter().map(|s| (s / count) as f32).collect();
        let mut centred = Vec::with_capacity(sink_k.len());
        for row in sink_k.chunks_exact(h * d) {
            for (x, m) in row.iter().zip(&mean) {
                let c = x.to_f32() - m;
                let hv = f16::from_f32(c);
                if !hv.is_finite() {
                    return Err(crate::CodecError::ScaleOverflow {
                        what: "centred fp16 sink",
                        value: c,
                    }
                    .into());
                }
                centred.push(hv);
            }
        }
        Ok(Self {
            mean,
            sink_k: centred,
        })
    }
}
