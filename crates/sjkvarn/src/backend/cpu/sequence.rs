//! One sequence's journal: per layer a rotated fp16 sink, a staging ring and a block table of
//! sealed records in the shared pool.
//!
//! Positions `0..128` are the sink. Group `g` covers `[128 + 128g, 256 + 128g)`. Unsealed tokens
//! after the sink live in the ring. Every decision about sealing and truncation comes from the
//! journal rules ([`crate::journal::Rules`]): an append of `n` tokens runs as ubatches of at most
//! `max_chunk`, and at the start of each, once the unsealed span has reached `max_tail`, every
//! complete group older than the newest `min_tail` tokens is sealed in one batch. Every call
//! validates and reserves what it needs before it changes anything, so a failed call leaves the
//! cache as it was.

use super::auto_staging::{self, StagingPick};
use super::config::CacheConfig;
use super::exact_window::ExactWindow;
use super::pool::{RecordPool, SlotId};
use super::staging::RingRows;
use super::{CacheError, CacheResult};
use crate::codec::extension::body::GROUP;
use crate::codec::fp16::f32_to_f16;
use crate::codec::rotation::rotate_heads;
use crate::error::check_finite;
use crate::journal::LayerState;
use crate::simd::prefetch_l2;
use half::f16;
use rayon::prelude::*;
use std::borrow::Cow;
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
    advise_huge_pages(ptr, n);
    // SAFETY: `ptr` comes from the global allocator with the layout of `[u8; n]`, and all `n`
    // bytes are initialised (zeroed); the Vec takes ownership and frees it with that layout.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// Asks Linux to back the whole 2 MiB pages inside a large, not yet touched allocation with
/// transparent huge pages (a hint; nothing changes if the kernel declines). Attention reads
/// one KV head's ring rows a whole position apart, a new 4 KiB page every few rows: with
/// small pages nearly every page costs a TLB miss, and a page walk is dear in a VM.
fn advise_huge_pages(ptr: *mut u8, n: usize) {
    const HUGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    if n >= 2 * HUGE {
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize + n) / HUGE * HUGE;
        if end > start {
            // SAFETY: `[start, end)` lies inside the allocation of `n` bytes at `ptr`, which
            // this process owns; MADV_HUGEPAGE changes no contents and no access rights.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    let _ = (ptr, n, HUGE);
}

/// A zeroed ring of `n` bytes (see [`zeroed_bytes`]).
pub(crate) fn zeroed_ring(n: usize) -> CacheResult<Vec<u8>> {
    zeroed_bytes(n, "staging ring")
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
    /// Sealed groups before the last journal step, and whether a chunked flush is unfinished
    /// (journal state the `SJKVSEQ` stream carries).
    pub(crate) sealed_prev: usize,
    pub(crate) draining: bool,
    /// `[sink][kv_heads][D]`, rotated frame.
    pub(crate) sink_k: Vec<f16>,
    pub(crate) sink_v: Vec<f16>,
    /// `[ring_rows][kv_heads][K row, V row]` (see [`RingRows`]); empty while `auto` staging
    /// has not picked yet.
    pub(crate) ring: Vec<u8>,
    pub(crate) blocks: Vec<SlotId>,
    /// How this layer's ring rows are stored.
    pub(crate) rows: RingRows,
    /// What `auto` staging measured and picked (`None` for a fixed staging, or before the
    /// layer's first append).
    pub(crate) pick: Option<StagingPick>,
    /// With centred keys and a complete sink: the sink's mean key per KV head
    /// (`[kv_heads][D]`, rotated frame) and the sink's keys minus it, which attention scores.
    /// Derived from `sink_k`, which keeps the keys as appended (what states store).
    pub(crate) centring: Option<Centring>,
    /// The fp16 copies of the newest rows (empty unless `exact_recent` is set).
    pub(crate) window: ExactWindow,
}

/// The key offset of a layer whose keys are centred ([`CacheConfig::centre_keys`]).
#[derive(Debug, Clone)]
pub(crate) struct Centring {
    pub(crate) mean: Vec<f32>,
    pub(crate) sink_k: Vec<f16>,
}

impl Centring {
    /// The offset of a complete sink `sink_k` (`[sink][kv_heads][d]`, as appended): per head
    /// the mean of positions `1..sink` (position 0 is an outlier key in most models), and the
    /// sink's keys minus it. Depends on the stored sink alone, so a restored state recomputes
    /// the same offset bit for bit.
    pub(crate) fn of_sink(sink_k: &[f16], sink: usize, h: usize, d: usize) -> CacheResult<Self> {
        let mut sum = vec![0.0f64; h * d];
        for row in sink_k.chunks_exact(h * d).take(sink).skip(1) {
            for (acc, x) in sum.iter_mut().zip(row) {
                *acc += x.to_f64();
            }
        }
        let count = (sink - 1) as f64;
        let mean: Vec<f32> = sum.iter().map(|s| (s / count) as f32).collect();
        let mut centred = Vec::with_capacity(sink_k.len());
        for row in sink_k.chunks_exact(h * d) {
            for (x, m) in row.iter().zip(&mean) {
                let c = x.to_f32() - m;
                let hv = f16::from_f32(c);
                if !hv.is_finite() {
                    return Err(crate::CodecError::ScaleOverflow {
                        what: "centred fp16 sink",
                        value: c,
                    }
                    .into());
                }
                centred.push(hv);
            }
        }
        Ok(Self {
            mean,
            sink_k: centred,
        })
    }
}

impl LayerJournal {
    /// First position held by the ring of a cache whose sink is `sink` positions.
    pub(crate) fn ring_start(&self, sink: usize) -> usize {
        sink + GROUP * self.sealed
    }

    pub(crate) fn state(&self) -> LayerState {
        LayerState {
            len: self.len,
            sealed: self.sealed,
            sealed_prev: self.sealed_prev,
            draining: self.draining,
        }
    }

    /// The sink keys attention scores: centred once the offset is known, else as appended.
    pub(crate) fn scored_sink_k(&self) -> &[f16] {
        match &self.centring {
            Some(c) => &c.sink_k,
            None => &self.sink_k,
        }
    }

    /// Recomputes the key offset from the stored sink (after a restore or a truncation): set
    /// while the sink is complete, cleared below it (a later append refills the sink and fixes
    /// a new offset before any key after the sink is stored).
    pub(crate) fn refresh_centring(&mut self, cfg: &CacheConfig) -> CacheResult<()> {
        self.centring = if cfg.centre_keys && self.len >= cfg.sink {
            Some(Centring::of_sink(
                &self.sink_k,
                cfg.sink,
                cfg.kv_heads,
                cfg.head_dim,
            )?)
        } else {
            None
        };
        Ok(())
    }

    /// Takes over `st`'s counters (the block table is the caller's business).
    pub(crate) fn set_state(&mut self, st: LayerState) {
        self.len = st.len;
        self.sealed = st.sealed;
        self.sealed_prev = st.sealed_prev;
        self.draining = st.draining;
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
    /// Layers that hold tokens, and their allocated bytes (sink, ring, records): what the
    /// cache costs a hybrid model whose other layers never append here.
    pub in_use_layers: usize,
    pub in_use_bytes: usize,
}

/// One layer's journal as plain bytes: what a device copy of the layer holds, and what crosses
/// between the CPU and a device backend. Records are in block order, one `slot_bytes` slot per
/// sealed group (the layer's records first, zero padding after).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerImage {
    pub len: usize,
    pub sealed: usize,
    pub sealed_prev: usize,
    pub draining: bool,
    /// `[sink][kv_heads][head_dim]` fp16 bits, rotated frame.
    pub sink_k: Vec<u16>,
    pub sink_v: Vec<u16>,
    /// `[ring_rows][kv_heads][K, V][row_bytes]`.
    pub ring: Vec<u8>,
    /// `[sealed][slot_bytes]`.
    pub records: Vec<u8>,
}

/// Ring rows of one layer and KV head from a first position on ([`Sequence::ring_cursor`]):
/// the same rows [`Sequence::ring_row`] and [`Sequence::prefetch_ring`] give.
pub(crate) struct RingCursor<'a> {
    layer: &'a LayerJournal,
    first: usize,
    first_row: usize,
    rows: usize,
    kv_heads: usize,
    head: usize,
}

impl RingCursor<'_> {
    /// The ring entry of position `pos >= first`.
    #[inline(always)]
    fn entry(&self, pos: usize) -> usize {
        let mut row = self.first_row + (pos - self.first);
        while row >= self.rows {
            row -= self.rows;
        }
        row * self.kv_heads + self.head
    }

    /// Decodes ring row `pos` (K or V) into `out`, in the staging frame.
    #[inline(always)]
    pub(crate) fn row(&self, pos: usize, value: bool, out: &mut [f32]) {
        let rows = &self.layer.rows;
        let range = rows.range(self.entry(pos), value);
        rows.side(value).decode(&self.layer.ring[range], out);
    }

    /// The ring entry of position `pos`: its K row, then its V row.
    #[inline(always)]
    pub(crate) fn entry_bytes(&self, pos: usize) -> &[u8] {
        let rows = &self.layer.rows;
        let entry = self.entry(pos);
        let (k, v) = (rows.range(entry, false), rows.range(entry, true));
        &self.layer.ring[k.start..v.end]
    }

    /// Hints the cache to fetch position `pos` (its K and V rows are adjacent): ring rows of
    /// one head are a whole token apart, too far apart for the hardware's own stride prefetch
    /// to keep up, so the attention loop asks a few positions ahead.
    #[inline(always)]
    pub(crate) fn prefetch(&self, pos: usize) {
        let (rows, entry) = (&self.layer.rows, self.entry(pos));
        let (k, v) = (rows.range(entry, false), rows.range(entry, true));
        prefetch_l2(&self.layer.ring[k.start..v.end]);
    }
}

/// A sequence: one journal per layer, sealed records in a shared pool.
#[derive(Debug)]
pub struct Sequence {
    pub(crate) config: Arc<CacheConfig>,
    pub(crate) pool: Arc<RecordPool>,
    pub(crate) layers: Vec<LayerJournal>,
}

impl Drop for Sequence {
    fn drop(&mut self) {
        for l in &self.layers {
            self.pool.release(&l.blocks);
        }
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
        let rows = RingRows::new(config.k_staging, config.v_staging, config.head_dim);
        let per_pos = config.kv_heads * config.head_dim;
        // An `auto` ring is allocated when its layer picks (its first append).
        let ring = match config.auto_staging {
            Some(_) => 0,
            None => config.ring_bytes(rows),
        };
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
                sealed_prev: 0,
                draining: false,
                sink_k: zeroed(config.sink * per_pos, f16::ZERO, "fp16 sink")?,
                sink_v: zeroed(config.sink * per_pos, f16::ZERO, "fp16 sink")?,
                ring: zeroed_bytes(ring, "staging ring")?,
                blocks: Vec::new(),
                rows,
                pick: None,
                centring: None,
                window: ExactWindow::new(config.sink),
            });
        }
        Ok(Self {
            layers,
            config,
            pool,
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
        Ok(self.config.rules().regions(&l.state()))
    }

    /// How many tokens the next append to `layer` runs as one ubatch (a seal can only run at
    /// its start).
    pub fn chunk_limit(&self, layer: usize) -> CacheResult<usize> {
        let l = self.layer(layer)?;
        Ok(self.config.rules().chunk_limit(&l.state()))
    }

    #[inline(always)]
    fn ring_index(&self, pos: usize) -> usize {
        (pos - self.config.sink) % self.config.ring_rows()
    }

    #[inline(always)]
    fn ring_row_range(
        &self,
        layer: &LayerJournal,
        pos: usize,
        head: usize,
        value: bool,
    ) -> std::ops::Range<usize> {
        let entry = self.ring_index(pos) * self.config.kv_heads + head;
        layer.rows.range(entry, value)
    }

    /// What `auto` staging picked for `layer` (`None`: fixed staging, or nothing appended yet).
    pub fn staging_pick(&self, layer: usize) -> CacheResult<Option<&StagingPick>> {
        Ok(self.layer(layer)?.pick.as_ref())
    }

    /// The ring rows of `head` from position `first` on, addressed by counting from `first`'s
    /// row instead of a division per row (attention reads thousands of rows per call).
    pub(crate) fn ring_cursor<'a>(
        &self,
        layer: &'a LayerJournal,
        first: usize,
        head: usize,
    ) -> RingCursor<'a> {
        RingCursor {
            layer,
            first,
            first_row: self.ring_index(first),
            rows: self.config.ring_rows(),
            kv_heads: self.config.kv_heads,
            head,
        }
    }

    /// Decodes ring row `pos` of `head` (K or V) into `out`, in the staging frame.
    #[inline(always)]
    pub(crate) fn ring_row(
        &self,
        layer: &LayerJournal,
        pos: usize,
        head: usize,
        value: bool,
        out: &mut [f32],
    ) {
        layer.rows.side(value).decode(
            &layer.ring[self.ring_row_range(layer, pos, head, value)],
            out,
        );
    }

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
        let sealed = plan.last().map_or(l.sealed, |c| c.state.sealed);
        let needed = sealed - l.sealed;
        let mut slots = self.pool.reserve(needed)?.into_iter();

        // 3. Encode every record the plan seals before changing anything. A seal may need rows
        //    of this append (staged above, not yet in the ring), read from `staged`.
        let mut sealed_records = Vec::with_capacity(plan.len());
        let mut from = l.sealed;
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
            let from = self.layers[layer].sealed;
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
                self.layers[layer].len = pos + 1;
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
                    super::faults::check_record()?;
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
        lj.sealed = to;
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

    /// Keeps the first `n` tokens of every layer and returns the position from which the caller
    /// must append K/V again: `n` for a cut in the ring or the sink (free and exact), the group
    /// floor `128 + 128 * floor((n - 128) / 128)` for a cut in the body (at most 127 tokens to
    /// re-run; the sealed groups from there on are dropped, the kept ones are untouched), and
    /// the length when `n` is at or past it.
    pub fn truncate(&mut self, n: usize) -> CacheResult<usize> {
        let rules = self.config.rules();
        let mut reprocess = usize::MAX;
        for l in self.layers.iter_mut() {
            let (st, resume) = rules.truncate(l.state(), n);
            if st.sealed < l.sealed {
                let dropped: Vec<SlotId> = l.blocks.split_off(st.sealed);
                self.pool.release(&dropped);
            }
            l.set_state(st);
            if l.len < self.config.sink {
                l.centring = None;
            }
            let per_pos = self.config.kv_heads * self.config.head_dim;
            l.window.truncate(l.len, self.config.sink, per_pos);
            reprocess = reprocess.min(resume);
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
            sealed_prev: l.sealed_prev,
            draining: l.draining,
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
            let body_end = config.sink + GROUP * img.sealed;
            let bad = img.len > config.max_tokens
                || (img.sealed > 0 && body_end > img.len)
                || img.sealed_prev > img.sealed
                || img.len.saturating_sub(body_end.max(config.sink)) > config.ring_rows()
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
            let rb = config.kv_heads * config.record_bytes(i);
            let l = &mut seq.layers[i];
            l.len = img.len;
            l.sealed = img.sealed;
            l.sealed_prev = img.sealed_prev;
            l.draining = img.draining;
            l.sink_k = img.sink_k.iter().map(|&b| f16::from_bits(b)).collect();
            l.sink_v = img.sink_v.iter().map(|&b| f16::from_bits(b)).collect();
            l.ring.copy_from_slice(&img.ring);
            // Images carry no exact-window copies: queries read the restored rows from the ring.
            l.window = ExactWindow {
                first: img.len.max(config.sink),
                k: Vec::new(),
                v: Vec::new(),
            };
            for rec in img.records.chunks_exact(slot) {
                let id = slots.next().expect("reserved one slot per sealed group");
                seq.pool.fill(id, Arc::from(&rec[..rb]));
                l.blocks.push(id);
            }
            l.refresh_centring(&config)?;
        }
        Ok(seq)
    }

    /// Allocated bytes per region and occupied effective bits per value.
    pub fn memory(&self) -> MemoryReport {
        let lens: Vec<(usize, usize, f64)> = self
            .layers
            .iter()
            .map(|l| (l.len, l.sealed, l.rows.bits_per_value()))
            .collect();
        let window_bytes = self.config.window_bytes();
        let ring_bytes = self
            .layers
            .iter()
            .map(|l| l.ring.len() + window_bytes)
            .sum();
        // A slot holds its layer's records only (the pool's slot size bounds the largest
        // layer's), so layers coded with fewer bits occupy less.
        let record_bytes = |i: usize, l: &LayerJournal| {
            l.blocks.len() * self.config.kv_heads * self.config.record_bytes(i)
        };
        let body_bytes = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| record_bytes(i, l))
            .sum();
        let in_use = self
            .layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.len > 0)
            .map(|(i, l)| (1, l.ring.len() + window_bytes + record_bytes(i, l)));
        memory_report(
            &self.config,
            &lens,
            ring_bytes,
            body_bytes,
            in_use.fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1)),
        )
    }
}

/// The memory report of a journal whose layers hold `(len, sealed, ring bits per value)` (any
/// backend); `in_use` is the count of layers holding tokens and their ring and record bytes.
pub fn memory_report(
    cfg: &CacheConfig,
    layers: &[(usize, usize, f64)],
    ring_bytes: usize,
    body_bytes: usize,
    in_use: (usize, usize),
) -> MemoryReport {
    let per_pos_values = cfg.kv_heads * cfg.head_dim * 2;
    let sink_bytes = cfg.layers * cfg.sink * per_pos_values * 2;
    let (mut bits, mut values) = (0.0f64, 0.0f64);
    let (mut sealed_tokens, mut ring_tokens, mut sink_tokens) = (0, 0, 0);
    for (i, &(len, sealed, ring_bits)) in layers.iter().enumerate() {
        // Sequences exist for validated configurations only, whose layers all have a codec.
        let body_bits = cfg.body_codec(i).map_or(0.0, |c| c.bits_per_value());
        let sink = len.min(cfg.sink);
        let body = sealed * GROUP;
        let ring = len - sink - body;
        // The exact window's copies are held besides the ring rows they duplicate.
        let window = (len - sink).min(cfg.exact_recent);
        bits += sink as f64 * 16.0
            + body as f64 * body_bits
            + ring as f64 * ring_bits
            + window as f64 * 16.0;
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
        in_use_layers: in_use.0,
        in_use_bytes: in_use.1 + in_use.0 * cfg.sink * per_pos_values * 2,
    }
}
