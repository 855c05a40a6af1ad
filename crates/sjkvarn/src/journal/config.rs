//! Cache configuration and its validation.

use super::presets::{JournalPreset, DEFAULT_JOURNAL, REFERENCE_JOURNAL};
use super::rows::{RingRows, Staging};
use crate::codec::extension::balance::BalanceConfig;
use crate::codec::extension::body::{BodyCoding, GROUP};
use crate::codec::BodyCodec;
use crate::error::{CacheError, CacheResult};
use crate::journal::Rules;

/// Default sink: positions kept in fp16 at the start of every sequence (the reference's 128).
pub const SINK: usize = 128;

/// Largest exact window ([`CacheConfig::exact_recent`]): the copies are fp16, so a window of
/// a few thousand positions already costs more than a larger ring.
pub const MAX_EXACT_RECENT: usize = 4096;

/// Longest supported sequence.
pub const MAX_TOKENS: usize = 1 << 24;

/// Bits and coding of one layer's body records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerCoding {
    pub k_bits: u32,
    pub v_bits: u32,
    pub k_coding: BodyCoding,
    pub v_coding: BodyCoding,
}

impl LayerCoding {
    pub fn scalar(k_bits: u32, v_bits: u32) -> Self {
        Self {
            k_bits,
            v_bits,
            k_coding: BodyCoding::Scalar,
            v_coding: BodyCoding::Scalar,
        }
    }
}

/// The ring staging a user writes: `"tq6_0"`, `"q8_0"`, `"f16"` (keys and values), `"K/V"`
/// (e.g. `"q8_0/tq6_0"`: keys and values apart) or `"auto"` (each layer measures its own first
/// rows; `budget` defaults to [`super::auto_staging::DEFAULT_BUDGET`]). Returns the K and V
/// staging and the auto budget.
pub fn parse_staging(
    spec: &str,
    budget: Option<f32>,
) -> CacheResult<(Staging, Staging, Option<f32>)> {
    if spec == "auto" {
        let budget = budget.unwrap_or(super::auto_staging::DEFAULT_BUDGET);
        return Ok((Staging::Tq6, Staging::Tq6, Some(budget)));
    }
    if budget.is_some() {
        return Err(CacheError::InvalidConfig(format!(
            "a staging budget only applies to staging 'auto' (staging is '{spec}')"
        )));
    }
    match spec.split_once('/') {
        Some((k, v)) => Ok((Staging::from_name(k)?, Staging::from_name(v)?, None)),
        None => {
            let s = Staging::from_name(spec)?;
            Ok((s, s, None))
        }
    }
}

/// How the sink (the first 128 positions) is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkType {
    /// Rotated fp16 (the reference default).
    F16,
    /// In the staging type (the reference's `SINK_INHERIT`); sjkvarn supports it with fp16
    /// staging, where the bytes equal the fp16 sink's.
    Inherit,
}

impl SinkType {
    pub const fn name(self) -> &'static str {
        match self {
            SinkType::F16 => "f16",
            SinkType::Inherit => "inherit",
        }
    }
}

impl std::str::FromStr for SinkType {
    type Err = CacheError;

    fn from_str(name: &str) -> CacheResult<Self> {
        [SinkType::F16, SinkType::Inherit]
            .into_iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| {
                CacheError::InvalidConfig(format!(
                    "sink_type must be 'f16' or 'inherit', got '{name}'"
                ))
            })
    }
}

/// Everything a cache needs to know; validated by [`CacheConfig::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// One entry per layer (tiered edge layers use different bits).
    pub layer_coding: Vec<LayerCoding>,
    /// Unsealed tokens kept after a seal (the reference's `tail`; a multiple of 128 there).
    pub min_tail: usize,
    /// Unsealed span that triggers a seal (the reference's `tail_max`; 0 = fixed tail, which
    /// seals down to `min_tail` at every ubatch).
    pub max_tail: usize,
    /// Largest ubatch (the reference's `n_ubatch`): longer appends run as several ubatches, each
    /// with its own seal decision.
    pub max_chunk: usize,
    /// Groups a decode-sized ubatch may seal (0 = a commit runs at once).
    pub flush_chunk: usize,
    /// Largest sequence length.
    pub max_tokens: usize,
    pub balance: BalanceConfig,
    /// How ring rows of keys and of values are stored (they may differ, e.g. `q8_0` keys with
    /// `tq6_0` values); ignored while `auto_staging` is set.
    pub k_staging: Staging,
    pub v_staging: Staging,
    /// `Some(budget)`: every layer picks its own K and V staging at its first append, the
    /// smallest type whose measured error stays within `budget` (see
    /// [`super::StagingPick`]).
    pub auto_staging: Option<f32>,
    /// Leading positions kept exact (the reference's `sink`: a non-zero multiple of 64).
    pub sink: usize,
    pub sink_type: SinkType,
    /// Store every key after the sink, and score the sink, minus the sink's mean key (positions
    /// `1..sink`, the first token left out: it is an outlier in most models). A key offset
    /// shared by all positions adds the same `q·μ` to every score of a query, which softmax
    /// removes, so attention is unchanged while the coded keys lose the large shared component
    /// that costs their codes precision. The sink stays stored as appended; the mean is
    /// recomputed from it, so states need no extra bytes (an extension rotation id marks them).
    pub centre_keys: bool,
    /// The exact window (extension; 0 = off): a query at position `p` reads positions
    /// `p - exact_recent + 1 ..= p` after the sink from an fp16 copy of their rotated rows
    /// instead of the ring's codes. The newest positions carry a large share of attention
    /// mass, and an 8-bit ring key costs there what it saves elsewhere. Each layer keeps the
    /// copies of the newest `exact_recent - 1` positions plus those of its last append; states
    /// carry them after the `SJKVSEQ` stream (see `docs/formats.md`).
    pub exact_recent: usize,
}

impl CacheConfig {
    /// A uniform configuration with the product defaults ([`DEFAULT_JOURNAL`], 16 `final`
    /// balancing passes, a 128-token fp16 sink).
    pub fn recommended(
        layers: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        coding: LayerCoding,
        max_tokens: usize,
    ) -> Self {
        Self::uniform(layers, q_heads, kv_heads, head_dim, coding, max_tokens)
            .with_journal(DEFAULT_JOURNAL)
    }

    /// This configuration with `preset`'s tails and staging.
    pub fn with_journal(mut self, preset: JournalPreset) -> Self {
        self.min_tail = preset.min_tail;
        self.max_tail = preset.max_tail;
        self.k_staging = preset.k_staging;
        self.v_staging = preset.v_staging;
        self.centre_keys = preset.centre_keys;
        self.exact_recent = preset.exact_recent;
        self
    }

    /// A uniform configuration with the SJ-KVaRN reference defaults ([`REFERENCE_JOURNAL`],
    /// 16 `final` passes, a 128-token fp16 sink): with 2..4-bit bodies and head_dim a multiple
    /// of 128 it writes the reference format byte for byte.
    pub fn uniform(
        layers: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        coding: LayerCoding,
        max_tokens: usize,
    ) -> Self {
        Self {
            layers,
            q_heads,
            kv_heads,
            head_dim,
            layer_coding: vec![coding; layers],
            min_tail: REFERENCE_JOURNAL.min_tail,
            max_tail: REFERENCE_JOURNAL.max_tail,
            max_chunk: 512,
            flush_chunk: 0,
            max_tokens,
            balance: BalanceConfig::default(),
            k_staging: REFERENCE_JOURNAL.k_staging,
            v_staging: REFERENCE_JOURNAL.v_staging,
            auto_staging: None,
            sink: SINK,
            sink_type: SinkType::F16,
            centre_keys: REFERENCE_JOURNAL.centre_keys,
            exact_recent: REFERENCE_JOURNAL.exact_recent,
        }
    }

    /// Checks every field; the error names the first problem.
    pub fn validate(&self) -> CacheResult<()> {
        let bad = |m: String| Err(CacheError::InvalidConfig(m));
        if self.layers == 0 || self.kv_heads == 0 || self.q_heads == 0 {
            return bad("layers, q_heads and kv_heads must be at least 1".into());
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "q_heads ({}) must be a multiple of kv_heads ({})",
                self.q_heads, self.kv_heads
            ));
        }
        if self.layer_coding.len() != self.layers {
            return bad(format!(
                "layer_coding has {} entries for {} layers",
                self.layer_coding.len(),
                self.layers
            ));
        }
        if !matches!(self.head_dim, 64 | 128 | 256 | 512) {
            return bad(format!(
                "head_dim {} is not supported: expected 64, 128, 256 or 512",
                self.head_dim
            ));
        }
        if self.sink == 0 || !self.sink.is_multiple_of(64) || self.sink > 1 << 16 {
            return bad(format!(
                "sink ({}) must be a non-zero multiple of 64 (at most 65536)",
                self.sink
            ));
        }
        if self.sink_type == SinkType::Inherit
            && (self.auto_staging.is_some()
                || self.k_staging != Staging::F16
                || self.v_staging != Staging::F16)
        {
            return bad(format!(
                "an inherited sink is supported with f16 staging only (staging is {})",
                self.staging_name()
            ));
        }
        if self.centre_keys && self.sink_type != SinkType::F16 {
            return bad("centred keys need an fp16 sink (sink_type 'f16')".into());
        }
        if self.exact_recent > MAX_EXACT_RECENT {
            return bad(format!(
                "exact_recent ({}) must be at most {MAX_EXACT_RECENT}",
                self.exact_recent
            ));
        }
        if let Some(budget) = self.auto_staging {
            if !(budget.is_finite() && budget > 0.0 && budget < 1.0) {
                return bad(format!(
                    "the auto staging budget must be in (0, 1), got {budget}"
                ));
            }
        }
        if self.max_tail != 0 && self.max_tail < self.min_tail {
            return bad(format!(
                "max_tail ({}) must be 0 (fixed tail) or at least min_tail ({})",
                self.max_tail, self.min_tail
            ));
        }
        if self.max_chunk == 0 || self.max_tokens == 0 {
            return bad("max_chunk and max_tokens must be at least 1".into());
        }
        // Upper bounds keep every up-front allocation sane: a typo must be an error, not an
        // out-of-memory abort of the host process.
        let limits = [
            ("layers", self.layers, 4096),
            ("q_heads", self.q_heads, 4096),
            ("kv_heads", self.kv_heads, 1024),
            ("max_tokens", self.max_tokens, MAX_TOKENS),
            ("max_tail", self.max_tail, 1 << 22),
            ("max_chunk", self.max_chunk, 1 << 16),
            ("flush_chunk", self.flush_chunk, 1 << 16),
        ];
        for (name, value, limit) in limits {
            if value > limit {
                return bad(format!(
                    "{name} = {value} exceeds the supported maximum {limit}"
                ));
            }
        }
        self.balance
            .validate()
            .map_err(|e| CacheError::InvalidConfig(e.to_string()))?;
        for i in 0..self.layers {
            self.body_codec(i)?;
        }
        Ok(())
    }

    /// The record codec of `layer`; a layer this configuration does not have, or a coding the
    /// codec cannot write (refused by `validate` too), is an `InvalidConfig` error.
    pub fn body_codec(&self, layer: usize) -> CacheResult<BodyCodec> {
        let lc = self
            .layer_coding
            .get(layer)
            .ok_or(CacheError::LayerOutOfRange {
                layer,
                layers: self.layer_coding.len(),
            })?;
        BodyCodec::for_layer(
            self.head_dim,
            lc.k_bits,
            lc.v_bits,
            lc.k_coding,
            lc.v_coding,
            self.balance,
        )
        .map_err(|e| CacheError::InvalidConfig(format!("layer {layer}: {e}")))
    }

    /// Bytes of one KV head's record of `layer` (0 for a configuration `validate` refuses, so
    /// sizing an invalid configuration cannot fail before validation reports it).
    pub fn record_bytes(&self, layer: usize) -> usize {
        self.body_codec(layer).map_or(0, |c| c.record_bytes())
    }

    /// The journal rules of this configuration (shared by every backend).
    pub fn rules(&self) -> Rules {
        Rules {
            sink: self.sink,
            group: GROUP,
            tail: self.min_tail,
            tail_max: self.max_tail,
            flush_chunk: self.flush_chunk,
            ubatch: self.max_chunk,
            max_tokens: self.max_tokens,
        }
    }

    /// Whether every layer writes reference SJ-KVaRN records with reference staging, so the
    /// cache's state is a plain `SJKVSEQ` stream the reference codec can load.
    pub fn is_reference(&self) -> bool {
        let uniform = self.layer_coding.windows(2).all(|w| w[0] == w[1]);
        // The reference asks for whole-group tails (sjkvarn also accepts others, e.g. for
        // scaled-down evaluations).
        let tails = self.min_tail.is_multiple_of(GROUP) && self.max_tail.is_multiple_of(128);
        uniform
            && tails
            && !self.centre_keys
            && self.exact_recent == 0
            && self.head_dim.is_multiple_of(128)
            && self.has_reference_staging()
            && (0..self.layers).all(|l| self.body_codec(l).is_ok_and(|c| c.is_reference()))
    }

    /// Whether the ring uses one reference staging type for keys and values (`tq6_0` or
    /// `f16`): the reference has one staging type per cache and no `q8_0`.
    pub fn has_reference_staging(&self) -> bool {
        self.auto_staging.is_none()
            && self.k_staging == self.v_staging
            && self.k_staging != Staging::Q8_0
    }

    /// The staging as users write it: one type, `K/V` types, or `auto`.
    pub fn staging_name(&self) -> String {
        if self.auto_staging.is_some() {
            "auto".into()
        } else if self.k_staging == self.v_staging {
            self.k_staging.name().into()
        } else {
            format!("{}/{}", self.k_staging.name(), self.v_staging.name())
        }
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// Bytes of one layer's ring stored as `rows`.
    pub fn ring_bytes(&self, rows: RingRows) -> usize {
        self.ring_rows() * self.kv_heads * rows.entry_bytes()
    }

    /// Bytes of one layer's exact window as a decoding sequence holds it: `exact_recent` fp16
    /// K and V rows of every KV head (a prefill holds its own rows besides until the next
    /// append).
    pub fn window_bytes(&self) -> usize {
        self.exact_recent * self.kv_heads * self.head_dim * 4
    }

    /// Ring rows allocated per layer (see [`Rules::ring_rows`]).
    pub fn ring_rows(&self) -> usize {
        self.rules().ring_rows()
    }

    /// Bytes of one pool slot: all KV heads' records of one layer and group (largest layer).
    pub fn slot_bytes(&self) -> usize {
        (0..self.layers)
            .map(|l| self.kv_heads * self.record_bytes(l))
            .max()
            .unwrap_or(0)
    }

    /// Pool slots one sequence of `max_tokens` can fill.
    pub fn slots_per_sequence(&self) -> usize {
        self.layers * self.max_tokens.saturating_sub(self.sink).div_ceil(GROUP)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A coding the record codec cannot write, or a layer the configuration does not have, is a
    /// typed error from `body_codec`; sizing such a configuration does not panic, and
    /// `validate` refuses it by layer.
    #[test]
    fn body_codec_errors_instead_of_panicking() {
        let mut c = CacheConfig::recommended(2, 4, 2, 64, LayerCoding::scalar(4, 4), 1024);
        assert!(c.body_codec(1).is_ok());
        assert!(matches!(
            c.body_codec(2),
            Err(CacheError::LayerOutOfRange {
                layer: 2,
                layers: 2
            })
        ));
        c.layer_coding[1].k_bits = 1;
        assert!(
            matches!(c.body_codec(1), Err(CacheError::InvalidConfig(m)) if m.contains("layer 1"))
        );
        assert_eq!(c.record_bytes(1), 0);
        assert!(c.slot_bytes() > 0, "layer 0 still sizes the slot");
        assert!(!c.is_reference());
        assert!(matches!(c.validate(), Err(CacheError::InvalidConfig(m)) if m.contains("layer 1")));
    }
}
