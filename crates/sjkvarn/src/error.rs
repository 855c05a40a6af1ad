//! The crate's errors, at the bottom of the house: [`CodecError`] for the record format and the
//! block formats, [`CacheError`] for everything above it (configurations, journals, backends,
//! attention). Every entry point validates its input and returns one of these instead of
//! panicking, so bindings can turn them into clear exceptions.

/// Everything that can go wrong when encoding or decoding.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodecError {
    #[error("unsupported head_dim {0}: expected 64, 128, 256 or 512")]
    UnsupportedHeadDim(usize),

    #[error("unsupported rotation length {0}: expected 64, 128 or 256")]
    UnsupportedRotationLength(usize),

    #[error("unsupported bit width {bits} for {what}: expected one of {allowed}")]
    UnsupportedBits {
        what: &'static str,
        bits: u32,
        allowed: &'static str,
    },

    #[error("{what}: expected {expected} values, got {got}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },

    #[error("{what}: length {len} is not a multiple of the block size {block}")]
    NotBlockMultiple {
        what: &'static str,
        len: usize,
        block: usize,
    },

    #[error("input holds a non-finite value (NaN or Inf) at flat index {index}")]
    NonFinite { index: usize },

    #[error("{what}: a stored fp16 scale would overflow (value {value:e}); the input is too large for this format")]
    ScaleOverflow { what: &'static str, value: f32 },

    #[error("unknown format '{name}'; known formats: {known}")]
    UnknownFormat { name: String, known: String },

    #[error("invalid setting: {0}")]
    InvalidSetting(String),

    #[error("{what} must be {allowed}, got '{got}'")]
    UnknownName {
        what: &'static str,
        allowed: &'static str,
        got: String,
    },

    #[error("could not start a thread pool: {0}")]
    ThreadPool(String),
}

pub type Result<T> = std::result::Result<T, CodecError>;

/// Rejects NaN and Inf before anything is written, so a failed call leaves outputs untouched.
pub fn check_finite(values: &[f32]) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(CodecError::NonFinite { index }),
        None => Ok(()),
    }
}

/// Errors of the journal, its backends and attention.
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
