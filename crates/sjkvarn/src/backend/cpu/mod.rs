//! The CPU backend, the reference every other backend is tested against: one sequence's journal
//! per layer in host memory, its sealed records in a shared [`crate::backend::RecordPool`].
//!
//! * `sequence`: the layers' journals and what a caller asks of them (lengths, regions,
//!   memory);
//! * `ring`: positions to ring rows, as attention and seals read them;
//! * `append`: rows into the ring, the seals they trigger (the journal's rules), idle seals;
//! * `lifecycle`: cutting back for prompt caching, forks;
//! * `images`: a layer's bytes in and out (snapshots, states, host copies of device layers);
//! * `alloc`: allocations that fail with an error instead of an abort;
//! * `exact_window`: the exact window's fp16 copies;
//! * [`snapshot`]: versioned, checksummed save and load;
//! * [`faults`]: failure injection for the reliability tests.

pub(crate) mod alloc;
mod append;
pub(crate) mod exact_window;
#[doc(hidden)]
pub mod faults;
mod images;
mod lifecycle;
pub(crate) mod ring;
pub(crate) mod sequence;
pub mod snapshot;

pub use images::LayerImage;
pub use sequence::{MemoryReport, Sequence};

use crate::backend::pool::PoolStats;
use crate::backend::{Journal, RecordPool};
use crate::error::CacheError;
use crate::journal::{CacheConfig, LayerState};
use std::sync::Arc;

impl Journal for Sequence {
    type Error = CacheError;

    fn config(&self) -> &CacheConfig {
        Sequence::config(self)
    }
    fn layer_state(&self, layer: usize) -> Result<LayerState, CacheError> {
        Ok(self.layer(layer)?.state())
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
