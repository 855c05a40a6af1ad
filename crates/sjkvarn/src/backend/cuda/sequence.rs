//! A sequence whose journal bytes live in device memory. The journal rule, planning and
//! accounting are the CPU's own functions ([`plan_append`], [`truncated_state`],
//! [`memory_report`]); only the bytes and the kernels differ.
//!
//! Ordering: every sequence of a [`DevicePool`] runs on the pool's stream, so seals, ring writes
//! and attention of sequences sharing records are ordered. Callers that produce inputs or read
//! outputs on another stream (torch's current stream) pass it as [`ExternalStream`]: sjkvarn's
//! stream waits for an event recorded on it before reading the inputs, and it waits for an event
//! recorded on sjkvarn's stream before it may read the outputs.

use super::{CudaError, CudaResult};
use crate::backend::cpu::sequence::{memory_report, MemoryReport};
use crate::backend::cuda::pool::{dptr, DevicePool, ExternalStream};
use crate::backend::SlotId;
use crate::codec::{Body, RecordLayout};
use crate::error::CacheError;
use crate::journal::capability::{self, Backend};
use crate::journal::LayerState;
use crate::journal::RowCodec;
use crate::journal::{CacheConfig, SINK};
use crate::kernel_abi::{attend_shared_floats, device_layout, STAGING_TQ6};
use crate::GROUP;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::sync::Arc;

mod host;
mod launch;
mod layer;
mod undo;

use layer::{cache_blocks, upload_blocks, DeviceLayer};
use undo::LayerUndo;

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
    /// An empty sequence on the pool's device. What the device path runs is the capability
    /// table's `cuda` row (and query groups with a kernel); anything else is refused here, up
    /// front.
    pub fn new(config: Arc<CacheConfig>, pool: Arc<DevicePool>) -> CudaResult<Self> {
        config.validate()?;
        capability::check(Backend::Cuda, &config)?;
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
                    state: LayerState::default(),
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

    /// The journal bookkeeping of `layer`.
    pub(crate) fn layer_state(&self, layer: usize) -> CudaResult<LayerState> {
        Ok(self.layer(layer)?.state())
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
                    state: l.state,
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
        let start = self.layer(layer)?.state.len;
        let sealed0 = self.layers[layer].state.sealed;
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
            .filter(|(_, (l, st))| st.sealed > l.state.sealed)
            .map(|(i, (l, st))| (i, l.state.sealed, st.sealed))
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
            l.state.sealed_prev = st.sealed_prev;
            l.state.draining = st.draining;
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
        if n == 0 || n > l.state.len {
            return Err(CacheError::Position {
                position: n,
                len: l.state.len,
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
        let nb = cache_blocks(l.state.len, l.state.sealed);
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
        let (qh_i, base_i, per_i) = (qh as i32, (l.state.len - n) as i32, per as i32);
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

    /// Keeps the first `n` tokens of every layer; returns the resume position as the CPU does
    /// (the journal rules decide both).
    pub fn truncate(&mut self, n: usize) -> CudaResult<usize> {
        let rules = self.config.rules();
        let mut reprocess = usize::MAX;
        let s = self.pool.stream.clone();
        for l in self.layers.iter_mut() {
            let (st, resume) = rules.truncate(l.state(), n);
            if st.sealed < l.state.sealed {
                let dropped = l.blocks.split_off(st.sealed);
                self.pool.slots.release(&dropped);
                upload_blocks(&s, l)?;
            }
            l.state = st;
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
            .map(|l| (l.state.len, l.state.sealed, bits))
            .collect();
        let ring = self.layers.iter().map(|l| l.ring.len()).sum();
        let slots: usize = self.layers.iter().map(|l| l.blocks.len()).sum();
        let slot = self.pool.slot_bytes();
        let in_use = self
            .layers
            .iter()
            .filter(|l| l.state.len > 0)
            .map(|l| (1, l.ring.len() + l.blocks.len() * slot))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        memory_report(&self.config, &lens, ring, slots * slot, in_use)
    }
}
