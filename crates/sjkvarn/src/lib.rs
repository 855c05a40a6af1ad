//! sjkvarn: the SJ-KVaRN KV-cache codec, its journal and attention over the compressed cache.
//!
//! A KV cache for LLM inference keeps, per layer, a 128-token fp16 *sink*, an 8-bit staging
//! *ring* of recent tokens, and older tokens sealed in 128-token *body records*: keys and values
//! are Walsh-Hadamard rotated, Sinkhorn balanced and coded at 2/3/4 bits (scalar rounding or a
//! 64-state trellis) with absorbed fp16 scales. Records live in a [`RecordPool`] shared by
//! many [`Sequence`]s (forks share their prefix); [`attention::attend`] reads the
//! compressed cache directly. Everything runs on the CPU (the reference implementation); the
//! optional `cuda` feature adds a device backend (`backend::cuda::DeviceSequence`) whose kernels
//! (this crate's `cuda/` folder) are compiled with NVRTC at run time, so nothing CUDA is needed
//! to build.
//!
//! **Format.** The bytes are SJ-KVaRN as defined by the MIT-licensed C99 reference codec,
//! [JakeATX/sj-kvarn-codec](https://github.com/JakeATX/sj-kvarn-codec) v2.0: body records
//! ([`codec`]), the `tq6_0` staging rows, the journal rules ([`journal`]) and the `SJKVSEQ`
//! sequence state stream ([`Sequence::state_bytes`]); the reference's bit-exactness
//! vectors and golden state hashes are reproduced by this crate's tests. Extensions (64-wide
//! trellis heads, 5/6/8-bit sides, `q8_0` staging, centred keys, the exact window) and the comparator formats ([`codec::comparators`],
//! reachable by name through [`codec::format`]) are described with every byte layout in
//! the repository's `docs/formats.md`.
//!
//! ```
//! use sjkvarn::rng::SplitMix64;
//! use sjkvarn::{attend, CacheConfig, Journal, LayerCoding, Sequence};
//! use std::sync::Arc;
//!
//! // 2 layers, 4 query heads over 2 KV heads of 128, 4-bit keys and values, up to 4,096 tokens,
//! // the default journal (a `q8_0` ring, keys centred on the sink's mean; `CacheConfig::uniform`
//! // is the reference codec's) with a 256/512 tail instead of 2,048/3,072, so that this short
//! // prompt seals records.
//! let mut config = CacheConfig::recommended(2, 4, 2, 128, LayerCoding::scalar(4, 4), 4096);
//! (config.min_tail, config.max_tail) = (256, 512);
//! let config = Arc::new(config);
//! let mut seq = Sequence::new(config.clone(), Sequence::pool_for(&config, 1))?;
//! let (kv, qv) = (config.kv_heads * config.head_dim, config.q_heads * config.head_dim);
//! let mut rng = SplitMix64::new(7); // stand-in for a model's post-RoPE K, V and Q
//! for layer in 0..config.layers {
//!     while seq.len(layer)? < 1500 {
//!         let n = seq.chunk_limit(layer)?.min(1500 - seq.len(layer)?); // one ubatch
//!         seq.append(layer, &rng.gaussians(n * kv), &rng.gaussians(n * kv))?;
//!     }
//!     let out = attend(&seq, layer, &rng.gaussians(qv), None)?; // one query, last position
//!     assert_eq!(out.len(), qv);
//! }
//! let m = seq.memory();
//! assert!(m.sealed_tokens > 0);
//! println!("{} tokens, {:.2} bits/value occupied", m.tokens, m.effective_bits);
//! println!("SJKVSEQ state: {} bytes", seq.state_bytes()?.len());
//! # Ok::<(), sjkvarn::CacheError>(())
//! ```
//!
//! Layout: [`codec`] (the record format, its [`codec::extension`]s and the
//! [`codec::comparators`]); [`journal`] (the spec every backend runs: configuration, presets,
//! row layouts, seal rules, state stream, and the [`journal::capability`] table of which
//! backend runs which setting); [`backend`] (the backends, each in its own room: [`backend::cpu`],
//! `backend::cuda`, behind the [`Journal`] trait); [`attention`] (the CPU kernels). See the
//! repository's `docs/architecture.md`; `examples/serve.rs` shows a server loop over many
//! sequences.

pub(crate) mod atomic_file;
pub mod attention;
pub mod backend;
pub mod codec;
pub mod error;
#[doc(hidden)]
pub mod fuzz;
pub mod journal;
pub mod kernel_abi;
mod parallel;
pub mod rng;
pub(crate) mod simd;

pub use codec::extension::balance::{BalanceConfig, BalanceMode, BalanceStat};
pub use codec::extension::body::{BodySpec, GROUP};
pub use codec::format::BlockFormat;
pub use error::{CacheError, CacheResult, CodecError, Result};

// What a native server needs, at the crate root: a configuration, sequences on a shared record
// pool, attention over them, and the errors.
pub use attention::{attend, attend_with_threads};
pub use backend::{Journal, MemoryReport, RecordPool, Sequence};
pub use codec::extension::body::BodyCoding;
pub use journal::{
    CacheConfig, JournalPreset, LayerCoding, Staging, DEFAULT_JOURNAL, REFERENCE_JOURNAL,
};
