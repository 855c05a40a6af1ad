//! The journal over an engine's paged KV blocks (vLLM's block table), kept here so that every
//! binding shares one implementation of the rules the Python plugin relies on.
//!
//! One engine block of [`BLOCK`] tokens is one sealed body group: its page holds one body
//! record per KV head, written once, when the block's last row arrives. Until then the block's
//! rows are held exact (fp16) beside the pages; the first block of a sequence (the *sink*)
//! stays exact for as long as room allows. A query at position `p` reads its own block and the
//! sink exact and every other full block from its record, so what it sees depends only on the
//! tokens before it, never on how the engine chunked the prefill or shared blocks.
//!
//! - [`PagedSettings`]: the record coding and its checks.
//! - [`PagedJournal`]: one full-attention layer's bookkeeping (open blocks, sinks, seals).
//! - [`WindowJournal`]: one sliding-window layer (exact fp16 rows in the pages).
//! - [`StepPlan`]: what each request's query blocks read, built once per engine step and
//!   shared by every layer of that step.

mod attend;
mod journal;
mod settings;
mod sinks;
mod step;
mod window;

pub use attend::Dense;
pub use journal::{PagedJournal, Pages, PagesMut};
pub use settings::{window_row_bytes, PageDtype, PagedSettings};
pub use step::{QueryBlock, RequestSpan, StepPlan};
pub use window::{WindowJournal, WindowPages, WindowPagesMut};

use crate::error::CacheError;
use crate::CodecError;

/// Tokens per engine block: one sealed body group.
pub const BLOCK: usize = crate::codec::extension::body::GROUP;

/// Fewest tokens per sliding-window page (vLLM's CPU scheduler works in multiples of 16).
pub const WINDOW_MIN_BLOCK: usize = 16;

/// Why a paged-journal call was refused. A refused call leaves the pages and the journal as
/// they were.
#[derive(Debug, thiserror::Error)]
pub enum PagedError {
    /// Bad settings, shapes, slots or block ids: the message names the value.
    #[error("{0}")]
    Invalid(String),
    /// The attention kernels refused the call.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The codec refused a seal or a decode.
    #[error(transparent)]
    Codec(#[from] CodecError),
}

/// Results of the paged journal.
pub type PagedResult<T> = Result<T, PagedError>;

pub(crate) fn invalid<T>(message: impl Into<String>) -> PagedResult<T> {
    Err(PagedError::Invalid(message.into()))
}

/// Refuses non-finite rows (the check every write makes before touching anything).
pub(crate) fn check_rows(key: &[f32], value: &[f32]) -> PagedResult<()> {
    if key.iter().chain(value).any(|x| !x.is_finite()) {
        return invalid("key/value rows hold NaN or Inf");
    }
    Ok(())
}

/// Refuses rows that fp16 cannot hold (they would turn into infinities when kept exact).
pub(crate) fn check_fp16_range(key: &[f32], value: &[f32], layers: &str) -> PagedResult<()> {
    let big = key.iter().chain(value).fold(0.0f32, |m, x| m.max(x.abs()));
    if big > f32::from(half::f16::MAX) {
        return invalid(format!(
            "key/value rows reach {big:.3e}, beyond float16's range: {layers} keep fp16 rows"
        ));
    }
    Ok(())
}
