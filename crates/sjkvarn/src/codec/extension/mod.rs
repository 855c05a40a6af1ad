//! Format extensions beyond the SJ-KVaRN reference: the v1 scalar body record (5/6/8-bit sides,
//! the `best`/`rms` balancing of the paper-faithful KVarN comparator), its balancing, batched
//! sealing of many records, and the bit packing its payloads use. Every byte layout is in the
//! repository's `docs/formats.md`.

pub(crate) mod balance;
pub(crate) mod bitpack;
pub mod body;
pub mod records;
