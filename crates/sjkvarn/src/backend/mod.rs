//! The backends that run the journal of [`crate::journal`], each in its own room: [`cpu`] (the
//! reference: host memory), `cuda` (device memory, feature `cuda`) and `paged` (an engine's
//! block pages, vLLM's). [`pool`] holds the sealed records the CPU and CUDA sequences share.
//!
//! [`Journal`] is one interface over the sequences of every backend: what a server (or the
//! Python bindings) calls on a cache, whatever memory holds it. Both sequences take every
//! decision from the same journal rules; this trait is their shared shell, so code above it is
//! written once and tested against the CPU reference. Which settings each backend runs is
//! [`crate::journal::capability`]'s table.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod paged;
pub mod pool;

pub use cpu::{LayerImage, MemoryReport, Sequence};
pub use pool::{PoolStats, RecordPool, SlotId};

use crate::error::CacheError;
use crate::journal::{CacheConfig, LayerState};
use std::ops::Range;

/// A sequence's journal on some backend: append and attend over host slices, the journal's
/// bookkeeping, and a copy in host memory (snapshots, states and comparisons read that).
pub trait Journal: Send + Sized {
    /// The backend's error; every cache-layer error converts into it.
    type Error: From<CacheError> + std::error::Error;

    /// The configuration the sequence was built with.
    fn config(&self) -> &CacheConfig;
    /// The journal bookkeeping of `layer` (lengths and seals); every accessor below reads it
    /// through the journal's rules, the same on every backend.
    fn layer_state(&self, layer: usize) -> Result<LayerState, Self::Error>;
    /// Tokens held by `layer`.
    fn len(&self, layer: usize) -> Result<usize, Self::Error> {
        Ok(self.layer_state(layer)?.len)
    }
    /// Sealed groups of `layer`.
    fn sealed_groups(&self, layer: usize) -> Result<usize, Self::Error> {
        Ok(self.layer_state(layer)?.sealed)
    }
    /// Positions `(sink, body, ring)` of `layer` as half-open ranges.
    fn regions(&self, layer: usize) -> Result<[Range<usize>; 3], Self::Error> {
        let state = self.layer_state(layer)?;
        Ok(self.config().rules().regions(&state))
    }
    /// Tokens the next append to `layer` runs as one ubatch (a seal only runs at its start).
    fn chunk_limit(&self, layer: usize) -> Result<usize, Self::Error> {
        let state = self.layer_state(layer)?;
        Ok(self.config().rules().chunk_limit(&state))
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::LayerCoding;
    use crate::rng::SplitMix64;
    use std::sync::Arc;

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
