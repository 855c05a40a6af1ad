//! The rotated queries of a KV head's group and the per-thread scratch the region folds write
//! into, kept between calls so a decode step allocates nothing.

use super::fragment_dots::{FragmentKernel, FragmentScratch};
use super::ring_tq6::{FixedQueries, RingKernel};
use super::tile_gemm::MAX_ROWS;
use super::word_dots::{WordKernel, WordScratch};
use crate::backend::cpu::exact_window::ExactWindow;
use crate::codec::extension::body::{DecodedHalf, GROUP};
use crate::codec::{BodyCodec, HalfReader};
use crate::simd::SimdLevel;
use std::cell::RefCell;

/// The rotated query rows of one KV head's group, `[pairs][d]`. Pair `p` is query row
/// `p / gs`, head `p % gs` of the group.
pub(crate) struct Queries<'a> {
    pub(crate) rotated: &'a [f32],
    pub(crate) gs: usize,
    pub(crate) d: usize,
    /// Position of query row 0.
    pub(crate) base: usize,
    pub(crate) scale: f32,
    pub(crate) kv_head: usize,
    /// The layer's exact window and its width (0: off): the positions each query reads from
    /// it are hidden from the blocks.
    pub(crate) window: &'a ExactWindow,
    pub(crate) width: usize,
    /// The instruction set the arithmetic kernel runs on.
    pub(crate) level: SimdLevel,
    /// The integer kernel of 4-bit fragment sides (every one gives the same bits).
    pub(crate) fragments: FragmentKernel,
    /// The integer kernel of `tq6_0` ring keys (every one gives the same bits).
    pub(crate) ring: RingKernel,
    /// The integer kernel of trellis sides (every one gives the same bits).
    pub(crate) words: WordKernel,
}

impl Queries<'_> {
    /// The rotated queries of pairs `p..`, `d` apart.
    pub(crate) fn rows_from(&self, p: usize) -> &[f32] {
        &self.rotated[p * self.d..]
    }

    pub(crate) fn query(&self, p: usize) -> &[f32] {
        &self.rotated[p * self.d..(p + 1) * self.d]
    }

    /// Visible positions of each pair of `pairs` (at most `PAIRS`) in a block, without
    /// allocating: this runs once per block and pair block.
    pub(crate) fn visible_all(
        &self,
        pairs: std::ops::Range<usize>,
        first: usize,
        rows: usize,
    ) -> ([usize; PAIRS], usize) {
        let mut out = [0usize; PAIRS];
        let np = pairs.len();
        for (o, p) in out.iter_mut().zip(pairs) {
            *o = self.visible(p, first, rows);
        }
        (out, np)
    }

    /// Positions of a block of `rows` starting at `first` visible to pair `p`'s query row:
    /// those up to its own, before the ones it reads from the exact window.
    pub(crate) fn visible(&self, p: usize, first: usize, rows: usize) -> usize {
        self.window
            .exact_from(self.width, self.base + p / self.gs)
            .saturating_sub(first)
            .min(rows)
    }
}

/// Per-task buffers, reused block after block.
pub(crate) struct Scratch {
    /// `[PAIRS][GROUP]` logits, softmax weights and key partial sums.
    pub(crate) logits: Vec<f32>,
    pub(crate) weights: Vec<f32>,
    pub(crate) part_k: Vec<f32>,
    /// `[PAIRS][d]` value partial sums.
    pub(crate) part_v: Vec<f32>,
    /// `[PAIRS][inner]`: the left operand of a product (per-pair query or weight rows).
    pub(crate) a_rows: Vec<f32>,
    /// `[GROUP][d]` dense rows of a sink or ring block.
    pub(crate) kblk: Vec<f32>,
    pub(crate) vblk: Vec<f32>,
    pub(crate) halves: Vec<DecodedHalf>,
    pub(crate) fragments: FragmentScratch,
    pub(crate) ring_queries: FixedQueries,
    pub(crate) words: WordScratch,
}

impl Scratch {
    pub(crate) fn new(d: usize, r: usize) -> Self {
        Self {
            logits: vec![0.0; PAIRS * GROUP],
            weights: vec![0.0; PAIRS * GROUP],
            part_k: vec![0.0; PAIRS * GROUP],
            part_v: vec![0.0; PAIRS * d.max(r)],
            a_rows: vec![0.0; PAIRS * d.max(r).max(GROUP)],
            kblk: vec![0.0; GROUP * d],
            vblk: vec![0.0; GROUP * d],
            halves: Vec::new(),
            fragments: FragmentScratch::default(),
            ring_queries: FixedQueries::default(),
            words: WordScratch::default(),
        }
    }
}

/// One participant's buffers and record reader, kept by its thread between calls: building
/// them afresh on every call cost allocations, zeroing and page faults (the dense blocks alone
/// are 256 KiB at head_dim 256), a visible share of a short decode call. Each thread keeps at
/// most one, for the geometry it last served.
pub(crate) struct Workspace {
    pub(crate) d: usize,
    pub(crate) r: usize,
    pub(crate) scratch: Scratch,
    pub(crate) reader: HalfReader,
}

/// A workspace on loan from the thread's spare (or new, where the spare serves another
/// geometry or is already on loan), handed back to the thread when dropped. Every buffer is
/// written before it is read, block by block, so a reused workspace gives the same bits.
pub(crate) struct Lease(Option<Workspace>);

impl Lease {
    pub(crate) fn take(codec: &BodyCodec, d: usize, r: usize) -> Self {
        let spare = SPARE.with(|s| s.borrow_mut().take());
        let ws = match spare {
            Some(w) if w.d == d && w.r == r && w.reader.serves(codec) => w,
            _ => Workspace {
                d,
                r,
                scratch: Scratch::new(d, r),
                reader: codec.half_reader(),
            },
        };
        Lease(Some(ws))
    }

    pub(crate) fn parts(&mut self) -> (&mut Scratch, &mut HalfReader) {
        let ws = self
            .0
            .as_mut()
            .expect("a lease holds its workspace until dropped");
        (&mut ws.scratch, &mut ws.reader)
    }
}

/// Largest rounded-query buffer a kept workspace holds on to: a decode call's is a few KiB,
/// a 4,096-row prefill's about 12 MiB per thread.
pub(crate) const KEPT_QUERY_BYTES: usize = 1 << 20;

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(mut ws) = self.0.take() {
            ws.scratch.ring_queries.trim(KEPT_QUERY_BYTES);
            // During thread teardown the slot may be gone; the workspace is then just freed.
            let _ = SPARE.try_with(|s| *s.borrow_mut() = Some(ws));
        }
    }
}

/// Query (row, head) pairs scored together against one block: each K/V element loaded is
/// used by all of them, and their scratch (a few KiB) stays in L1.
pub(crate) const PAIRS: usize = MAX_ROWS;

thread_local! {
    static SPARE: RefCell<Option<Workspace>> = const { RefCell::new(None) };
}
