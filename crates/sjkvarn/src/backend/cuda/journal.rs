//! The device sequence behind the backends' one interface ([`crate::backend::Journal`]).

use super::{CudaError, DeviceSequence};
use crate::backend::pool::PoolStats;
use crate::backend::{Journal, MemoryReport, RecordPool, Sequence};
use crate::journal::{CacheConfig, LayerState};

impl Journal for DeviceSequence {
    type Error = CudaError;

    fn config(&self) -> &CacheConfig {
        DeviceSequence::config(self)
    }
    fn layer_state(&self, layer: usize) -> Result<LayerState, Self::Error> {
        DeviceSequence::layer_state(self, layer)
    }
    fn append_host(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), Self::Error> {
        DeviceSequence::append_host(self, layer, k, v)
    }
    fn attend_host(
        &self,
        layer: usize,
        q: &[f32],
        scale: Option<f32>,
    ) -> Result<Vec<f32>, Self::Error> {
        DeviceSequence::attend_host(self, layer, q, scale)
    }
    fn truncate(&mut self, n: usize) -> Result<usize, Self::Error> {
        DeviceSequence::truncate(self, n)
    }
    fn seal_idle(&mut self, keep_recent: usize) -> Result<(), Self::Error> {
        DeviceSequence::seal_idle(self, keep_recent)
    }
    fn fork(&self) -> Result<Self, Self::Error> {
        DeviceSequence::fork(self)
    }
    fn memory(&self) -> MemoryReport {
        DeviceSequence::memory(self)
    }
    fn pool_stats(&self) -> PoolStats {
        self.pool().stats()
    }
    fn to_host(&self) -> Result<Sequence, Self::Error> {
        let config = self.config();
        let pool = RecordPool::new(config.slot_bytes(), config.slots_per_sequence());
        DeviceSequence::to_host(self, pool)
    }
}
