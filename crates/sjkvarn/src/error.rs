//! One error type for the whole codec: every entry point validates its input and returns one of
//! these instead of panicking, so bindings can turn them into clear exceptions.

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

    #[error("unknown format '{0}'; known formats: {known}", known = crate::codec::format::BlockFormat::names().join(", "))]
    UnknownFormat(String),

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
