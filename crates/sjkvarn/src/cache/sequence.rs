//! One sequence's journal: per layer a fp16 sink, a staging ring and a block table of sealed
//! records in the shared pool.
//!
//! Positions `0..128` are the sink. Group `g` covers `[128 + 128g, 256 + 128g)`. Unsealed tokens
//! after the sink live in the ring. Before an append would take the unsealed span past
//! `max_tail`, every complete group older than the newest `min_tail` tokens is sealed in one
//! batch; long appends are split so this check runs between chunks. Every call validates and
//! reserves what it needs before it changes anything, so a failed call leaves the cache as it was.

use super::config::{CacheConfig, SINK};
use super::pool::{RecordPool, SlotId};
use super::staging::RowCodec;
use super::{CacheError, CacheResult};
use crate::body::GROUP;
use crate::error::check_finite;
use crate::hadamard::rotate_rows;
use half::f16;
use rayon::prelude::*;
use std::sync::Arc;

/// `n` copies of `value`, or an out-of-memory error instead of an abort.
fn zeroed<T: Clone>(n: usize, value: T, what: &'static str) -> CacheResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| CacheError::OutOfMemory {
            what,
            bytes: n.saturating_mul(std::mem::size_of::<T>()),
        })?;
    v.resize(n, value);
    Ok(v)
}

/// `n` zero bytes, fallibly and lazily zeroed by the allocator (untouched ring rows cost no
/// resident memory, as with `vec![0; n]`).
fn zeroed_bytes(n: usize, what: &'static str) -> CacheResult<Vec<u8>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let oom = || CacheError::OutOfMemory { what, bytes: n };
    let layout = std::alloc::Layout::array::<u8>(n).map_err(|_| oom())?;
    // SAFETY: the layout has a non-zero size (n > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `[u8; n]`, and all `n`
    // bytes are initialised (zeroed); the Vec takes ownership and frees it with that layout.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// Staged rows of an append in progress: row `(pos - first) * kv_heads + head` (K, V).
#[derive(Clone, Copy)]
struct StagedRows<'a> {
    bytes: &'a [u8],
    first: usize,
}

/// One layer's journal.
#[derive(Debug, Clone)]
pub(crate) struct LayerJournal {
    /// Tokens appended.
    pub(crate) len: usize,
    /// Sealed groups (each is one slot in `blocks`).
    pub(crate) sealed: usize,
    /// `[SINK][kv_heads][D]`, model frame.
    pub(crate) sink_k: Vec<f16>,
    pub(crate) sink_v: Vec<f16>,
    /// `[ring_rows][kv_heads][K, V][row_bytes]`.
    pub(crate) ring: Vec<u8>,
    pub(crate) blocks: Vec<SlotId>,
}

impl LayerJournal {
    /// First position held by the ring.
    pub(crate) fn ring_start(&self) -> usize {
        SINK + GROUP * self.sealed
    }
}

/// Bytes allocated and bits occupied, by region.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryReport {
    pub sink_bytes: usize,
    pub ring_bytes: usize,
    /// Pool bytes referenced by this sequence's block tables (shared slots count in full).
    pub body_bytes: usize,
    /// Length of layer 0.
    pub tokens: usize,
    /// Region occupancy in layer-tokens (summed over layers).
    pub sealed_tokens: usize,
    pub ring_tokens: usize,
    pub sink_tokens: usize,
    /// Occupied bits per cached value: `(body + ring + 16-bit sink) / values`.
    pub effective_bits: f64,
}

/// One layer's journal as plain bytes: what a device copy of the layer holds, and what crosses
/// between the CPU and a device backend. Records are in block order, one `slot_bytes` slot per
/// sealed group (the layer's records first, zero padding after).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerImage {
    pub len: usize,
    pub sealed: usize,
    /// `[SINK][kv_heads][head_dim]` fp16 bits, model frame.
    pub sink_k: Vec<u16>,
    pub sink_v: Vec<u16>,
    /// `[ring_rows][kv_heads][K, V][row_bytes]`.
    pub ring: Vec<u8>,
    /// `[sealed][slot_bytes]`.
    pub records: Vec<u8>,
}

/// A sequence: one journal per layer, sealed records in a shared pool.
#[derive(Debug)]
pub struct Sequence {
    pub(crate) config: Arc<CacheConfig>,
    pub(crate) pool: Arc<RecordPool>,
    pub(crate) rows: RowCodec,
    pub(crate) layers: Vec<LayerJournal>,
}

impl Drop for Sequence {
    fn drop(&mut self) {
        for l in &self.layers {
            self.pool.release(&l.blocks);
        }
    }
}

/// Sealed groups the journal rule gives a sequence of `len` tokens appended from empty: seals
/// run when the unsealed span is `max_tail` and one more token arrives. The journal state is a
/// function of the token history alone, which is what makes truncation exact.
pub fn sealed_groups_at(config: &CacheConfig, len: usize) -> usize {
    let mut sealed = 0usize;
    loop {
        let trigger = SINK + GROUP * sealed + config.max_tail;
        if trigger >= len {
            return sealed;
        }
        sealed = sealed.max((trigger - config.min_tail - SINK) / GROUP);
    }
}

/// The group index a seal at length `len` seals up to (exclusive).
pub fn seal_target(config: &CacheConfig, len: usize, sealed: usize) -> usize {
    sealed.max(len.saturating_sub(config.min_tail + SINK) / GROUP)
}

/// The chunks an append of `n` tokens at length `start` runs as: `(tokens, seal target before
/// the chunk)`. A seal runs before any chunk that would take the unsealed span past
/// `max_tail`; chunks are at most `max_chunk` long. Shared by every backend.
pub fn plan_append(
    config: &CacheConfig,
    start: usize,
    sealed: usize,
    n: usize,
) -> Vec<(usize, usize)> {
    let mut plan = Vec::new();
    let (mut len, mut sealed) = (start, sealed);
    while len < start + n {
        let unsealed = len.saturating_sub(SINK + GROUP * sealed);
        let sink_room = SINK.saturating_sub(len);
        let mut take = (start + n - len).min(config.max_chunk);
        let mut target = sealed;
        if take > sink_room && unsealed + (take - sink_room) > config.max_tail {
            target = seal_target(config, len, sealed);
            let after = len.saturating_sub(SINK + GROUP * target);
            take = take.min(config.max_tail - after + sink_room).max(1);
        }
        plan.push((take, target));
        sealed = target;
        len += take;
    }
    plan
}

/// Positions `(sink, body, ring)` of a layer with `len` tokens and `sealed` groups.
pub fn regions_at(len: usize, sealed: usize) -> [std::ops::Range<usize>; 3] {
    let sink_end = len.min(SINK);
    let body_end = if len <= SINK {
        sink_end
    } else {
        SINK + GROUP * sealed
    };
    [0..sink_end, sink_end..body_end, body_end..len]
}

/// Tokens the next append to a layer at `(len, sealed)` can take with no seal inside it.
pub fn chunk_limit_at(config: &CacheConfig, len: usize, sealed: usize) -> usize {
    let unsealed_now = len.saturating_sub(SINK + GROUP * sealed);
    let sealed = if unsealed_now + 1 > config.max_tail {
        seal_target(config, len, sealed)
    } else {
        sealed
    };
    let unsealed = len.saturating_sub(SINK + GROUP * sealed);
    let sink_room = SINK.saturating_sub(len);
    (config.max_tail - unsealed + sink_room)
        .min(config.max_chunk)
        .min(config.max_tokens - len)
}

/// The seals `seal_idle` runs: `(layer, from, to)` for every layer whose unsealed span exceeds
/// `min_tail` by at least one group, given each layer's `(len, sealed)`.
pub fn seal_idle_plan(
    config: &CacheConfig,
    layers: &[(usize, usize)],
) -> Vec<(usize, usize, usize)> {
    layers
        .iter()
        .enumerate()
        .filter_map(|(i, &(len, sealed))| {
            let to = seal_target(config, len, sealed);
            (to > sealed).then_some((i, sealed, to))
        })
        .collect()
}

/// `(len, sealed)` of a layer holding `len` tokens with `sealed` groups after `truncate(n)`.
pub fn truncated_state(
    config: &CacheConfig,
    len: usize,
    sealed: usize,
    n: usize,
) -> (usize, usize) {
    if n >= len {
        return (len, sealed);
    }
    let keep = sealed_groups_at(config, n);
    if keep < sealed {
        (n.min(SINK + GROUP * keep), keep)
    } else {
        (n, sealed)
    }
}

impl Sequence {
    /// A new, empty sequence whose sealed records go to `pool`.
    pub fn new(config: Arc<CacheConfig>, pool: Arc<RecordPool>) -> CacheResult<Self> {
        config.validate()?;
        if pool.slot_bytes() < config.slot_bytes() {
            return Err(CacheError::InvalidConfig(format!(
                "pool slots of {} bytes are smaller than this configuration's {} bytes",
                pool.slot_bytes(),
                config.slot_bytes()
            )));
        }
        let rows = RowCodec::new(config.staging, config.head_dim);
        let per_pos = config.kv_heads * config.head_dim;
        let ring = config.ring_rows() * config.kv_heads * 2 * rows.row_bytes();
        // Fallible allocation: a configuration too large for this machine is an error, never an
        // abort of the host process.
        let mut layers = Vec::new();
        layers
            .try_reserve_exact(config.layers)
            .map_err(|_| CacheError::OutOfMemory {
                what: "layer table",
                bytes: config.layers * std::mem::size_of::<LayerJournal>(),
            })?;
        for _ in 0..config.layers {
            layers.push(LayerJournal {
                len: 0,
                sealed: 0,
                sink_k: zeroed(SINK * per_pos, f16::ZERO, "fp16 sink")?,
                sink_v: zeroed(SINK * per_pos, f16::ZERO, "fp16 sink")?,
                ring: zeroed_bytes(ring, "staging ring")?,
                blocks: Vec::new(),
            });
        }
        Ok(Self {
            layers,
            config,
            pool,
            rows,
        })
    }

    /// A new pool sized for `sequences` sequences of this configuration at `max_tokens`.
    pub fn pool_for(config: &CacheConfig, sequences: usize) -> Arc<RecordPool> {
        RecordPool::new(
            config.slot_bytes(),
            config.slots_per_sequence() * sequences.max(1),
        )
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    pub fn pool(&self) -> &Arc<RecordPool> {
        &self.pool
    }

    pub(crate) fn layer(&self, layer: usize) -> CacheResult<&LayerJournal> {
        self.layers.get(layer).ok_or(CacheError::LayerOutOfRange {
            layer,
            layers: self.config.layers,
        })
    }

    /// Every pool slot this sequence's block tables reference, layer by layer.
    pub fn slots(&self) -> Vec<SlotId> {
        self.layers
            .iter()
            .flat_map(|l| l.blocks.iter().copied())
            .collect()
    }

    /// Tokens held by `layer`.
    pub fn len(&self, layer: usize) -> CacheResult<usize> {
        Ok(self.layer(layer)?.len)
    }

    /// Sealed groups of `layer`.
    pub fn sealed_groups(&self, layer: usize) -> CacheResult<usize> {
        Ok(self.layer(layer)?.sealed)
    }

    /// Positions `(sink, body, ring)` of `layer` as half-open ranges.
    pub fn regions(&self, layer: usize) -> CacheResult<[std::ops::Range<usize>; 3]> {
        let l = self.layer(layer)?;
        Ok(regions_at(l.len, l.sealed))
    }

    /// How many tokens the next append to `layer` can take with no seal inside it (a seal may
    /// still run at its start). Chunks of at most this size replay exactly like token-by-token
    /// decoding.
    pub fn chunk_limit(&self, layer: usize) -> CacheResult<usize> {
        let l = self.layer(layer)?;
        Ok(chunk_limit_at(&self.config, l.len, l.sealed))
    }

    fn ring_index(&self, pos: usize) -> usize {
        (pos - SINK) % self.config.ring_rows()
    }

    fn ring_row_range(&self, pos: usize, head: usize, value: bool) -> std::ops::Range<usize> {
        let rb = self.rows.row_bytes();
        let start =
            ((self.ring_index(pos) * self.config.kv_heads + head) * 2 + value as usize) * rb;
        start..start + rb
    }

    /// Decodes ring row `pos` of `head` (K or V) into `out`, in the staging frame.
    pub(crate) fn ring_row(
        &self,
        layer: &LayerJournal,
        pos: usize,
        head: usize,
        value: bool,
        out: &mut [f32],
    ) {
        self.rows
            .decode(&layer.ring[self.ring_row_range(pos, head, value)], out);
    }

    /// Appends `n` tokens of post-RoPE K and V (`[n][kv_heads][head_dim]`, model frame) to
    /// `layer`, sealing as the journal rule says. On error nothing changes.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> CacheResult<()> {
        let cfg = self.config.clone();
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        let per_tok = h * d;
        let l = self.layer(layer)?;
        if k.len() % per_tok != 0 || v.len() != k.len() {
            return Err(CacheError::Shape {
                what: "append k/v",
                expected: format!("[tokens, {h}, {d}] for both"),
                got: format!("{} and {} values", k.len(), v.len()),
            });
        }
        let n = k.len() / per_tok;
        if l.len + n > cfg.max_tokens {
            return Err(CacheError::TooLong {
                len: l.len,
                adding: n,
                max: cfg.max_tokens,
            });
        }
        check_finite(k)?;
        check_finite(v)?;
        let start = l.len;

        // 1. Stage every row first (the only codec step that can reject the input).
        let rb = self.rows.row_bytes();
        let mut sink_k = Vec::new();
        let mut sink_v = Vec::new();
        let ring_tokens = (start + n).saturating_sub(SINK.max(start));
        let mut staged = vec![0u8; ring_tokens * h * 2 * rb];
        let mut rot = vec![0.0f32; d];
        for t in 0..n {
            let pos = start + t;
            for head in 0..h {
                for (value, src) in [(false, k), (true, v)] {
                    let x = &src[(t * h + head) * d..(t * h + head + 1) * d];
                    if pos < SINK {
                        let dst = if value { &mut sink_v } else { &mut sink_k };
                        for &xv in x {
                            let hv = f16::from_f32(xv);
                            if !hv.is_finite() {
                                return Err(crate::CodecError::ScaleOverflow {
                                    what: "fp16 sink",
                                    value: xv,
                                }
                                .into());
                            }
                            dst.push(hv);
                        }
                    } else {
                        rot.copy_from_slice(x);
                        if self.rows.rotated() {
                            rotate_rows(&mut rot, d)?;
                        }
                        let row = ((pos - SINK.max(start)) * h + head) * 2 + value as usize;
                        self.rows
                            .encode(&rot, &mut staged[row * rb..(row + 1) * rb])?;
                    }
                }
            }
        }

        // 2. Plan the chunks and seals; reserve every slot they need up front.
        let plan = plan_append(&cfg, start, l.sealed, n);
        let sealed = plan.last().map_or(l.sealed, |&(_, target)| target);
        let needed = sealed - l.sealed;
        let mut slots = self.pool.reserve(needed)?.into_iter();

        // 3. Encode every record the plan seals before changing anything. A seal may need rows
        //    of this append (staged above, not yet in the ring), read from `staged`.
        let mut sealed_records = Vec::with_capacity(plan.len());
        let mut from = l.sealed;
        for &(_, target) in &plan {
            let staged_rows = Some(StagedRows {
                bytes: &staged,
                first: SINK.max(start),
            });
            match self.encode_groups(layer, from, target, staged_rows) {
                Ok(records) => sealed_records.push(records),
                Err(e) => {
                    self.pool.release(&slots.collect::<Vec<_>>());
                    return Err(e);
                }
            }
            from = target;
        }

        // 4. Commit, chunk by chunk: seals then ring writes. Nothing below can fail.
        let mut written = 0usize;
        for ((take, target), records) in plan.into_iter().zip(sealed_records) {
            let from = self.layers[layer].sealed;
            if target > from {
                let ids: Vec<SlotId> = slots.by_ref().take(target - from).collect();
                self.commit_groups(layer, target, records, &ids);
            }
            for t in written..written + take {
                let pos = start + t;
                let lj = &mut self.layers[layer];
                if pos < SINK {
                    let at = pos * per_tok;
                    let src = t * per_tok;
                    lj.sink_k[at..at + per_tok].copy_from_slice(&sink_k[src..src + per_tok]);
                    lj.sink_v[at..at + per_tok].copy_from_slice(&sink_v[src..src + per_tok]);
                } else {
                    let r = pos - SINK.max(start);
                    for head in 0..h {
                        for value in [false, true] {
                            let row = (r * h + head) * 2 + value as usize;
                            let dst = self.ring_row_range(pos, head, value);
                            let lj = &mut self.layers[layer];
                            lj.ring[dst].copy_from_slice(&staged[row * rb..(row + 1) * rb]);
                        }
                    }
                }
                self.layers[layer].len = pos + 1;
            }
            written += take;
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
    ) -> CacheResult<Vec<Vec<u8>>> {
        let cfg = &self.config;
        let spec = cfg.body_spec(layer);
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        let rb = spec.record_bytes();
        let row_bytes = self.rows.row_bytes();
        let lj = &self.layers[layer];
        let records: Vec<CacheResult<Vec<u8>>> = (from..to)
            .into_par_iter()
            .map(|g| {
                let mut slot = vec![0u8; h * rb];
                let (mut kt, mut vt) = (vec![0.0f32; GROUP * d], vec![0.0f32; GROUP * d]);
                for head in 0..h {
                    super::faults::check_record()?;
                    for t in 0..GROUP {
                        let pos = SINK + g * GROUP + t;
                        for (value, tile) in [(false, &mut kt), (true, &mut vt)] {
                            let out = &mut tile[t * d..(t + 1) * d];
                            match staged {
                                Some(s) if pos >= s.first => {
                                    let row = ((pos - s.first) * h + head) * 2 + value as usize;
                                    let bytes = &s.bytes[row * row_bytes..(row + 1) * row_bytes];
                                    self.rows.decode(bytes, out);
                                }
                                _ => self.ring_row(lj, pos, head, value, out),
                            }
                        }
                    }
                    if !self.rows.rotated() {
                        rotate_rows(&mut kt, d)?;
                        rotate_rows(&mut vt, d)?;
                    }
                    let out = &mut slot[head * rb..(head + 1) * rb];
                    match cfg.key_schedule(layer, head) {
                        Some(s) => {
                            crate::gtq::encode_record(&spec, s, &kt, &vt, &cfg.balance, out)?
                        }
                        None => spec.encode_rotated(&kt, &vt, &cfg.balance, out)?,
                    }
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
        lj.sealed = to;
    }

    /// Seals every layer back to `min_tail` unsealed tokens (between requests). Every record is
    /// encoded before any layer changes, so a failure leaves the sequence as it was.
    pub fn seal_idle(&mut self) -> CacheResult<()> {
        let lens: Vec<(usize, usize)> = self.layers.iter().map(|l| (l.len, l.sealed)).collect();
        let plan = seal_idle_plan(&self.config, &lens);
        let slots = self.pool.reserve(plan.iter().map(|p| p.2 - p.1).sum())?;
        let mut encoded = Vec::with_capacity(plan.len());
        for &(layer, from, to) in &plan {
            match self.encode_groups(layer, from, to, None) {
                Ok(records) => encoded.push(records),
                Err(e) => {
                    self.pool.release(&slots);
                    return Err(e);
                }
            }
        }
        let mut slots = slots.into_iter();
        for ((layer, from, to), records) in plan.into_iter().zip(encoded) {
            let ids: Vec<SlotId> = slots.by_ref().take(to - from).collect();
            self.commit_groups(layer, to, records, &ids);
        }
        Ok(())
    }

    /// Keeps the first `n` tokens of every layer and returns `reprocess_from`: the position
    /// from which the caller must append K/V again (`n` when nothing sealed had to go).
    ///
    /// The result is exactly the state a sequence of `n` tokens has, so re-appending gives the
    /// same bytes as never having appended the removed tokens. It is free when no seal ran after
    /// position `n` (rejected speculative tokens in the ring); otherwise the groups the seal
    /// rule would not yet have sealed are dropped and `reprocess_from` is the first one's start.
    pub fn truncate(&mut self, n: usize) -> CacheResult<usize> {
        let mut reprocess = n;
        for l in self.layers.iter_mut() {
            if n >= l.len {
                continue;
            }
            let (len, sealed) = truncated_state(&self.config, l.len, l.sealed, n);
            if sealed < l.sealed {
                let dropped: Vec<SlotId> = l.blocks.split_off(sealed);
                self.pool.release(&dropped);
                l.sealed = sealed;
            }
            l.len = len;
            reprocess = reprocess.min(l.len);
        }
        Ok(reprocess)
    }

    /// A child sequence sharing this one's sealed records (reference counted) and owning copies
    /// of its sink and ring.
    pub fn fork(&self) -> Sequence {
        for l in &self.layers {
            self.pool.retain(&l.blocks);
        }
        Sequence {
            config: self.config.clone(),
            pool: self.pool.clone(),
            rows: self.rows,
            layers: self.layers.clone(),
        }
    }

    /// The bytes of `layer` (see [`LayerImage`]).
    pub fn layer_image(&self, layer: usize) -> CacheResult<LayerImage> {
        let l = self.layer(layer)?;
        let slot = self.config.slot_bytes();
        let mut records = vec![0u8; l.blocks.len() * slot];
        for (dst, &id) in records.chunks_exact_mut(slot).zip(&l.blocks) {
            let bytes = self.pool.get(id);
            dst[..bytes.len()].copy_from_slice(&bytes);
        }
        Ok(LayerImage {
            len: l.len,
            sealed: l.sealed,
            sink_k: l.sink_k.iter().map(|h| h.to_bits()).collect(),
            sink_v: l.sink_v.iter().map(|h| h.to_bits()).collect(),
            ring: l.ring.clone(),
            records,
        })
    }

    /// A sequence holding exactly these layer images (for example copied back from a device).
    /// Every image is checked against the configuration first (sizes, sealed groups within the
    /// length, unsealed tokens within the ring).
    pub fn from_images(
        config: Arc<CacheConfig>,
        pool: Arc<RecordPool>,
        images: &[LayerImage],
    ) -> CacheResult<Self> {
        let mut seq = Sequence::new(config.clone(), pool)?;
        if images.len() != config.layers {
            return Err(CacheError::InvalidConfig(format!(
                "{} layer images for {} layers",
                images.len(),
                config.layers
            )));
        }
        let slot = config.slot_bytes();
        for (i, img) in images.iter().enumerate() {
            let l = &seq.layers[i];
            let body_end = SINK + GROUP * img.sealed;
            let bad = img.len > config.max_tokens
                || (img.sealed > 0 && body_end > img.len)
                || img.len.saturating_sub(body_end.max(SINK)) > config.ring_rows()
                || img.sink_k.len() != l.sink_k.len()
                || img.sink_v.len() != l.sink_v.len()
                || img.ring.len() != l.ring.len()
                || img.records.len() != img.sealed * slot;
            if bad {
                return Err(CacheError::InvalidConfig(format!(
                    "layer {i} image does not match the configuration (len {}, sealed {})",
                    img.len, img.sealed
                )));
            }
        }
        let total: usize = images.iter().map(|img| img.sealed).sum();
        let mut slots = seq.pool.reserve(total)?.into_iter();
        for (i, img) in images.iter().enumerate() {
            let rb = config.kv_heads * config.body_spec(i).record_bytes();
            let l = &mut seq.layers[i];
            l.len = img.len;
            l.sealed = img.sealed;
            l.sink_k = img.sink_k.iter().map(|&b| f16::from_bits(b)).collect();
            l.sink_v = img.sink_v.iter().map(|&b| f16::from_bits(b)).collect();
            l.ring.copy_from_slice(&img.ring);
            for rec in img.records.chunks_exact(slot) {
                let id = slots.next().expect("reserved one slot per sealed group");
                seq.pool.fill(id, Arc::from(&rec[..rb]));
                l.blocks.push(id);
            }
        }
        Ok(seq)
    }

    /// Allocated bytes per region and occupied effective bits per value.
    pub fn memory(&self) -> MemoryReport {
        let lens: Vec<(usize, usize)> = self.layers.iter().map(|l| (l.len, l.sealed)).collect();
        let ring_bytes = self.layers.iter().map(|l| l.ring.len()).sum();
        let slots: usize = self.layers.iter().map(|l| l.blocks.len()).sum();
        memory_report(
            &self.config,
            &lens,
            ring_bytes,
            slots * self.pool.slot_bytes(),
        )
    }
}

/// The memory report of a journal whose layers hold `(len, sealed)` (any backend).
pub fn memory_report(
    cfg: &CacheConfig,
    layers: &[(usize, usize)],
    ring_bytes: usize,
    body_bytes: usize,
) -> MemoryReport {
    let rows = RowCodec::new(cfg.staging, cfg.head_dim);
    let per_pos_values = cfg.kv_heads * cfg.head_dim * 2;
    let sink_bytes = cfg.layers * SINK * per_pos_values * 2;
    let (mut bits, mut values) = (0.0f64, 0.0f64);
    let (mut sealed_tokens, mut ring_tokens, mut sink_tokens) = (0, 0, 0);
    for (i, &(len, sealed)) in layers.iter().enumerate() {
        let spec = cfg.body_spec(i);
        let sink = len.min(SINK);
        let body = sealed * GROUP;
        let ring = len - sink - body;
        bits += sink as f64 * 16.0
            + body as f64 * spec.bits_per_value()
            + ring as f64 * rows.bits_per_value();
        values += len as f64;
        sealed_tokens += body;
        ring_tokens += ring;
        sink_tokens += sink;
    }
    MemoryReport {
        sink_bytes,
        ring_bytes,
        body_bytes,
        tokens: layers.first().map_or(0, |l| l.0),
        sealed_tokens,
        ring_tokens,
        sink_tokens,
        effective_bits: if values > 0.0 { bits / values } else { 0.0 },
    }
}
