//! sjkvarn: the SJ-KVaRN KV-cache codec.
//!
//! Keys and values are Hadamard-rotated ([`hadamard`]), staged in the 6-bit [`tq`] format, and
//! sealed in 128-token groups into low-bit [`body`] records after Sinkhorn [`balance`]-ing. The
//! llama.cpp [`ggml`] formats and the rotated `turbo`/`tq` formats are comparators, reachable by
//! name through [`format`]. Byte layouts: `docs/formats.md`.

pub mod balance;
pub mod bitpack;
pub mod body;
pub mod cache;
pub mod codec;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod format;
#[doc(hidden)]
pub mod fuzz;
pub mod ggml;
pub mod hadamard;
pub mod journal;
pub mod kernel_abi;
pub mod lloyd_max;
mod lloyd_max_tables;
pub mod records;
pub mod rng;
pub mod tq;

pub use balance::{BalanceConfig, BalanceMode, BalanceStat};
pub use body::{BodySpec, GROUP};
pub use error::{CodecError, Result};
pub use format::BlockFormat;
