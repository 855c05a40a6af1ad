//! A sequence whose journal bytes live in device memory. The journal rule, planning and
//! accounting are the CPU's own functions ([`plan_append`], [`truncated_state`],
//! [`memory_report`]); only the bytes and the kernels differ.
//!
//! Ordering: every sequence of a [`DevicePool`] runs on the pool's stream, so seals, ring writes
//! and attention of sequences sharing records are ordered. Callers that produce inputs or read
//! outputs on another stream (torch's current stream) pass it as [`ExternalStream`]: sjkvarn's
//! stream waits for an event recorded on it before reading the inputs, and it waits for an event
//! recorded on sjkvarn's stream before it may read the outputs.

use super::kernels::Kernels;
use super::{CudaError, CudaResult};
use crate::cache::pool::SlotId;
use crate::cache::sequence::{memory_report, LayerImage, MemoryReport};
use crate::cache::staging::RowCodec;
use crate::cache::{CacheConfig, CacheError, RecordPool, Sequence, Staging, SINK};
use crate::codec::{Body, RecordLayout, ITERS};
use crate::journal::{Chunk, LayerState};
use crate::kernel_abi::{
    attend_shared_floats, codebook_f32, device_layout, seal_workspace_bytes, tq6_tables,
    KernelLayerView, KernelRecordLayout, STAGING_TQ6,
};
use crate::GROUP;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::{Arc, Mutex};

/// A raw `CUstream` owned by someone else (torch's `current_stream().cuda_stream`); 0 is the
/// legacy default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExternalStream(pub u64);

/// Record slots in one device arena shared by sequences, plus the constant tables.
pub struct DevicePool {
    kernels: Arc<Kernels>,
    stream: Arc<CudaStream>,
    slots: Arc<RecordPool>,
    /// Slot-major record bytes. Locked only to take its address or copy into a reserved slot;
    /// every access is ordered on the pool's single stream.
    arena: Mutex<CudaSlice<u8>>,
    /// `tq6_0` tables (`kernel_abi::tq6_tables`) for 128-value blocks and for 64-wide heads.
    tq_tables: [CudaSlice<f32>; 2],
    /// Trellis codebooks as f32, index `2 * (bits - 2) + is_v` for 2 and 3 bits.
    codebooks: Vec<CudaSlice<f32>>,
    sms: usize,
}

fn dptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
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
    pub fn stats(&self) -> crate::cache::pool::PoolStats {
        self.slots.stats()
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn arena(&self) -> std::sync::MutexGuard<'_, CudaSlice<u8>> {
        self.arena.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn arena_ptr(&self) -> u64 {
        dptr(&self.arena(), &self.stream)
    }

    /// Makes the pool's stream wait for work already queued on `ext`.
    fn after(&self, ext: Option<ExternalStream>) -> CudaResult<()> {
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
    fn before(&self, ext: Option<ExternalStream>) -> CudaResult<()> {
        if let Some(ExternalStream(raw)) = ext {
            // SAFETY: as in `after`.
            let other = unsafe { self.kernels.ctx.wrap_borrowed_stream(raw as _) };
            let ev = self.stream.record_event(None)?;
            other.wait(&ev)?;
        }
        Ok(())
    }

    fn read_status(&self, status: &CudaSlice<i32>) -> CudaResult<i32> {
        let mut host = [0i32; 1];
        self.stream.memcpy_dtoh(status, &mut host)?;
        Ok(host[0])
    }
}

struct DeviceLayer {
    len: usize,
    sealed: usize,
    sealed_prev: usize,
    draining: bool,
    sink_k: CudaSlice<u16>,
    sink_v: CudaSlice<u16>,
    ring: CudaSlice<u8>,
    blocks: Vec<SlotId>,
    /// The block table on the device (capacity: every group of `max_tokens`).
    blocks_dev: CudaSlice<u32>,
}

/// One sequence with its journal on the device. Dropping it returns its slots to the pool.
pub struct DeviceSequence {
    config: Arc<CacheConfig>,
    pool: Arc<DevicePool>,
    rows: RowCodec,
    /// The SJ-KVaRN record layout of each layer (the device kernels' only format).
    layouts: Vec<RecordLayout>,
    layers: Vec<DeviceLayer>,
}

/// The device record layout of a layer's coding: the reference bodies only (scalar or trellis
/// on both sides; no RoPE-block keys, no 5..8-bit sides, no mixed scalar/trellis records).
fn layer_layout(config: &CacheConfig, layer: usize) -> CudaResult<RecordLayout> {
    use crate::codec::extension::body::BodyCoding;
    let lc = &config.layer_coding[layer];
    let body = match (lc.k_coding, lc.v_coding) {
        (BodyCoding::Scalar, BodyCoding::Scalar) => Body::Scalar,
        (
            BodyCoding::Trellis(crate::codec::extension::body::TrellisAxis::Token),
            BodyCoding::Trellis(crate::codec::extension::body::TrellisAxis::Token),
        ) => Body::Trellis,
        (k, v) => {
            return Err(CudaError::Unsupported(format!(
                "layer {layer} codes K as {k:?} and V as {v:?}; the device kernels seal \
                 SJ-KVaRN reference records only (scalar or trellis on both sides)"
            )))
        }
    };
    device_layout(config.head_dim, lc.k_bits, lc.v_bits, body)
        .map_err(|e| CudaError::Unsupported(format!("layer {layer}: {e}")))
}

impl Drop for DeviceSequence {
    fn drop(&mut self) {
        for l in &self.layers {
            self.pool.slots.release(&l.blocks);
        }
    }
}

fn kernel_error(code: i32, what: &str) -> CudaError {
    match code {
        1 => CudaError::Rejected(format!(
            "{what}: input holds NaN or Inf; nothing was appended"
        )),
        2 => CudaError::Rejected(format!(
            "{what}: a value or scale does not fit fp16; nothing was changed"
        )),
        other => CudaError::Driver(format!("{what}: kernel status {other}")),
    }
}

impl DeviceSequence {
    /// An empty sequence on the pool's device. The device path implements `tq6_0` staging and
    /// query groups with a kernel; anything else is refused here, up front.
    pub fn new(config: Arc<CacheConfig>, pool: Arc<DevicePool>) -> CudaResult<Self> {
        config.validate()?;
        if config.sink != SINK {
            return Err(CudaError::Unsupported(format!(
                "sink {} (the device kernels keep a {SINK}-position sink)",
                config.sink
            )));
        }
        let reference_codec = |l: usize| {
            matches!(
                config.body_codec(l),
                Ok(crate::codec::BodyCodec::Reference { .. })
            )
        };
        if !(0..config.layers).all(reference_codec) {
            return Err(CudaError::Unsupported(
                "balancing settings other than the format's (final, std): the device kernels \
                 seal reference records only"
                    .into(),
            ));
        }
        if config.auto_staging.is_some()
            || config.k_staging != Staging::Tq6
            || config.v_staging != Staging::Tq6
        {
            return Err(CudaError::Unsupported(format!(
                "staging {} (the device ring is tq6_0 for keys and values)",
                config.staging_name()
            )));
        }
        if config.centre_keys {
            return Err(CudaError::Unsupported(
                "centred keys (the device kernels store keys as appended; use the reference \
                 journal, centre_keys=False)"
                    .into(),
            ));
        }
        if config.exact_recent > 0 {
            return Err(CudaError::Unsupported(
                "an exact window (the device kernels read the ring's codes for every position; \
                 use exact_recent=0)"
                    .into(),
            ));
        }
        let layouts = (0..config.layers)
            .map(|layer| layer_layout(&config, layer))
            .collect::<CudaResult<Vec<_>>>()?;
        pool.kernels.attend(config.group_size())?;
        let need = layouts
            .iter()
            .map(|l| l.bytes * config.kv_heads)
            .max()
            .unwrap_or(0)
            .max(config.slot_bytes());
        if pool.slot_bytes() < need {
            return Err(CacheError::InvalidConfig(format!(
                "pool slots of {} bytes are smaller than this configuration's {} bytes",
                pool.slot_bytes(),
                need
            ))
            .into());
        }
        let rows = RowCodec::new(config.k_staging, config.head_dim);
        let per_pos = config.kv_heads * config.head_dim;
        let ring_bytes = config.ring_rows() * config.kv_heads * 2 * rows.row_bytes();
        let max_groups = config
            .max_tokens
            .saturating_sub(SINK)
            .div_ceil(GROUP)
            .max(1);
        let s = &pool.stream;
        let layers = (0..config.layers)
            .map(|_| {
                Ok(DeviceLayer {
                    len: 0,
                    sealed: 0,
                    sealed_prev: 0,
                    draining: false,
                    sink_k: s.alloc_zeros::<u16>(SINK * per_pos)?,
                    sink_v: s.alloc_zeros::<u16>(SINK * per_pos)?,
                    ring: s.alloc_zeros::<u8>(ring_bytes)?,
                    blocks: Vec::new(),
                    blocks_dev: s.alloc_zeros::<u32>(max_groups)?,
                })
            })
            .collect::<CudaResult<Vec<_>>>()?;
        Ok(Self {
            config,
            pool,
            rows,
            layouts,
            layers,
        })
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    pub fn pool(&self) -> &Arc<DevicePool> {
        &self.pool
    }

    fn layer(&self, layer: usize) -> CudaResult<&DeviceLayer> {
        self.layers.get(layer).ok_or_else(|| {
            CacheError::LayerOutOfRange {
                layer,
                layers: self.config.layers,
            }
            .into()
        })
    }

    /// Tokens held by `layer`.
    pub fn len(&self, layer: usize) -> CudaResult<usize> {
        Ok(self.layer(layer)?.len)
    }

    /// Sealed groups of `layer`.
    pub fn sealed_groups(&self, layer: usize) -> CudaResult<usize> {
        Ok(self.layer(layer)?.sealed)
    }

    /// Positions `(sink, body, ring)` of `layer`.
    pub fn regions(&self, layer: usize) -> CudaResult<[std::ops::Range<usize>; 3]> {
        let l = self.layer(layer)?;
        Ok(self.config.rules().regions(&l.state()))
    }

    /// Tokens the next append to `layer` can take with no seal inside it.
    pub fn chunk_limit(&self, layer: usize) -> CudaResult<usize> {
        let l = self.layer(layer)?;
        Ok(self.config.rules().chunk_limit(&l.state()))
    }

    /// A child sequence sharing this one's sealed records (reference counted) with its own
    /// copies of the sink and ring.
    pub fn fork(&self) -> CudaResult<DeviceSequence> {
        let s = &self.pool.stream;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(DeviceLayer {
                    len: l.len,
                    sealed: l.sealed,
                    sealed_prev: l.sealed_prev,
                    draining: l.draining,
                    sink_k: s.clone_dtod(&l.sink_k)?,
                    sink_v: s.clone_dtod(&l.sink_v)?,
                    ring: s.clone_dtod(&l.ring)?,
                    blocks: l.blocks.clone(),
                    blocks_dev: s.clone_dtod(&l.blocks_dev)?,
                })
            })
            .collect::<CudaResult<Vec<_>>>()?;
        for l in &layers {
            self.pool.slots.retain(&l.blocks);
        }
        Ok(DeviceSequence {
            config: self.config.clone(),
            pool: self.pool.clone(),
            rows: self.rows,
            layouts: self.layouts.clone(),
            layers,
        })
    }

    /// The kernels' view of `layer`.
    fn view(&self, layer: usize) -> KernelLayerView {
        let l = &self.layers[layer];
        let s = &self.pool.stream;
        let rec = &self.layouts[layer];
        let codebook = |bits: u32, is_v: bool| {
            if rec.body != Body::Trellis {
                return 0;
            }
            self.pool
                .codebooks
                .get(2 * (bits as usize).wrapping_sub(2) + is_v as usize)
                .map_or(0, |c| dptr(c, s))
        };
        let d = self.config.head_dim;
        KernelLayerView {
            sink_k: dptr(&l.sink_k, s),
            sink_v: dptr(&l.sink_v, s),
            ring: dptr(&l.ring, s),
            pool: self.pool.arena_ptr(),
            blocks: dptr(&l.blocks_dev, s),
            tq_table: dptr(&self.pool.tq_tables[(d == 64) as usize], s),
            k_codebook: codebook(rec.bits_k, false),
            v_codebook: codebook(rec.bits_v, true),
            slot_bytes: self.pool.slot_bytes() as u64,
            len: l.len as i32,
            sealed: l.sealed as i32,
            kv_heads: self.config.kv_heads as i32,
            head_dim: d as i32,
            ring_rows: self.config.ring_rows() as i32,
            row_bytes: self.rows.row_bytes() as i32,
            staging: STAGING_TQ6,
            pad: 0,
            rec: KernelRecordLayout::of(rec),
        }
    }

    /// Appends `n` tokens of post-RoPE K and V from device memory (`[n][kv_heads][head_dim]`
    /// f32, contiguous, model frame), sealing as the journal rule says. On error nothing changes.
    ///
    /// # Safety
    /// `k` and `v` must point to `n * kv_heads * head_dim` readable f32 on this pool's device,
    /// valid until the work queued here has run (order it with `ext`).
    pub unsafe fn append_raw(
        &mut self,
        layer: usize,
        k: u64,
        v: u64,
        n: usize,
        ext: Option<ExternalStream>,
    ) -> CudaResult<()> {
        let cfg = self.config.clone();
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        let start = self.layer(layer)?.len;
        let sealed0 = self.layers[layer].sealed;
        if n == 0 {
            return Ok(());
        }
        if start + n > cfg.max_tokens {
            return Err(CacheError::TooLong {
                len: start,
                adding: n,
                max: cfg.max_tokens,
            }
            .into());
        }
        let pool = self.pool.clone();
        let s = &pool.stream;
        pool.after(ext)?;

        // 1. Stage every row into scratch (the only step that can reject the input).
        let rb = self.rows.row_bytes();
        let sink_tokens = SINK.saturating_sub(start).min(n);
        let ring_tokens = (start + n).saturating_sub(SINK.max(start));
        let staged = s.alloc_zeros::<u8>((ring_tokens * h * 2 * rb).max(1))?;
        let sink_out = s.alloc_zeros::<u16>((2 * sink_tokens * h * d).max(1))?;
        let status = s.alloc_zeros::<i32>(1)?;
        let (start_i, h_i, d_i, sink_i) = (start as i32, h as i32, d as i32, sink_tokens as i32);
        let (staging_i, rb_i) = (STAGING_TQ6, rb as i32);
        let tables = &pool.tq_tables[(d == 64) as usize];
        let mut launch = s.launch_builder(&pool.kernels.append);
        launch
            .arg(&k)
            .arg(&v)
            .arg(&start_i)
            .arg(&h_i)
            .arg(&d_i)
            .arg(&staging_i)
            .arg(&rb_i)
            .arg(tables)
            .arg(&staged)
            .arg(&sink_out)
            .arg(&sink_i)
            .arg(&status);
        // SAFETY: argument list matches `sj_append_stage`; the scratch buffers have the sizes
        // the kernel indexes (ring_tokens and sink_tokens rows), inputs are the caller's.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (n as u32, h as u32, 2),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        let code = pool.read_status(&status)?;
        if code != 0 {
            return Err(kernel_error(code, "append"));
        }

        // 2. Plan chunks and seals. Ring rows overwritten by one chunk may belong to groups a
        //    seal of this append sealed, and a later seal can still fail (a kernel status,
        //    device memory for its workspace); undoing the seals makes those rows live again, so
        //    keep a copy of the ring when both can happen. Then reserve every slot up front.
        let plan = cfg.rules().plan_append(self.layers[layer].state(), n);
        let needed = plan.last().map_or(sealed0, |c| c.state.sealed) - sealed0;
        let undo = LayerUndo::take(&self.layers[layer], s, plan.len() > 1 && needed > 0)?;
        let mut slots = pool.slots.reserve(needed)?;
        slots.reverse(); // taken from the back, in reservation order

        // 3. Execute: seals, then ring and sink writes, chunk by chunk; undone on any error.
        let r = self.execute_append(
            layer,
            start,
            &plan,
            &mut slots,
            &staged,
            &sink_out,
            sink_tokens,
        );
        // Slots the plan did not consume (all of them on error) go back to the pool.
        pool.slots.release(&slots);
        if let Err(e) = r {
            undo.restore(&mut self.layers[layer], &pool)?;
            return Err(e);
        }
        pool.before(ext)?;
        Ok(())
    }

    /// Step 3 of [`append_raw`](Self::append_raw): runs the plan's seals (taking slots from the
    /// back of `slots`) and copies staged rows into the ring and the sink.
    #[allow(clippy::too_many_arguments)]
    fn execute_append(
        &mut self,
        layer: usize,
        start: usize,
        plan: &[Chunk],
        slots: &mut Vec<SlotId>,
        staged: &CudaSlice<u8>,
        sink_out: &CudaSlice<u16>,
        sink_tokens: usize,
    ) -> CudaResult<()> {
        let cfg = self.config.clone();
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        let rb = self.rows.row_bytes();
        let pool = self.pool.clone();
        let s = &pool.stream;
        let per_tok = h * d;
        let ring_rows = cfg.ring_rows();
        let mut written = 0usize;
        for c in plan {
            let (take, target) = (c.take, c.state.sealed);
            let from = self.layers[layer].sealed;
            if target > from {
                let at = slots.len() - (target - from);
                let ids: Vec<SlotId> = slots.split_off(at).into_iter().rev().collect();
                if let Err(e) = self.seal_groups(layer, from, target, &ids) {
                    slots.extend(ids.into_iter().rev());
                    return Err(e);
                }
            }
            let (lo, hi) = (start + written, start + written + take);
            let l = &mut self.layers[layer];
            l.sealed_prev = c.state.sealed_prev;
            l.draining = c.state.draining;
            // Sink positions.
            if lo < SINK {
                let (a, b) = (lo, hi.min(SINK));
                let src = (a - start) * per_tok..(b - start) * per_tok;
                let dst = a * per_tok..b * per_tok;
                s.memcpy_dtod(
                    &sink_out.slice(src.clone()),
                    &mut l.sink_k.slice_mut(dst.clone()),
                )?;
                let off = sink_tokens * per_tok;
                s.memcpy_dtod(
                    &sink_out.slice(src.start + off..src.end + off),
                    &mut l.sink_v.slice_mut(dst),
                )?;
            }
            // Ring positions, in at most two pieces around the wrap.
            let mut pos = lo.max(SINK);
            while pos < hi {
                let idx = (pos - SINK) % ring_rows;
                let count = (hi - pos).min(ring_rows - idx);
                let row_bytes = h * 2 * rb;
                let src = (pos - SINK.max(start)) * row_bytes;
                s.memcpy_dtod(
                    &staged.slice(src..src + count * row_bytes),
                    &mut l.ring.slice_mut(idx * row_bytes..(idx + count) * row_bytes),
                )?;
                pos += count;
            }
            l.len = hi;
            written += take;
        }
        Ok(())
    }

    /// [`append_raw`](Self::append_raw) from host slices (tests, benchmarks, the CPU bridge).
    pub fn append_host(&mut self, layer: usize, k: &[f32], v: &[f32]) -> CudaResult<()> {
        let per_tok = self.config.kv_heads * self.config.head_dim;
        if !k.len().is_multiple_of(per_tok) || v.len() != k.len() {
            return Err(CacheError::Shape {
                what: "append k/v",
                expected: format!(
                    "[tokens, {}, {}] for both",
                    self.config.kv_heads, self.config.head_dim
                ),
                got: format!("{} and {} values", k.len(), v.len()),
            }
            .into());
        }
        let s = self.pool.stream.clone();
        let kd = s.clone_htod(k)?;
        let vd = s.clone_htod(v)?;
        let (kp, vp) = (dptr(&kd, &s), dptr(&vd, &s));
        // SAFETY: kd/vd hold exactly n rows and live until the stream has run the append
        // (the status read inside synchronises the stream).
        let r = unsafe { self.append_raw(layer, kp, vp, k.len() / per_tok, None) };
        s.synchronize()?;
        r
    }

    /// Seals groups `from..to` of `layer` into `slots` (reserved, one per group).
    fn seal_groups(
        &mut self,
        layer: usize,
        from: usize,
        to: usize,
        slots: &[SlotId],
    ) -> CudaResult<()> {
        let count = to - from;
        // The CPU's fault-injection point (one check per record), so the rollback of a seal
        // that fails part-way through an append can be tested on a GPU too.
        for _ in 0..count * self.config.kv_heads {
            crate::cache::faults::check_record()?;
        }
        let pool = self.pool.clone();
        let s = &pool.stream;
        let view = self.view(layer);
        let groups: Vec<u32> = (from as u32..to as u32).collect();
        let ids: Vec<u32> = slots.to_vec();
        let groups_dev = s.clone_htod(&groups)?;
        let slots_dev = s.clone_htod(&ids)?;
        let blocks = count * self.config.kv_heads;
        let workspace = s.alloc_zeros::<u8>(blocks * seal_workspace_bytes(self.config.head_dim))?;
        let status = s.alloc_zeros::<i32>(1)?;
        let iters = ITERS as i32;
        let arena = pool.arena_ptr();
        let mut launch = s.launch_builder(&pool.kernels.seal);
        launch
            .arg(&view)
            .arg(&groups_dev)
            .arg(&slots_dev)
            .arg(&arena)
            .arg(&iters)
            .arg(&workspace)
            .arg(&status);
        // SAFETY: argument list matches `sj_seal`; the workspace holds one scratch per
        // block; slot ids are reserved slots of this arena; the groups' rows are in the ring.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (count as u32, self.config.kv_heads as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        let code = pool.read_status(&status)?;
        if code != 0 {
            return Err(kernel_error(code, "seal"));
        }
        let l = &mut self.layers[layer];
        let at = l.blocks.len();
        s.memcpy_htod(slots, &mut l.blocks_dev.slice_mut(at..at + slots.len()))?;
        l.blocks.extend_from_slice(slots);
        l.sealed = to;
        Ok(())
    }

    /// The idle step (see the CPU's `Sequence::seal_idle`): seals every layer back to
    /// `min_tail` unsealed tokens, never the last `max(keep_recent, min_tail)` positions.
    pub fn seal_idle(&mut self, keep_recent: usize) -> CudaResult<()> {
        let rules = self.config.rules();
        let states: Vec<LayerState> = self
            .layers
            .iter()
            .map(|l| rules.idle(l.state(), keep_recent))
            .collect();
        let plan: Vec<(usize, usize, usize)> = self
            .layers
            .iter()
            .zip(&states)
            .enumerate()
            .filter(|(_, (l, st))| st.sealed > l.sealed)
            .map(|(i, (l, st))| (i, l.sealed, st.sealed))
            .collect();
        let pool = self.pool.clone();
        let mut slots = pool
            .slots
            .reserve(plan.iter().map(|p| p.2 - p.1).sum())?
            .into_iter();
        // A later layer failing undoes the earlier layers' seals (seals do not touch the ring).
        let undo: Vec<(usize, LayerUndo)> = plan
            .iter()
            .map(|&(layer, _, _)| {
                Ok((
                    layer,
                    LayerUndo::take(&self.layers[layer], &pool.stream, false)?,
                ))
            })
            .collect::<CudaResult<_>>()?;
        for (layer, from, to) in plan {
            let ids: Vec<SlotId> = slots.by_ref().take(to - from).collect();
            if let Err(e) = self.seal_groups(layer, from, to, &ids) {
                pool.slots.release(&ids);
                pool.slots.release(&slots.collect::<Vec<_>>());
                for (layer, u) in undo {
                    u.restore(&mut self.layers[layer], &pool)?;
                }
                return Err(e);
            }
        }
        for (l, st) in self.layers.iter_mut().zip(states) {
            l.sealed_prev = st.sealed_prev;
            l.draining = st.draining;
        }
        Ok(())
    }

    /// Attention of `n` query rows (`[n][q_heads][head_dim]` f32, contiguous, model frame, the
    /// last `n` positions of `layer`) into `out` (same shape), causal over what was appended.
    ///
    /// # Safety
    /// `q` and `out` must point to `n * q_heads * head_dim` f32 on this pool's device, valid
    /// until the queued work has run (order it with `ext`).
    pub unsafe fn attend_raw(
        &self,
        layer: usize,
        q: u64,
        n: usize,
        out: u64,
        scale: Option<f32>,
        ext: Option<ExternalStream>,
    ) -> CudaResult<()> {
        let cfg = &self.config;
        let l = self.layer(layer)?;
        if n == 0 || n > l.len {
            return Err(CacheError::Position {
                position: n,
                len: l.len,
            }
            .into());
        }
        let scale = scale.unwrap_or(1.0 / (cfg.head_dim as f32).sqrt());
        if !scale.is_finite() {
            return Err(CudaError::Rejected("attention scale is not finite".into()));
        }
        let pool = &self.pool;
        let s = &pool.stream;
        pool.after(ext)?;
        let (qh, kvh, d, gs) = (cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.group_size());
        let view = self.view(layer);
        let nb = cache_blocks(l.len, l.sealed);
        // Enough splits for two blocks per SM, none empty.
        let want = (2 * pool.sms).div_ceil(kvh * n).max(1);
        let per = nb.div_ceil(want.min(nb).max(1)).max(1);
        let splits = nb.div_ceil(per).max(1);
        let states = n * splits * qh;
        let pmax = s.alloc_zeros::<f32>(states)?;
        let psum = s.alloc_zeros::<f32>(states)?;
        let pacc = s.alloc_zeros::<f32>(states * d)?;
        let func = pool.kernels.attend(gs)?;
        let smem = (attend_shared_floats(gs, d) * 4) as u32;
        if smem > 48 * 1024 {
            func.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let (qh_i, base_i, per_i) = (qh as i32, (l.len - n) as i32, per as i32);
        let mut launch = s.launch_builder(func);
        launch
            .arg(&view)
            .arg(&q)
            .arg(&qh_i)
            .arg(&base_i)
            .arg(&scale)
            .arg(&per_i)
            .arg(&pmax)
            .arg(&psum)
            .arg(&pacc);
        // SAFETY: argument list matches `sj_attend_gs{gs}`; partial buffers hold
        // rows x splits x q_heads states; the view's buffers belong to this sequence.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (kvh as u32, splits as u32, n as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: smem,
            })
        }?;
        let (splits_i, d_i) = (splits as i32, d as i32);
        let mut merge = s.launch_builder(&pool.kernels.merge);
        merge
            .arg(&pmax)
            .arg(&psum)
            .arg(&pacc)
            .arg(&splits_i)
            .arg(&qh_i)
            .arg(&d_i)
            .arg(&out);
        // SAFETY: argument list matches `sj_attend_merge`; `out` is the caller's n x qh x d.
        unsafe {
            merge.launch(LaunchConfig {
                grid_dim: (n as u32, qh as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        pool.before(ext)?;
        Ok(())
    }

    /// [`attend_raw`](Self::attend_raw) from and to host memory.
    pub fn attend_host(&self, layer: usize, q: &[f32], scale: Option<f32>) -> CudaResult<Vec<f32>> {
        let per = self.config.q_heads * self.config.head_dim;
        if q.is_empty() || !q.len().is_multiple_of(per) {
            return Err(CacheError::Shape {
                what: "attend q",
                expected: format!(
                    "[tokens, {}, {}]",
                    self.config.q_heads, self.config.head_dim
                ),
                got: format!("{} values", q.len()),
            }
            .into());
        }
        crate::error::check_finite(q).map_err(CacheError::from)?;
        let s = self.pool.stream.clone();
        let qd = s.clone_htod(q)?;
        let out = s.alloc_zeros::<f32>(q.len())?;
        let (qp, op) = (dptr(&qd, &s), dptr(&out, &s));
        // SAFETY: qd and out hold n rows and outlive the queued work (copied back below).
        unsafe { self.attend_raw(layer, qp, q.len() / per, op, scale, None) }?;
        let out = s.clone_dtoh(&out)?;
        if out.iter().any(|x| !x.is_finite()) {
            let d = self.config.head_dim;
            let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
            return Err(crate::attention::score_overflow(q, d, scale).into());
        }
        Ok(out)
    }

    /// Keeps the first `n` tokens of every layer; returns the resume position as the CPU does
    /// (the journal rules decide both).
    pub fn truncate(&mut self, n: usize) -> CudaResult<usize> {
        let rules = self.config.rules();
        let mut reprocess = usize::MAX;
        let s = self.pool.stream.clone();
        for l in self.layers.iter_mut() {
            let (st, resume) = rules.truncate(l.state(), n);
            if st.sealed < l.sealed {
                let dropped = l.blocks.split_off(st.sealed);
                self.pool.slots.release(&dropped);
                upload_blocks(&s, l)?;
            }
            l.len = st.len;
            l.sealed = st.sealed;
            l.sealed_prev = st.sealed_prev;
            l.draining = st.draining;
            reprocess = reprocess.min(resume);
        }
        Ok(reprocess)
    }

    /// Allocated bytes per region and occupied bits per value (the CPU's accounting).
    pub fn memory(&self) -> MemoryReport {
        let bits = self.rows.bits_per_value();
        let lens: Vec<(usize, usize, f64)> = self
            .layers
            .iter()
            .map(|l| (l.len, l.sealed, bits))
            .collect();
        let ring = self.layers.iter().map(|l| l.ring.len()).sum();
        let slots: usize = self.layers.iter().map(|l| l.blocks.len()).sum();
        let slot = self.pool.slot_bytes();
        let in_use = self
            .layers
            .iter()
            .filter(|l| l.len > 0)
            .map(|l| (1, l.ring.len() + l.blocks.len() * slot))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        memory_report(&self.config, &lens, ring, slots * slot, in_use)
    }

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
                len: l.len,
                sealed: l.sealed,
                sealed_prev: l.sealed_prev,
                draining: l.draining,
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
            l.len = img.len;
            l.sealed = img.sealed;
            l.sealed_prev = img.sealed_prev;
            l.draining = img.draining;
            upload_blocks(&s, l)?;
        }
        s.synchronize()?;
        Ok(dev)
    }
}

/// What a failed append or seal must put back in one layer: its lengths, its block list and,
/// where the failed work may have overwritten live rows, a device copy of its ring.
struct LayerUndo {
    len: usize,
    sealed: usize,
    sealed_prev: usize,
    draining: bool,
    blocks: usize,
    ring: Option<CudaSlice<u8>>,
}

impl LayerUndo {
    fn take(l: &DeviceLayer, s: &Arc<CudaStream>, keep_ring: bool) -> CudaResult<Self> {
        Ok(Self {
            len: l.len,
            sealed: l.sealed,
            sealed_prev: l.sealed_prev,
            draining: l.draining,
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
    fn restore(self, l: &mut DeviceLayer, pool: &DevicePool) -> CudaResult<()> {
        let added = l.blocks.split_off(self.blocks);
        pool.slots.release(&added);
        l.len = self.len;
        l.sealed = self.sealed;
        l.sealed_prev = self.sealed_prev;
        l.draining = self.draining;
        if let Some(ring) = self.ring {
            pool.stream.memcpy_dtod(&ring, &mut l.ring)?;
        }
        Ok(())
    }
}

impl DeviceLayer {
    fn state(&self) -> LayerState {
        LayerState {
            len: self.len,
            sealed: self.sealed,
            sealed_prev: self.sealed_prev,
            draining: self.draining,
        }
    }
}

fn upload_blocks(s: &Arc<CudaStream>, l: &mut DeviceLayer) -> CudaResult<()> {
    if !l.blocks.is_empty() {
        let ids: Vec<u32> = l.blocks.clone();
        s.memcpy_htod(&ids, &mut l.blocks_dev.slice_mut(0..ids.len()))?;
    }
    Ok(())
}

/// `sj_cache_blocks`: sink, sealed groups, ring blocks of up to 128 positions.
fn cache_blocks(len: usize, sealed: usize) -> usize {
    if len == 0 {
        0
    } else if len <= SINK {
        1
    } else {
        let ring = len - (SINK + GROUP * sealed);
        1 + sealed + ring.div_ceil(GROUP)
    }
}
