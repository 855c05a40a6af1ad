//! The journal presets: the product's default journal and the reference codec's.

use super::rows::Staging;

/// The journal's shape apart from geometry and body bits: the unsealed span and how ring rows
/// are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalPreset {
    /// Unsealed tokens kept after a seal.
    pub min_tail: usize,
    /// Unsealed span that triggers a seal.
    pub max_tail: usize,
    pub k_staging: Staging,
    pub v_staging: Staging,
    /// Whether ring and body keys are stored minus the sink's mean key (see
    /// [`CacheConfig::centre_keys`](super::CacheConfig::centre_keys)).
    pub centre_keys: bool,
    /// Newest positions each query reads in fp16 (see [`CacheConfig::exact_recent`](super::CacheConfig::exact_recent)).
    pub exact_recent: usize,
}

/// What a configuration gets unless told otherwise: a `q8_0` ring of 2,048 to 3,072 unsealed
/// tokens, keys centred on the sink's mean key. Keys of small models carry a large offset shared
/// by every position, which the 6-bit `tq6_0` ring codes worse than the 4-bit body (Gemma 3
/// 270M's layer 11: attention-output error 0.108 with `tq6_0` keys, 0.039 with `q8_0` keys);
/// removing the offset before any coding (softmax does not see it) cuts the ring's and the
/// body's key error again by about a quarter. The shorter ring keeps the allocation at or below
/// paper-faithful KVarN with its 1,024-token exact tail. Measurements:
/// `docs/results/quality.md`.
pub const DEFAULT_JOURNAL: JournalPreset = JournalPreset {
    min_tail: 2048,
    max_tail: 3072,
    k_staging: Staging::Q8_0,
    v_staging: Staging::Q8_0,
    centre_keys: true,
    exact_recent: 0,
};

/// The SJ-KVaRN reference codec's defaults (`tq6_0` keys and values, 4,096 to 8,192 unsealed
/// tokens): what its bit-exactness vectors and golden state hashes are defined for.
pub const REFERENCE_JOURNAL: JournalPreset = JournalPreset {
    min_tail: 4096,
    max_tail: 8192,
    k_staging: Staging::Tq6,
    v_staging: Staging::Tq6,
    centre_keys: false,
    exact_recent: 0,
};
