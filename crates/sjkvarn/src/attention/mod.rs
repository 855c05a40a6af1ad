//! One-pass CPU attention over sink, body records and ring, without a dequantized copy of the
//! cache: one online softmax spans all three regions, the query heads of a KV head share every
//! block they read, and body records are read in the absorbed-scale form.
//!
//! Frames: the sink, the body records and the ring rows are all Hadamard-rotated, as the
//! reference stores them, so they are scored with the rotated query `q' = H q` and the value sum
//! is rotated back once at the end (`H` is orthonormal: `q . k = q' . k'`).
//!
//! Each query row is processed on its own, in a fixed block order (sink, groups, ring blocks
//! aligned to 128 positions), and every sum runs in a fixed order (`attention::tile_gemm`):
//! masked positions add nothing (their weight is zero or their logit is never read), so a
//! row's output does not depend on how many other rows share the call. Chunked prefill
//! therefore equals token-by-token decoding bit for bit when chunks do not straddle a seal.

/// `match $m` over the query-row counts a kernel is instantiated for: `$call!(n)` for each
/// listed count, `$call!($last)` for any other (the kernels' callers never pass more).
macro_rules! by_rows {
    ($m:expr, $call:ident, [$($n:literal),*], $last:literal) => {
        match $m {
            $($n => $call!($n),)*
            _ => $call!($last),
        }
    };
}

mod driver;
mod fragment_dots;
mod job;
mod online_softmax;
mod operands;
pub(crate) mod output;
mod paged;
mod prefill;
mod region;
mod ring_q8;
mod ring_tq6;
pub(crate) mod tile_gemm;
mod word_dots;
mod workspace;

pub use driver::{attend, attend_with_threads};
pub use paged::{attend_paged, PagedBlock};

#[cfg(test)]
mod tests;
