//! What a failed device call puts back: a layer's bookkeeping (and ring) as it was before the
//! call, so an error leaves the sequence unchanged.

use super::super::CudaResult;
use super::layer::DeviceLayer;
use crate::backend::cuda::pool::DevicePool;
use crate::journal::LayerState;
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// What a failed append or seal must put back in one layer: its lengths, its block list and,
/// where the failed work may have overwritten live rows, a device copy of its ring.
pub(crate) struct LayerUndo {
    pub(crate) state: LayerState,
    pub(crate) blocks: usize,
    pub(crate) ring: Option<CudaSlice<u8>>,
}

impl LayerUndo {
    pub(crate) fn take(l: &DeviceLayer, s: &Arc<CudaStream>, keep_ring: bool) -> CudaResult<Self> {
        Ok(Self {
            state: l.state,
            blocks: l.blocks.len(),
            ring: if keep_ring {
                Some(s.clone_dtod(&l.ring)?)
            } else {
                None
            },
        })
    }

    /// Puts the layer back and returns the slots sealed since [`take`](Self::take) to the
    /// pool. The sink needs nothing: positions past the restored length are never read.
    pub(crate) fn restore(self, l: &mut DeviceLayer, pool: &DevicePool) -> CudaResult<()> {
        let added = l.blocks.split_off(self.blocks);
        pool.slots.release(&added);
        l.state = self.state;
        if let Some(ring) = self.ring {
            pool.stream.memcpy_dtod(&ring, &mut l.ring)?;
        }
        Ok(())
    }
}
