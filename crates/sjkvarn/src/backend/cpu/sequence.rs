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

use super::alloc::{zeroed, zeroed_bytes};
use crate::backend::cpu::exact_window::ExactWindow;
use crate::backend::pool::{RecordPool, SlotId};
use crate::codec::extension::body::GROUP;
use crate::error::{CacheError, CacheResult};
use crate::journal::auto_staging::StagingPick;
use crate::journal::capability::{self, Backend};
use crate::journal::CacheConfig;
use crate::journal::Centring;
use crate::journal::LayerState;
use crate::journal::RingRows;
use half::f16;
use std::sync::Arc;

/// One layer's journal.
#[derive(Debug, Clone)]
pub(crate) struct LayerJournal {
    /// Tokens appended, sealed groups (each one slot in `blocks`), and the journal state the
    /// `SJKVSEQ` stream carries.
    pub(crate) state: LayerState,
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

impl LayerJournal {
    /// First position held by the ring of a cache whose sink is `sink` positions.
    pub(crate) fn ring_start(&self, sink: usize) -> usize {
        sink + GROUP * self.state.sealed
    }

    pub(crate) fn state(&self) -> LayerState {
        self.state
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
        self.centring = if cfg.centre_keys && self.state.len >= cfg.sink {
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
        self.state = st;
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
        capability::check(Backend::Cpu, &config)?;
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
                state: LayerState::default(),
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

    /// What `auto` staging picked for `layer` (`None`: fixed staging, or nothing appended yet).
    pub fn staging_pick(&self, layer: usize) -> CacheResult<Option<&StagingPick>> {
        Ok(self.layer(layer)?.pick.as_ref())
    }

    /// Allocated bytes per region and occupied effective bits per value.
    pub fn memory(&self) -> MemoryReport {
        let lens: Vec<(usize, usize, f64)> = self
            .layers
            .iter()
            .map(|l| (l.state.len, l.state.sealed, l.rows.bits_per_value()))
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
            .filter(|(_, l)| l.state.len > 0)
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
