//! The kernel launches of a device sequence: the layer view the kernels take, appends, seals
//! and attention, each checked against its status word before the bookkeeping moves on.

use super::super::CudaResult;
use super::*;
use crate::backend::cuda::pool::dptr;
use crate::backend::SlotId;
use crate::codec::{Body, ITERS};
use crate::error::CacheError;
use crate::journal::Chunk;
use crate::journal::SINK;
use crate::kernel_abi::{seal_workspace_bytes, KernelLayerView, KernelRecordLayout, STAGING_TQ6};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

impl DeviceSequence {
    /// The kernels' view of `layer`.
    pub(crate) fn view(&self, layer: usize) -> KernelLayerView {
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
            len: l.state.len as i32,
            sealed: l.state.sealed as i32,
            kv_heads: self.config.kv_heads as i32,
            head_dim: d as i32,
            ring_rows: self.config.ring_rows() as i32,
            row_bytes: self.rows.row_bytes() as i32,
            staging: STAGING_TQ6,
            pad: 0,
            rec: KernelRecordLayout::of(rec),
        }
    }

    /// Step 3 of [`append_raw`](Self::append_raw): runs the plan's seals (taking slots from the
    /// back of `slots`) and copies staged rows into the ring and the sink.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn execute_append(
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
            let from = self.layers[layer].state.sealed;
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
            l.state.sealed_prev = c.state.sealed_prev;
            l.state.draining = c.state.draining;
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
            l.state.len = hi;
            written += take;
        }
        Ok(())
    }

    /// Seals groups `from..to` of `layer` into `slots` (reserved, one per group).
    pub(crate) fn seal_groups(
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
            crate::backend::cpu::faults::check_record()?;
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
        l.state.sealed = to;
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
            return Err(crate::attention::output::score_overflow(q, d, scale).into());
        }
        Ok(out)
    }
}
