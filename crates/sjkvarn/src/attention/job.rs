//! What every work item of one attention call reads.

use crate::backend::cpu::sequence::{LayerJournal, Sequence};
use crate::codec::BodyCodec;

/// What every work item of one call reads.
pub(crate) struct Job<'a> {
    pub(crate) seq: &'a Sequence,
    pub(crate) lj: &'a LayerJournal,
    pub(crate) codec: &'a BodyCodec,
    pub(crate) d: usize,
    pub(crate) r: usize,
    pub(crate) kvh: usize,
    pub(crate) sink: usize,
    /// Query (row, head) pairs per KV head: rows x group size.
    pub(crate) pairs: usize,
}
