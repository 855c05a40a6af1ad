//! The SJ-KVaRN format, byte for byte as the reference codec (`JakeATX/sj-kvarn-codec` v2.0)
//! defines it.
//!
//! * [`fp16`]: the single rounding every stored scale goes through.
//! * [`rotation`]: the whole-head orthonormal Hadamard transform.
//! * `layout`: record fields, payload code order (fragment, token-major, channel-major).
//! * `balance`: log-domain variance balancing with the fixed reduction contract.
//! * [`trellis`]: the 64-state trellis code, its window and Viterbi search.
//! * `record`: sealing a group into a record and decoding it.
//! * `units`: bulk reading of records into the absorbed-scale form attention scores from.
//! * [`tq6`]: the `tq6_0` staging blocks.
//! * `codebooks`: the format's tables (data).
//! * `hadamard`: the fast Walsh-Hadamard transform under [`rotation`] and the rotated formats.
//! * [`lloyd_max`]: the Gaussian Lloyd-Max centroids of the rotated `tq*` formats.
//! * [`extension`]: what the reference does not define (the v1 scalar body, 5/6/8-bit sides).
//! * [`comparators`]: llama.cpp's and the `turbo`/`tq` block formats, byte for byte.
//! * [`format`](mod@format): every block format behind one name-based API.
//!
//! All arithmetic that decides stored bytes is single-rounded IEEE (Rust never contracts
//! `a * b + c` into an FMA unless asked), so the bytes match the reference on any x86-64 or
//! AArch64 host.

pub(crate) mod balance;
pub(crate) mod body_codec;
pub(crate) mod codebooks;
pub mod comparators;
pub mod conformance;
pub mod extension;
pub mod format;
pub mod fp16;
pub(crate) mod hadamard;
pub(crate) mod layout;
pub mod lloyd_max;
mod lloyd_max_tables;
pub mod q8_0;
pub(crate) mod record;
pub mod rotation;
pub mod tq6;
pub mod trellis;
pub(crate) mod units;

pub use body_codec::{BodyCodec, HalfReader, RecordSealer};
pub use layout::{Body, RecordLayout, GROUP};
pub use record::{Decoder, Sealer, ITERS};
