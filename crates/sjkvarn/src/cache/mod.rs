//! The journaled KV cache: a 128-token fp16 sink, a staging ring of recent tokens, and sealed
//! 128-token body records in a record pool shared by many sequences.
//!
//! * `config` ([`CacheConfig`]): geometry, per-layer coding, tail sizes, staging precision;
//!   validated.
//! * `pool` ([`RecordPool`]): fixed-size, reference-counted record slots shared across
//!   sequences.
//! * [`staging`]: how ring rows are stored (`tq6_0`, `q8_0` or fp16, keys and values apart).
//! * `auto_staging` ([`StagingPick`]): `staging = "auto"`, each layer's pick measured on its
//!   own rows.
//! * `sequence` ([`Sequence`]): one sequence's journal per layer: append, seal, truncate, fork, accounting.
//! * [`snapshot`]: versioned, checksummed save and load.

pub(crate) mod auto_staging;
pub(crate) mod config;
pub(crate) mod exact_window;
#[doc(hidden)]
pub mod faults;
pub(crate) mod pool;
pub(crate) mod sequence;
pub mod snapshot;
pub mod staging;

pub use auto_staging::{
    StagingPick, CANDIDATES as STAGING_CANDIDATES, DEFAULT_BUDGET as DEFAULT_STAGING_BUDGET,
};
pub use config::{
    parse_staging, CacheConfig, JournalPreset, LayerCoding, SinkType, Staging, DEFAULT_JOURNAL,
    MAX_EXACT_RECENT, MAX_TOKENS, REFERENCE_JOURNAL, SINK,
};
pub use pool::{PoolStats, RecordPool, SlotId};
pub use sequence::{LayerImage, MemoryReport, Sequence};

/// Errors of the cache layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CacheError {
    #[error("invalid cache configuration: {0}")]
    InvalidConfig(String),

    #[error("layer {layer} does not exist (the cache has {layers} layers)")]
    LayerOutOfRange { layer: usize, layers: usize },

    #[error("{what}: expected shape {expected}, got {got}")]
    Shape {
        what: &'static str,
        expected: String,
        got: String,
    },

    #[error("appending {adding} tokens to {len} would exceed max_tokens = {max}")]
    TooLong {
        len: usize,
        adding: usize,
        max: usize,
    },

    #[error("position {position} is out of range: the layer holds {len} tokens")]
    Position { position: usize, len: usize },

    #[error(
        "record pool exhausted: this call needs {needed} free slots, {free} of {capacity} are free"
    )]
    PoolExhausted {
        needed: usize,
        free: usize,
        capacity: usize,
    },

    #[error("{0}")]
    Codec(#[from] crate::CodecError),

    #[error("snapshot refused: {0}")]
    Snapshot(String),

    /// An `SJKVSEQ` state stream was refused (the reference's status codes, one per reason).
    #[error("state refused: {0}")]
    State(#[from] crate::journal::StateError),

    /// Reading or writing a file failed; the target file is as it was.
    #[error("{path}: {detail}")]
    Io {
        path: String,
        kind: std::io::ErrorKind,
        /// The OS error number, where the OS gave one.
        errno: Option<i32>,
        detail: String,
    },

    /// Attention scores left the float32 range (a query or scale far larger than any model's);
    /// the output would be NaN, so none is returned.
    #[error("attention overflowed float32: scale * |q| is {scaled_query:e} and the scores scale * q.k passed 3.4e38; scale the query or `scale` down")]
    ScoreOverflow { scaled_query: f32 },

    /// The configuration is valid but this machine cannot allocate it; nothing was allocated.
    #[error("cannot allocate {bytes} bytes for {what}")]
    OutOfMemory { what: &'static str, bytes: usize },
}

impl CacheError {
    /// The error of an i/o failure on `path`.
    pub fn io(path: &std::path::Path, e: &std::io::Error) -> Self {
        let errno = e.raw_os_error();
        let text = e.to_string();
        // The OS's own wording, without Rust's " (os error N)" (the number is kept in `errno`).
        let detail = match errno {
            Some(n) => text
                .strip_suffix(&format!(" (os error {n})"))
                .unwrap_or(&text)
                .to_owned(),
            None => text,
        };
        CacheError::Io {
            path: path.display().to_string(),
            kind: e.kind(),
            errno,
            detail,
        }
    }
}

pub type CacheResult<T> = std::result::Result<T, CacheError>;
