//! Appending rows to the ring, and the seals the journal's rules start: at the start of a
//! ubatch, or while the engine is idle. Every check and reservation comes before any change.

use super::alloc::zeroed_bytes;
use super::sequence::Sequence;
use crate::backend::cpu::exact_window::ExactWindow;
use crate::backend::pool::SlotId;
use crate::codec::extension::body::GROUP;
use crate::codec::fp16::f32_to_f16;
use crate::codec::rotation::rotate_heads;
use crate::error::check_finite;
use crate::error::{CacheError, CacheResult};
use crate::journal::auto_staging;
use crate::journal::Centring;
use crate::journal::LayerState;
use crate::journal::RingRows;
use half::f16;
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::Arc;

/// Staged rows of an append in progress: row `(pos - first) * kv_heads + head` (K, V).
#[derive(Clone, Copy)]
struct StagedRows<'a> {
    bytes: &'a [u8],
    first: usize,
}

impl Sequence {
    /// Appends `n` tokens of post-RoPE K and V (`[n][kv_heads][head_dim]`, model frame) to
    /// `layer`, sealing as the journal rule says. On error nothing changes.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> CacheResult<()> {
        self.append_frame(layer, k, v, false)
    }

    /// [`Sequence::append`] for rows already in the Hadamard frame (`rotated = true`), as the
    /// reference's `store` takes them.
    pub fn append_frame(
        &mut self,
        layer: usize,
        k: &[f32],
        v: &[f32],
        rotated: bool,
    ) -> CacheResult<()> {
        let cfg = self.config.clone();
        let (h, d, sink) = (cfg.kv_heads, cfg.head_dim, cfg.sink);
        let per_tok = h * d;
        let l = self.layer(layer)?;
        if !k.len().is_multiple_of(per_tok) || v.len() != k.len() {
            return Err(CacheError::Shape {
                what: "append k/v",
                expected: format!("[tokens, {h}, {d}] for both"),
                got: format!("{} and {} values", k.len(), v.len()),
            });
        }
        let n = k.len() / per_tok;
        if l.state.len + n > cfg.max_tokens {
            return Err(CacheError::TooLong {
                len: l.state.len,
                adding: n,
                max: cfg.max_tokens,
            });
        }
        check_finite(k)?;
        check_finite(v)?;
        let start = l.state.len;

        // 1. Rotate and stage every row first (the only codec step that can reject the input).
        // Rows already in the Hadamard frame are used in place; others are rotated in a copy.
        let (rk, rv): (Cow<[f32]>, Cow<[f32]>) = if rotated {
            (Cow::Borrowed(k), Cow::Borrowed(v))
        } else {
            let (mut rk, mut rv) = (k.to_vec(), v.to_vec());
            rotate_heads(&mut rk, d)?;
            rotate_heads(&mut rv, d)?;
            (Cow::Owned(rk), Cow::Owned(rv))
        };
        // `auto` staging picks on the layer's first rows; its ring is allocated here and only
        // installed at the commit below, so a refused append changes nothing.
        let mut picked = None;
        let rows = match cfg.auto_staging {
            Some(budget) if l.pick.is_none() => {
                let p = auto_staging::pick(&rk, &rv, h, d, budget);
                let rows = RingRows::new(p.k, p.v, d);
                let ring = zeroed_bytes(cfg.ring_bytes(rows), "staging ring")?;
                picked = Some((p, ring));
                rows
            }
            _ => l.rows,
        };
        // Sink rows of this append, fp16 as stored.
        let mut sink_k = Vec::new();
        let mut sink_v = Vec::new();
        for t in 0..n.min(sink.saturating_sub(start)) {
            for (dst, src, what) in [
                (&mut sink_k, &rk, "fp16 sink"),
                (&mut sink_v, &rv, "fp16 sink"),
            ] {
                for &xv in &src[t * per_tok..(t + 1) * per_tok] {
                    let hv = f16::from_f32(xv);
                    if !hv.is_finite() {
                        return Err(crate::CodecError::ScaleOverflow { what, value: xv }.into());
                    }
                    dst.push(hv);
                }
            }
        }
        // With centred keys, the append that completes the sink fixes the offset that every
        // later key is stored against.
        let new_centring = match &l.centring {
            None if cfg.centre_keys && start + n >= sink => {
                let mut full = l.sink_k[..start.min(sink) * per_tok].to_vec();
                full.extend_from_slice(&sink_k);
                Some(Centring::of_sink(&full, sink, h, d)?)
            }
            _ => None,
        };
        let key_mean = new_centring
            .as_ref()
            .or(l.centring.as_ref())
            .map(|c| c.mean.as_slice());
        let ring_tokens = (start + n).saturating_sub(sink.max(start));
        let mut staged = vec![0u8; ring_tokens * h * rows.entry_bytes()];
        let mut centred = vec![0.0f32; d];
        // The exact window's copies of this append's rows after the sink (keys as staged).
        let windowed = cfg.exact_recent > 0;
        let mut window_k = Vec::with_capacity(if windowed { ring_tokens * per_tok } else { 0 });
        for t in n - ring_tokens..n {
            let pos = start + t;
            for head in 0..h {
                let entry = (pos - sink.max(start)) * h + head;
                let at = (t * h + head) * d;
                let key = &rk[at..at + d];
                let key = match key_mean {
                    Some(mean) => {
                        for ((c, &x), &m) in centred.iter_mut().zip(key).zip(&mean[head * d..]) {
                            *c = x - m;
                        }
                        &centred[..]
                    }
                    None => key,
                };
                rows.side(false)
                    .encode(key, &mut staged[rows.range(entry, false)])?;
                if windowed {
                    window_k.extend_from_slice(key);
                }
                rows.side(true)
                    .encode(&rv[at..at + d], &mut staged[rows.range(entry, true)])?;
            }
        }

        let window_rows = if windowed {
            let values = &rv[(n - ring_tokens) * per_tok..];
            Some((
                ExactWindow::rounded(&window_k, "fp16 exact window")?,
                ExactWindow::rounded(values, "fp16 exact window")?,
            ))
        } else {
            None
        };

        // 2. Plan the ubatches and seals; reserve every slot they need up front.
        let plan = cfg.rules().plan_append(l.state(), n);
        let sealed = plan.last().map_or(l.state.sealed, |c| c.state.sealed);
        let needed = sealed - l.state.sealed;
        let mut slots = self.pool.reserve(needed)?.into_iter();

        // 3. Encode every record the plan seals before changing anything. A seal may need rows
        //    of this append (staged above, not yet in the ring), read from `staged`.
        let mut sealed_records = Vec::with_capacity(plan.len());
        let mut from = l.state.sealed;
        for c in &plan {
            let staged_rows = Some(StagedRows {
                bytes: &staged,
                first: sink.max(start),
            });
            match self.encode_groups(layer, from, c.state.sealed, staged_rows, rows) {
                Ok(records) => sealed_records.push(records),
                Err(e) => {
                    self.pool.release(&slots.collect::<Vec<_>>());
                    return Err(e);
                }
            }
            from = c.state.sealed;
        }

        // 4. Commit, ubatch by ubatch: seals then ring writes. Nothing below can fail.
        if let Some((p, ring)) = picked {
            let lj = &mut self.layers[layer];
            (lj.rows, lj.ring, lj.pick) = (rows, ring, Some(p));
        }
        let mut written = 0usize;
        for (c, records) in plan.into_iter().zip(sealed_records) {
            let from = self.layers[layer].state.sealed;
            if c.state.sealed > from {
                let ids: Vec<SlotId> = slots.by_ref().take(c.state.sealed - from).collect();
                self.commit_groups(layer, c.state.sealed, records, &ids);
            }
            self.layers[layer].set_state(c.state);
            for t in written..written + c.take {
                let pos = start + t;
                let lj = &mut self.layers[layer];
                if pos < sink {
                    let at = pos * per_tok;
                    let src = t * per_tok;
                    lj.sink_k[at..at + per_tok].copy_from_slice(&sink_k[src..src + per_tok]);
                    lj.sink_v[at..at + per_tok].copy_from_slice(&sink_v[src..src + per_tok]);
                } else {
                    let r = pos - sink.max(start);
                    for head in 0..h {
                        for value in [false, true] {
                            let src = rows.range(r * h + head, value);
                            let dst = self.ring_row_range(&self.layers[layer], pos, head, value);
                            let lj = &mut self.layers[layer];
                            lj.ring[dst].copy_from_slice(&staged[src]);
                        }
                    }
                }
                self.layers[layer].state.len = pos + 1;
            }
            written += c.take;
        }
        if let Some(c) = new_centring {
            self.layers[layer].centring = Some(c);
        }
        if let Some((wk, wv)) = window_rows {
            let w = &mut self.layers[layer].window;
            w.trim_for_append(start, cfg.exact_recent, per_tok);
            w.extend(&wk, &wv);
        }
        Ok(())
    }

    /// Encodes the records of groups `from..to` of `layer` (one `Vec` per group, all KV heads)
    /// without changing anything. Rows at positions from `staged.first` on come from `staged`
    /// (an append's rows, not yet in the ring), the rest from the ring.
    fn encode_groups(
        &self,
        layer: usize,
        from: usize,
        to: usize,
        staged: Option<StagedRows<'_>>,
        rows: RingRows,
    ) -> CacheResult<Vec<Vec<u8>>> {
        let cfg = &self.config;
        let codec = cfg.body_codec(layer)?;
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        let rb = codec.record_bytes();
        let lj = &self.layers[layer];
        let records: Vec<CacheResult<Vec<u8>>> = (from..to)
            .into_par_iter()
            .map(|g| {
                let mut slot = vec![0u8; h * rb];
                let (mut kt, mut vt) = (vec![0.0f32; GROUP * d], vec![0.0f32; GROUP * d]);
                let (mut k16, mut v16) = (vec![0u16; GROUP * d], vec![0u16; GROUP * d]);
                let mut sealer = codec.sealer();
                for head in 0..h {
                    crate::backend::cpu::faults::check_record()?;
                    for t in 0..GROUP {
                        let pos = cfg.sink + g * GROUP + t;
                        for (value, tile) in [(false, &mut kt), (true, &mut vt)] {
                            let out = &mut tile[t * d..(t + 1) * d];
                            match staged {
                                Some(s) if pos >= s.first => {
                                    let entry = (pos - s.first) * h + head;
                                    let bytes = &s.bytes[rows.range(entry, value)];
                                    rows.side(value).decode(bytes, out);
                                }
                                _ => self.ring_row(lj, pos, head, value, out),
                            }
                        }
                    }
                    // The seal input is the staged row as attention sees it, rounded to fp16.
                    for (dst, src) in [(&mut k16, &kt), (&mut v16, &vt)] {
                        for (o, &x) in dst.iter_mut().zip(src.iter()) {
                            *o = f32_to_f16(x);
                        }
                    }
                    let out = &mut slot[head * rb..(head + 1) * rb];
                    sealer.seal(&k16, &v16, out)?;
                }
                Ok(slot)
            })
            .collect();
        records.into_iter().collect()
    }

    /// Makes encoded records visible: fills the reserved `slots` and advances the block table.
    fn commit_groups(&mut self, layer: usize, to: usize, records: Vec<Vec<u8>>, slots: &[SlotId]) {
        for (bytes, &id) in records.into_iter().zip(slots) {
            self.pool.fill(id, Arc::from(bytes));
        }
        let lj = &mut self.layers[layer];
        lj.blocks.extend_from_slice(slots);
        lj.state.sealed = to;
    }

    /// The idle step: seals every layer back to `min_tail` unsealed tokens (between requests)
    /// but never the last `max(keep_recent, min_tail)` positions. Every record is encoded before
    /// any layer changes, so a failure leaves the sequence as it was.
    pub fn seal_idle(&mut self, keep_recent: usize) -> CacheResult<()> {
        let rules = self.config.rules();
        let plan: Vec<(usize, LayerState, LayerState)> = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| (i, l.state(), rules.idle(l.state(), keep_recent)))
            .collect();
        let slots = self
            .pool
            .reserve(plan.iter().map(|(_, a, b)| b.sealed - a.sealed).sum())?;
        let mut encoded = Vec::with_capacity(plan.len());
        for &(layer, from, to) in &plan {
            match self.encode_groups(layer, from.sealed, to.sealed, None, self.layers[layer].rows) {
                Ok(records) => encoded.push(records),
                Err(e) => {
                    self.pool.release(&slots);
                    return Err(e);
                }
            }
        }
        let mut slots = slots.into_iter();
        for ((layer, from, to), records) in plan.into_iter().zip(encoded) {
            let ids: Vec<SlotId> = slots.by_ref().take(to.sealed - from.sealed).collect();
            if to.sealed > from.sealed {
                self.commit_groups(layer, to.sealed, records, &ids);
            }
            self.layers[layer].set_state(to);
        }
        Ok(())
    }
}
