//! The ring as attention and seals read it: positions to ring entries, one head's rows from a
//! first position on ([`RingCursor`]).

use super::sequence::{LayerJournal, Sequence};
use crate::simd::prefetch_l2;

/// Ring rows of one layer and KV head from a first position on ([`Sequence::ring_cursor`]):
/// the same rows [`Sequence::ring_row`] and [`Sequence::prefetch_ring`] give.
pub(crate) struct RingCursor<'a> {
    layer: &'a LayerJournal,
    first: usize,
    first_row: usize,
    rows: usize,
    kv_heads: usize,
    head: usize,
}

impl RingCursor<'_> {
    /// The ring entry of position `pos >= first`.
    #[inline(always)]
    fn entry(&self, pos: usize) -> usize {
        let mut row = self.first_row + (pos - self.first);
        while row >= self.rows {
            row -= self.rows;
        }
        row * self.kv_heads + self.head
    }

    /// Decodes ring row `pos` (K or V) into `out`, in the staging frame.
    #[inline(always)]
    pub(crate) fn row(&self, pos: usize, value: bool, out: &mut [f32]) {
        let rows = &self.layer.rows;
        let range = rows.range(self.entry(pos), value);
        rows.side(value).decode(&self.layer.ring[range], out);
    }

    /// The ring entry of position `pos`: its K row, then its V row.
    #[inline(always)]
    pub(crate) fn entry_bytes(&self, pos: usize) -> &[u8] {
        let rows = &self.layer.rows;
        let entry = self.entry(pos);
        let (k, v) = (rows.range(entry, false), rows.range(entry, true));
        &self.layer.ring[k.start..v.end]
    }

    /// Hints the cache to fetch position `pos` (its K and V rows are adjacent): ring rows of
    /// one head are a whole token apart, too far apart for the hardware's own stride prefetch
    /// to keep up, so the attention loop asks a few positions ahead.
    #[inline(always)]
    pub(crate) fn prefetch(&self, pos: usize) {
        let (rows, entry) = (&self.layer.rows, self.entry(pos));
        let (k, v) = (rows.range(entry, false), rows.range(entry, true));
        prefetch_l2(&self.layer.ring[k.start..v.end]);
    }
}

impl Sequence {
    #[inline(always)]
    pub(super) fn ring_index(&self, pos: usize) -> usize {
        (pos - self.config.sink) % self.config.ring_rows()
    }

    #[inline(always)]
    pub(super) fn ring_row_range(
        &self,
        layer: &LayerJournal,
        pos: usize,
        head: usize,
        value: bool,
    ) -> std::ops::Range<usize> {
        let entry = self.ring_index(pos) * self.config.kv_heads + head;
        layer.rows.range(entry, value)
    }

    /// The ring rows of `head` from position `first` on, addressed by counting from `first`'s
    /// row instead of a division per row (attention reads thousands of rows per call).
    pub(crate) fn ring_cursor<'a>(
        &self,
        layer: &'a LayerJournal,
        first: usize,
        head: usize,
    ) -> RingCursor<'a> {
        RingCursor {
            layer,
            first,
            first_row: self.ring_index(first),
            rows: self.config.ring_rows(),
            kv_heads: self.config.kv_heads,
            head,
        }
    }

    /// Decodes ring row `pos` of `head` (K or V) into `out`, in the staging frame.
    #[inline(always)]
    pub(crate) fn ring_row(
        &self,
        layer: &LayerJournal,
        pos: usize,
        head: usize,
        value: bool,
        out: &mut [f32],
    ) {
        layer.rows.side(value).decode(
            &layer.ring[self.ring_row_range(layer, pos, head, value)],
            out,
        );
    }
}
