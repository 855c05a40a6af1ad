//! The exact window (extension): fp16 copies of the newest rows of one layer, which each query
//! reads for the `exact_recent` positions up to its own instead of the ring's codes
//! ([`crate::journal::CacheConfig::exact_recent`]).
//!
//! The copies cover positions `first..len` after the sink. An append of positions
//! `start..start + n` first drops the copies no query of that append can read (those before
//! `start + 1 - exact_recent`), then adds its own rows, so between appends a layer holds
//! `exact_recent - 1` copies plus those of its last append (one for a decode step). A query
//! at `p` reads copies of `max(p + 1 - exact_recent, first)..=p`; positions before that come
//! from the sink, the records and the ring as without the window. So a chunked prefill reads
//! what the same tokens decoded one at a time read.

use crate::error::{CacheError, CacheResult};
use half::f16;

/// The copies of one layer, `[pos][kv_heads][head_dim]` fp16 in the rotated frame; keys as the
/// ring stores them (centred where the layer centres its keys).
#[derive(Debug, Clone)]
pub(crate) struct ExactWindow {
    /// First position held (at least the sink's end).
    pub(crate) first: usize,
    pub(crate) k: Vec<f16>,
    pub(crate) v: Vec<f16>,
}

impl ExactWindow {
    /// An empty window of a layer whose sink ends at `sink`.
    pub(crate) fn new(sink: usize) -> Self {
        Self {
            first: sink,
            k: Vec::new(),
            v: Vec::new(),
        }
    }

    /// Positions held, for rows of `per_pos` values.
    pub(crate) fn rows(&self, per_pos: usize) -> usize {
        self.k.len() / per_pos
    }

    /// The first position a query at `pos` reads from the copies: `pos + 1` when it reads
    /// none (window off, or `pos` before the copies).
    #[inline(always)]
    pub(crate) fn exact_from(&self, width: usize, pos: usize) -> usize {
        if width == 0 {
            return pos + 1;
        }
        (pos + 1).saturating_sub(width).max(self.first).min(pos + 1)
    }

    /// The K (or V) copy of `pos`, head `head`.
    #[inline(always)]
    pub(crate) fn row(
        &self,
        pos: usize,
        head: usize,
        kv_heads: usize,
        d: usize,
        value: bool,
    ) -> &[f16] {
        let at = ((pos - self.first) * kv_heads + head) * d;
        let side = if value { &self.v } else { &self.k };
        &side[at..at + d]
    }

    /// Rounds rows to fp16, refusing values fp16 cannot hold (before anything changes).
    pub(crate) fn rounded(rows: &[f32], what: &'static str) -> CacheResult<Vec<f16>> {
        let mut out = Vec::new();
        out.try_reserve_exact(rows.len())
            .map_err(|_| CacheError::OutOfMemory {
                what,
                bytes: rows.len() * 2,
            })?;
        for &x in rows {
            let h = f16::from_f32(x);
            if !h.is_finite() {
                return Err(crate::CodecError::ScaleOverflow { what, value: x }.into());
            }
            out.push(h);
        }
        Ok(out)
    }

    /// Before an append at `start` (the layer's length): drops the copies no query of it reads.
    pub(crate) fn trim_for_append(&mut self, start: usize, width: usize, per_pos: usize) {
        let keep_from = (start + 1).saturating_sub(width).max(self.first);
        let drop = (keep_from - self.first).min(self.rows(per_pos));
        self.k.drain(..drop * per_pos);
        self.v.drain(..drop * per_pos);
        self.first = keep_from;
    }

    /// Adds the copies of the positions that follow the held ones.
    pub(crate) fn extend(&mut self, k: &[f16], v: &[f16]) {
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
    }

    /// Keeps the copies of positions before `len` (a truncation to `len`); with none left the
    /// window restarts at `max(len, sink)`.
    pub(crate) fn truncate(&mut self, len: usize, sink: usize, per_pos: usize) {
        let keep = len.saturating_sub(self.first).min(self.rows(per_pos));
        self.k.truncate(keep * per_pos);
        self.v.truncate(keep * per_pos);
        if keep == 0 {
            self.first = len.max(sink);
        }
    }
}
