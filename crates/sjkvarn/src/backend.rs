//! One interface over the sequences of every backend: what a server (or the Python bindings)
//! calls on a cache, whatever memory holds it. The CPU [`Sequence`] and the CUDA
//! `cuda::DeviceSequence` both follow the journal rules of [`crate::journal`]; this trait is
//! their shared shell, so code above it is written once and tested against the CPU reference.

pub mod paged;

use crate::cache::pool::PoolStats;
use crate::cache::{CacheConfig, CacheError, MemoryReport, RecordPool, Sequence};
use std::ops::Range;
use std::sync::Arc;

/// A sequence's journal on some backend: append and attend over host slices, the journal's
/// bookkeeping, and a copy in host memory (snapshots, states and comparisons read that).
pub trait Journal: Send + Sized {
    /// The backend's error; every cache-layer error converts into it.
    type Error: From<CacheError> + std::error::Error;

    /// The configuration the sequence was built with.
    fn config(&self) -> &CacheConfig;
    /// Tokens held by `layer`.
    fn len(&self, layer: usize) -> Result<usize, Self::Error>;
    /// Positions `(sink, body, ring)` of `layer` as half-open ranges.
    fn regions(&self, layer: usize) -> Result<[Range<usize>; 3], Self::Error>;
    /// Tokens the next append to `layer` runs as one ubatch (a seal only runs at its start).
    fn chunk_limit(&self, layer: usize) -> Result<usize, Self::Error>;
    /// Appends model-frame K and V rows (`[tokens][kv_heads][head_dim]`) from host memory.
    fn append_host(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), Self::Error>;
    /// Attention of the newest query rows (`[tokens][q_heads][head_dim]`, host memory).
    fn attend_host(
        &self,
        layer: usize,
        q: &[f32],
        scale: Option<f32>,
    ) -> Result<Vec<f32>, Self::Error>;
    /// Keeps the first `n` tokens; returns the position to re-append from.
    fn truncate(&mut self, n: usize) -> Result<usize, Self::Error>;
    /// Seals every layer back to `min_tail` unsealed tokens, never the last
    /// `max(keep_recent, min_tail)` positions.
    fn seal_idle(&mut self, keep_recent: usize) -> Result<(), Self::Error>;
    /// A child sequence sharing this one's sealed records.
    fn fork(&self) -> Result<Self, Self::Error>;
    /// Allocated bytes per region and occupied bits per value.
    fn memory(&self) -> MemoryReport;
    /// The record pool's occupancy.
    fn pool_stats(&self) -> PoolStats;
    /// A CPU sequence with the same bytes, on a pool of its own.
    fn to_host(&self) -> Result<Sequence, Self::Error>;
}

impl Journal for Sequence {
    type Error = CacheError;

    fn config(&self) -> &CacheConfig {
        Sequence::config(self)
    }
    fn len(&self, layer: usize) -> Result<usize, CacheError> {
        Sequence::len(self, layer)
    }
    fn regions(&self, layer: usize) -> Result<[Range<usize>; 3], CacheError> {
        Sequence::regions(self, layer)
    }
    fn chunk_limit(&self, layer: usize) -> Result<usize, CacheError> {
        Sequence::chunk_limit(self, layer)
    }
    fn append_host(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), CacheError> {
        Sequence::append(self, layer, k, v)
    }
    fn attend_host(
        &self,
        layer: usize,
        q: &[f32],
        scale: Option<f32>,
    ) -> Result<Vec<f32>, CacheError> {
        crate::attention::attend(self, layer, q, scale)
    }
    fn truncate(&mut self, n: usize) -> Result<usize, CacheError> {
        Sequence::truncate(self, n)
    }
    fn seal_idle(&mut self, keep_recent: usize) -> Result<(), CacheError> {
        Sequence::seal_idle(self, keep_recent)
    }
    fn fork(&self) -> Result<Self, CacheError> {
        Ok(Sequence::fork(self))
    }
    fn memory(&self) -> MemoryReport {
        Sequence::memory(self)
    }
    fn pool_stats(&self) -> PoolStats {
        self.pool().stats()
    }
    fn to_host(&self) -> Result<Sequence, CacheError> {
        let config = Arc::new(self.config().clone());
        let pool = RecordPool::new(config.slot_bytes(), config.slots_per_sequence());
        let images = (0..config.layers)
            .map(|l| self.layer_image(l))
            .collect::<Result<Vec<_>, _>>()?;
        Sequence::from_images(config, pool, &images)
    }
}

#[cfg(feature = "cuda")]
impl Journal for crate::cuda::DeviceSequence {
    type Error = crate::cuda::CudaError;

    fn config(&self) -> &CacheConfig {
        crate::cuda::DeviceSequence::config(self)
    }
    fn len(&self, layer: usize) -> Result<usize, Self::Error> {
        crate::cuda::DeviceSequence::len(self, layer)
    }
    fn regions(&self, layer: usize) -> Result<[Range<usize>; 3], Self::Error> {
        crate::cuda::DeviceSequence::regions(self, layer)
    }
    fn chunk_limit(&self, layer: usize) -> Result<usize, Self::Error> {
        crate::cuda::DeviceSequence::chunk_limit(self, layer)
    }
    fn append_host(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), Self::Error> {
        crate::cuda::DeviceSequence::append_host(self, layer, k, v)
    }
    fn attend_host(
        &self,
        layer: usize,
        q: &[f32],
        scale: Option<f32>,
    ) -> Result<Vec<f32>, Self::Error> {
        crate::cuda::DeviceSequence::attend_host(self, layer, q, scale)
    }
    fn truncate(&mut self, n: usize) -> Result<usize, Self::Error> {
        crate::cuda::DeviceSequence::truncate(self, n)
    }
    fn seal_idle(&mut self, keep_recent: usize) -> Result<(), Self::Error> {
        crate::cuda::DeviceSequence::seal_idle(self, keep_recent)
    }
    fn fork(&self) -> Result<Self, Self::Error> {
        crate::cuda::DeviceSequence::fork(self)
    }
    fn memory(&self) -> MemoryReport {
        crate::cuda::DeviceSequence::memory(self)
    }
    fn pool_stats(&self) -> PoolStats {
        self.pool().stats()
    }
    fn to_host(&self) -> Result<Sequence, Self::Error> {
        let config = self.config();
        let pool = RecordPool::new(config.slot_bytes(), config.slots_per_sequence());
        crate::cuda::DeviceSequence::to_host(self, pool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::LayerCoding;
    use crate::rng::SplitMix64;

    /// The journal contract through the trait alone: lengths, regions and chunk limits follow
    /// appends, seals and truncation; a fork and a host copy attend exactly as the original.
    pub(crate) fn check_contract<J: Journal>(mut j: J) {
        let c = j.config().clone();
        let (kv, qv) = (c.kv_heads * c.head_dim, c.q_heads * c.head_dim);
        let mut rng = SplitMix64::new(21);
        let target = c.max_tail + 3 * 128 + 40;
        while j.len(0).unwrap() < target {
            let n = j
                .chunk_limit(0)
                .unwrap()
                .min(64)
                .min(target - j.len(0).unwrap());
            j.append_host(0, &rng.gaussians(n * kv), &rng.gaussians(n * kv))
                .unwrap();
        }
        let [sink, body, ring] = j.regions(0).unwrap();
        assert_eq!((sink.start, ring.end), (0, target));
        assert!(body.end > body.start, "the prompt sealed records");
        let q = rng.gaussians(qv);
        let out = j.attend_host(0, &q, None).unwrap();
        let child = j.fork().unwrap();
        assert_eq!(child.attend_host(0, &q, None).unwrap(), out);
        let host = j.to_host().unwrap();
        assert_eq!(Journal::attend_host(&host, 0, &q, None).unwrap(), out);
        assert_eq!(host.state_bytes().unwrap(), {
            let h2 = child.to_host().unwrap();
            h2.state_bytes().unwrap()
        });
        j.seal_idle(0).unwrap();
        assert!(j.regions(0).unwrap()[2].len() < c.min_tail + 128);
        // A cut inside the first sealed group drops the body back to the sink's end.
        assert_eq!(j.truncate(body.start + 5).unwrap(), body.start);
        assert_eq!(j.len(0).unwrap(), body.start);
        assert_eq!(j.regions(0).unwrap()[1].len(), 0);
        let m = j.memory();
        assert!(m.sink_bytes > 0 && m.tokens == body.start && j.pool_stats().capacity > 0);
    }

    #[test]
    fn the_cpu_sequence_keeps_the_journal_contract() {
        let mut config = CacheConfig::recommended(1, 4, 2, 64, LayerCoding::scalar(4, 4), 4096);
        (config.min_tail, config.max_tail) = (256, 512);
        let config = Arc::new(config);
        let seq = Sequence::new(config.clone(), Sequence::pool_for(&config, 2)).unwrap();
        check_contract(seq);
    }
}
