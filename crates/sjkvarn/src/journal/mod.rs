//! The journal spec, written once for every backend: what a cache is configured with
//! ([`CacheConfig`], the presets [`DEFAULT_JOURNAL`] and [`REFERENCE_JOURNAL`]), how ring rows are
//! stored ([`rows`]: every row layout and the one numbering of staging kinds), when rows leave
//! the ring for the compact body, how a sequence is cut back for prompt caching, how one
//! sequence is saved and restored, and which backend runs which setting ([`capability`]).
//!
//! The rules and the `SJKVSEQ` stream are the SJ-KVaRN 2.0 reference codec's, restated so that
//! every backend takes every decision from the same code and agrees on every position and byte.
//! Nothing here imports a backend or attention: only the codec and the errors below it.
//!
//! # Regions
//!
//! Every sequence splits its positions `[0, n)` into three regions:
//!
//! * **sink** `[0, sink)`: the first positions, kept exact (fp16, or in the staging type) forever,
//!   because attention leans on them hardest;
//! * **body** `[sink, B)`: sealed records, one per (group of `G` positions, KV head); `B` is the
//!   sealed end and always sits on a group boundary `sink + k*G`;
//! * **ring** `[B, n)`: the exact tail in the staging ring, written as tokens arrive.
//!
//! # Seal trigger
//!
//! Sealing is decided at the **start** of a ubatch, before its rows are stored, so a seal only
//! reads rows earlier ubatches wrote and every query keeps at least `tail` exact positions behind
//! it. With an adaptive tail (`tail_max > 0`) nothing happens until the unsealed span `pos0 - B`
//! has already reached `tail_max`; then the whole span down to `tail` is sealed in one batch, so
//! seals are rare and large. A fixed tail (`tail_max == 0`) seals at every ubatch. With
//! `flush_chunk > 0`, decode-sized ubatches (fewer than `G` tokens) seal at most `flush_chunk`
//! groups each and leave the rest *draining* for the next ubatches. An optional idle step seals a
//! grown tail while the engine waits, never touching the last `max(keep_recent, tail)` positions.
//!
//! # Truncation
//!
//! A cut at `pos` keeps positions `[0, r)` and re-prefills from `r`:
//!
//! * in the ring or the sink (`pos >= B` or `pos <= sink`) the cut is free and exact: `r = pos`;
//! * in the body it resumes at the group floor `r = sink + G*floor((pos - sink)/G)`, so at most
//!   `G - 1` tokens are re-run, and every sealed group from `r` on is dropped.
//!
//! Nothing is ever re-quantised: a record is a function of its own `G` rows only, so the kept
//! records stay bit-identical to a fresh build.
//!
//! `policy` holds these rules, `plan` their per-layer bookkeeping, `state` the versioned,
//! checksummed stream of one sequence.

pub mod auto_staging;
pub mod capability;
pub mod centring;
pub(crate) mod config;
pub(crate) mod plan;
pub(crate) mod policy;
pub(crate) mod presets;
pub mod rows;
pub(crate) mod state;

pub use auto_staging::StagingPick;
pub use capability::{backends, Backend, Setting};
pub use centring::Centring;
pub use config::{
    parse_staging, CacheConfig, LayerCoding, SinkType, MAX_EXACT_RECENT, MAX_TOKENS, SINK,
};
pub use presets::{JournalPreset, DEFAULT_JOURNAL, REFERENCE_JOURNAL};
pub use rows::{RingRows, RowCodec, Staging};

pub use plan::{Chunk, LayerState, Rules};
pub use policy::{group_floor, ring_capacity, ring_slot, Policy};
pub use state::{
    check_identity, codebook_id, fnv1a64, peek, walk_payload, write_state, write_state_vec,
    StateError, StateHeader, StateIdentity, StateInfo, StateItem, StateSource, BODY_SCALAR,
    BODY_TRELLIS, CHECKSUM_BYTES, FORMAT_VERSION, ROTATION_HADAMARD, SINK_F16, SINK_INHERIT,
    STAGING_F16, STAGING_Q8_0, STAGING_TQ6_0, STATE_HEADER_BYTES, STATE_MAGIC, STATE_VERSION,
};
