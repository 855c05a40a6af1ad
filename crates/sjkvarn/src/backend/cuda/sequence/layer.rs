//! One layer of a device sequence: its bookkeeping and the device buffers that hold its sink,
//! ring and block table.

use super::super::CudaResult;
use crate::backend::SlotId;
use crate::journal::LayerState;
use crate::journal::SINK;
use crate::GROUP;
use cudarc::driver::CudaSlice;
use cudarc::driver::CudaStream;
use std::sync::Arc;

pub(crate) struct DeviceLayer {
    pub(crate) state: LayerState,
    pub(crate) sink_k: CudaSlice<u16>,
    pub(crate) sink_v: CudaSlice<u16>,
    pub(crate) ring: CudaSlice<u8>,
    pub(crate) blocks: Vec<SlotId>,
    /// The block table on the device (capacity: every group of `max_tokens`).
    pub(crate) blocks_dev: CudaSlice<u32>,
}

impl DeviceLayer {
    pub(crate) fn state(&self) -> LayerState {
        self.state
    }
}

pub(crate) fn upload_blocks(s: &Arc<CudaStream>, l: &mut DeviceLayer) -> CudaResult<()> {
    if !l.blocks.is_empty() {
        let ids: Vec<u32> = l.blocks.clone();
        s.memcpy_htod(&ids, &mut l.blocks_dev.slice_mut(0..ids.len()))?;
    }
    Ok(())
}

/// `sj_cache_blocks`: sink, sealed groups, ring blocks of up to 128 positions.
pub(crate) fn cache_blocks(len: usize, sealed: usize) -> usize {
    if len == 0 {
        0
    } else if len <= SINK {
        1
    } else {
        let ring = len - (SINK + GROUP * sealed);
        1 + sealed + ring.div_ceil(GROUP)
    }
}
