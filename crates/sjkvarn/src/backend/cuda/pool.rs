//! The device record pool: one arena of record slots on one device, its stream, and the
//! ordering against a caller's stream.

use super::kernels::Kernels;
use super::CudaResult;
use crate::backend::RecordPool;
use crate::journal::CacheConfig;
use crate::kernel_abi::{codebook_f32, tq6_tables};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::{Arc, Mutex};

/// A raw `CUstream` owned by someone else (torch's `current_stream().cuda_stream`); 0 is the
/// legacy default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExternalStream(pub u64);

/// Record slots in one device arena shared by sequences, plus the constant tables.
pub struct DevicePool {
    pub(crate) kernels: Arc<Kernels>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) slots: Arc<RecordPool>,
    /// Slot-major record bytes. Locked only to take its address or copy into a reserved slot;
    /// every access is ordered on the pool's single stream.
    pub(crate) arena: Mutex<CudaSlice<u8>>,
    /// `tq6_0` tables (`kernel_abi::tq6_tables`) for 128-value blocks and for 64-wide heads.
    pub(crate) tq_tables: [CudaSlice<f32>; 2],
    /// Trellis codebooks as f32, index `2 * (bits - 2) + is_v` for 2 and 3 bits.
    pub(crate) codebooks: Vec<CudaSlice<f32>>,
    pub(crate) sms: usize,
}

pub(crate) fn dptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

impl DevicePool {
    /// A pool on device `ordinal` with `capacity` slots of `slot_bytes`.
    pub fn new(ordinal: usize, slot_bytes: usize, capacity: usize) -> CudaResult<Arc<Self>> {
        let kernels = Kernels::get(ordinal)?;
        let stream = kernels.ctx.new_stream()?;
        let arena = stream.alloc_zeros::<u8>((slot_bytes * capacity).max(1))?;
        let tq_tables = [
            stream.clone_htod(&tq6_tables(128))?,
            stream.clone_htod(&tq6_tables(64))?,
        ];
        let codebooks = [(2, false), (2, true), (3, false), (3, true)]
            .iter()
            .map(|&(b, is_v)| Ok(stream.clone_htod(&codebook_f32(b, is_v))?))
            .collect::<CudaResult<Vec<_>>>()?;
        let sms = kernels
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )?
            .max(1) as usize;
        Ok(Arc::new(Self {
            slots: RecordPool::new(slot_bytes, capacity),
            kernels,
            stream,
            arena: Mutex::new(arena),
            tq_tables,
            codebooks,
            sms,
        }))
    }

    /// A pool sized for `sequences` sequences of `config` at `max_tokens`.
    pub fn for_config(
        ordinal: usize,
        config: &CacheConfig,
        sequences: usize,
    ) -> CudaResult<Arc<Self>> {
        Self::new(
            ordinal,
            config.slot_bytes(),
            config.slots_per_sequence() * sequences.max(1),
        )
    }

    pub fn slot_bytes(&self) -> usize {
        self.slots.slot_bytes()
    }

    /// Slot allocator statistics (the same counters as the CPU pool).
    pub fn stats(&self) -> crate::backend::PoolStats {
        self.slots.stats()
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn arena(&self) -> std::sync::MutexGuard<'_, CudaSlice<u8>> {
        self.arena.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn arena_ptr(&self) -> u64 {
        dptr(&self.arena(), &self.stream)
    }

    /// Makes the pool's stream wait for work already queued on `ext`.
    pub(crate) fn after(&self, ext: Option<ExternalStream>) -> CudaResult<()> {
        if let Some(ExternalStream(raw)) = ext {
            // SAFETY: the caller hands us a live stream of this device's primary context
            // (torch's current stream); the wrapper is dropped before this call returns.
            let other = unsafe { self.kernels.ctx.wrap_borrowed_stream(raw as _) };
            let ev = other.record_event(None)?;
            self.stream.wait(&ev)?;
        }
        Ok(())
    }

    /// Makes `ext` wait for everything queued on the pool's stream so far.
    pub(crate) fn before(&self, ext: Option<ExternalStream>) -> CudaResult<()> {
        if let Some(ExternalStream(raw)) = ext {
            // SAFETY: as in `after`.
            let other = unsafe { self.kernels.ctx.wrap_borrowed_stream(raw as _) };
            let ev = self.stream.record_event(None)?;
            other.wait(&ev)?;
        }
        Ok(())
    }

    pub(crate) fn read_status(&self, status: &CudaSlice<i32>) -> CudaResult<i32> {
        let mut host = [0i32; 1];
        self.stream.memcpy_dtoh(status, &mut host)?;
        Ok(host[0])
    }
}
