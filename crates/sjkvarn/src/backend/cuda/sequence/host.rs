//! Device layers to and from host sequences: the bytes cross as `LayerImage`s, so a device
//! sequence and its CPU copy are byte for byte the same journal.

use super::super::CudaResult;
use super::layer::upload_blocks;
use super::*;
use crate::backend::cuda::pool::DevicePool;
use crate::backend::Journal;
use crate::backend::LayerImage;
use crate::backend::{RecordPool, Sequence};
use std::sync::Arc;

impl DeviceSequence {
    /// A CPU sequence with the same bytes (for snapshots, or to compare with the reference).
    pub fn to_host(&self, pool: Arc<RecordPool>) -> CudaResult<Sequence> {
        let s = &self.pool.stream;
        let slot = self.config.slot_bytes();
        let mut images = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let mut records = vec![0u8; l.blocks.len() * slot];
            for (dst, &id) in records.chunks_exact_mut(slot).zip(&l.blocks) {
                let at = id as usize * self.pool.slot_bytes();
                s.memcpy_dtoh(&self.pool.arena().slice(at..at + slot), dst)?;
            }
            images.push(LayerImage {
                len: l.state.len,
                sealed: l.state.sealed,
                sealed_prev: l.state.sealed_prev,
                draining: l.state.draining,
                sink_k: s.clone_dtoh(&l.sink_k)?,
                sink_v: s.clone_dtoh(&l.sink_v)?,
                ring: s.clone_dtoh(&l.ring)?,
                records,
            });
        }
        Ok(Sequence::from_images(self.config.clone(), pool, &images)?)
    }

    /// A device sequence with the bytes of a CPU sequence.
    pub fn from_host(seq: &Sequence, pool: Arc<DevicePool>) -> CudaResult<Self> {
        let config = Arc::new(seq.config().clone());
        let mut dev = DeviceSequence::new(config.clone(), pool.clone())?;
        let slot = config.slot_bytes();
        let total: usize = (0..config.layers)
            .map(|i| seq.sealed_groups(i).unwrap_or(0))
            .sum();
        let mut ids = pool.slots.reserve(total)?.into_iter();
        let s = pool.stream.clone();
        for (i, l) in dev.layers.iter_mut().enumerate() {
            let img = seq.layer_image(i)?;
            s.memcpy_htod(&img.sink_k, &mut l.sink_k)?;
            s.memcpy_htod(&img.sink_v, &mut l.sink_v)?;
            s.memcpy_htod(&img.ring, &mut l.ring)?;
            for rec in img.records.chunks_exact(slot) {
                let id = ids.next().expect("reserved one slot per sealed group");
                let at = id as usize * pool.slot_bytes();
                s.memcpy_htod(rec, &mut pool.arena().slice_mut(at..at + slot))?;
                l.blocks.push(id);
            }
            l.state = img.state();
            upload_blocks(&s, l)?;
        }
        s.synchronize()?;
        Ok(dev)
    }
}
