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

/// Whether a ring value sum's operands fit: `m` query pairs (at most [`MAX_ROWS`]) whose
/// weights (`weights = (w, ldw)`) cover `n` rows, each row at least `row_end` bytes long,
/// `d` values (a multiple of `block`) per output row, outputs `(len, ldo)`.
#[allow(clippy::too_many_arguments)]
fn value_operands_fit(
    d: usize,
    block: usize,
    m: usize,
    (w, ldw): (&[f32], usize),
    rows: &[&[u8]],
    row_end: usize,
    n: usize,
    (out_len, ldo): (usize, usize),
) -> bool {
    m <= MAX_ROWS
        && d.is_multiple_of(block)
        && n <= rows.len()
        && rows[..n].iter().all(|r| r.len() >= row_end)
        && (m == 0 || (w.len() >= (m - 1) * ldw + n && out_len >= (m - 1) * ldo + d))
}

mod fragment_dots;
mod online_softmax;
mod paged;
mod prefill;
mod ring_q8;
mod ring_tq6;
pub(crate) mod tile_gemm;
mod word_dots;

use crate::cache::exact_window::ExactWindow;
use crate::cache::sequence::{LayerJournal, Sequence};
use crate::cache::{CacheError, CacheResult, Staging};
use crate::codec::extension::body::{DecodedHalf, GROUP};
use crate::codec::rotation::rotate_heads as rotate_rows;
use crate::codec::{BodyCodec, HalfReader};
use crate::error::check_finite;
use crate::parallel::run_items;
use crate::simd::{simd_level, Ahead, SimdLevel};
use fragment_dots::{fragment_products, FragmentKernel, FragmentScratch, TileGrid, TILE};
use half::slice::HalfFloatSliceExt;
use online_softmax::{merge_states, pairwise, Softmax};
use ring_q8::q8_value_sums;
use ring_tq6::{key_scores, value_sums, FixedQueries, RingKernel};
use std::cell::RefCell;
use tile_gemm::{dot, dots, product, product_from, MAX_ROWS};
use word_dots::{word_products, WordKernel, WordScratch, WordSum};

pub use paged::{attend_paged, PagedBlock};

/// Positions per split-K chunk: the unit of parallel work along the context. Fixed (never
/// derived from the thread count or the call), so results do not depend on scheduling.
const CHUNK: usize = 16 * GROUP;

/// Least work (query rows x cached positions x query heads x head width) worth a second
/// thread. Below it the caller runs every item alone: waking a pool worker that went to sleep
/// since the last call (as it does while a model runs its other layers) costs tens of
/// microseconds in a virtual machine, and the call waits for it even when it comes too late to
/// take an item. Measured on a 2-vCPU guest (`attend_decode --paired 2 --evict-mb 4`, so the
/// worker sleeps between calls), 2 threads against 1: 9q/3kv/64 0.80x at 1,024 positions,
/// 0.99x at 2,048, 1.25x at 3,072; 24q/4kv/256 1.14x at 256, 1.31x at 512.
const PARALLEL_MIN_WORK: usize = 1280 * 1024;

/// The thread limit a call of `work` (see [`PARALLEL_MIN_WORK`]) runs under: the caller's
/// `limit`, or the calling thread alone for a call too small to gain from more.
fn thread_limit(work: usize, limit: Option<usize>) -> Option<usize> {
    if work < PARALLEL_MIN_WORK {
        Some(1)
    } else {
        limit
    }
}

/// Largest total of partial softmax states (bytes) for which every (head, chunk) item runs in
/// parallel; above it (long prefill chunks) each head runs its chunks in order.
const PARALLEL_STATE_BYTES: usize = 32 << 20;

/// What every work item of one call reads.
struct Job<'a> {
    seq: &'a Sequence,
    lj: &'a LayerJournal,
    codec: &'a BodyCodec,
    d: usize,
    r: usize,
    kvh: usize,
    sink: usize,
    /// Query (row, head) pairs per KV head: rows x group size.
    pairs: usize,
}

/// Folds split-K chunk `chunk` (positions `[chunk * CHUNK, (chunk + 1) * CHUNK)`) of KV head
/// `ctx.kv_head` into `states`, compiled for `level`.
fn fold_chunk_at(
    level: SimdLevel,
    job: &Job,
    ctx: &Queries,
    chunk: usize,
    states: &mut [Softmax],
    sc: &mut Scratch,
    reader: &mut HalfReader,
) -> CacheResult<()> {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` is only ever chosen by `detected_level` (or a test that checked it)
        // after the CPU reported every feature this function is compiled with.
        SimdLevel::Avx512 => unsafe { fold_chunk_avx512(job, ctx, chunk, states, sc, reader) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 and FMA.
        SimdLevel::Avx2 => unsafe { fold_chunk_avx2(job, ctx, chunk, states, sc, reader) },
        _ => fold_chunk_body(job, ctx, chunk, states, sc, reader),
    }
}

/// `fold_chunk_body` compiled for one instruction set (the body is inlined into it).
macro_rules! fold_chunk_for {
    ($name:ident, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name(
            job: &Job,
            ctx: &Queries,
            chunk: usize,
            states: &mut [Softmax],
            sc: &mut Scratch,
            reader: &mut HalfReader,
        ) -> CacheResult<()> {
            fold_chunk_body(job, ctx, chunk, states, sc, reader)
        }
    };
}

fold_chunk_for!(
    fold_chunk_avx512,
    "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"
);
fold_chunk_for!(fold_chunk_avx2, "avx2,fma");

/// The blocks of one chunk, in position order: sink blocks, body records, ring blocks (each
/// block belongs to the chunk holding its first position). Inlined into each SIMD level.
#[inline(always)]
fn fold_chunk_body(
    job: &Job,
    ctx: &Queries,
    chunk: usize,
    states: &mut [Softmax],
    sc: &mut Scratch,
    reader: &mut HalfReader,
) -> CacheResult<()> {
    let (lj, d, kvh, h) = (job.lj, job.d, job.kvh, ctx.kv_head);
    let span = chunk * CHUNK..(chunk + 1) * CHUNK;
    let blocks = (0..job.pairs)
        .step_by(PAIRS)
        .map(|p| p..(p + PAIRS).min(job.pairs));

    // Sink (rotated fp16), in blocks of at most 128 positions.
    let sink_rows = lj.len.min(job.sink);
    let mut first = 0;
    while first < sink_rows {
        let rows = (sink_rows - first).min(GROUP);
        if span.contains(&first) {
            for t in 0..rows {
                let at = ((first + t) * kvh + h) * d;
                let (kr, vr) = (&lj.scored_sink_k()[at..at + d], &lj.sink_v[at..at + d]);
                // The slice conversion runs on F16C where present (one check per row).
                kr.convert_to_f32_slice(&mut sc.kblk[t * d..(t + 1) * d]);
                vr.convert_to_f32_slice(&mut sc.vblk[t * d..(t + 1) * d]);
            }
            for pairs in blocks.clone() {
                fold_dense(
                    ctx,
                    states,
                    pairs,
                    first,
                    rows,
                    sc,
                    GROUP,
                    None,
                    |_, _, _| {},
                );
            }
        }
        first += rows;
    }

    // Body records (rotated frame, absorbed scales), each read once.
    let rb = job.codec.record_bytes();
    // Each record is fetched from the pool once; the next one is prefetched meanwhile.
    let mut records = lj
        .blocks
        .iter()
        .enumerate()
        .map(|(g, &slot)| (job.sink + g * GROUP, slot))
        .skip_while(|(first, _)| *first < span.start)
        .take_while(|(first, _)| *first < span.end)
        .peekable();
    let pool = job.seq.pool();
    let mut current = records.peek().map(|&(_, slot)| pool.get(slot));
    while let (Some((first, _)), Some(bytes)) = (records.next(), current.take()) {
        let next = records.peek().map(|&(_, slot)| pool.get(slot));
        // The next record is fetched into L2 a line per kernel step while this one is scored.
        let mut ahead = Ahead::new(next.as_ref().map_or(&[][..], |n| &n[h * rb..(h + 1) * rb]));
        let rec = &bytes[h * rb..(h + 1) * rb];
        reader.read(rec, &mut sc.halves)?;
        for pairs in blocks.clone() {
            fold_record(ctx, states, pairs, first, job.r, rec, sc, &mut ahead);
        }
        ahead.finish();
        current = next;
    }

    // Ring, in blocks aligned to 128 positions. With one pair block (decoding) rows are
    // decoded piece by piece as they are scored, so they stay in L1; with several (prefill)
    // the block is decoded once and shared by all of them. Both give the same bits. `tq6_0`
    // keys are scored from their codes ([`key_scores`]), `tq6_0` and `q8_0` values summed from
    // theirs ([`value_sums`], [`q8_value_sums`]): never decoded.
    let ring = job.seq.ring_cursor(lj, lj.ring_start(job.sink), h);
    let (coded_keys, coded_values) = (
        lj.rows.k.staging == Staging::Tq6,
        matches!(lj.rows.v.staging, Staging::Tq6 | Staging::Q8_0),
    );
    if coded_keys && lj.ring_start(job.sink).max(span.start) < lj.len.min(span.end) {
        // Every query pair in fixed point, once per chunk.
        sc.ring_queries.prepare(ctx.rotated, d, job.pairs, d);
    }
    let ring_row = |pos: usize, value: bool, out: &mut [f32]| {
        if pos + RING_AHEAD < lj.len && !value {
            ring.prefetch(pos + RING_AHEAD);
        }
        ring.row(pos, value, out);
    };
    let mut entries: [&[u8]; GROUP + RING_AHEAD] = [&[]; GROUP + RING_AHEAD];
    let mut first = lj.ring_start(job.sink);
    while first < lj.len {
        let rows = (lj.len - first).min(GROUP);
        if !span.contains(&first) {
            first += rows;
            continue;
        }
        let coded = if coded_keys || coded_values {
            let ahead = (lj.len - first).min(GROUP + RING_AHEAD);
            for (t, e) in entries[..ahead].iter_mut().enumerate() {
                *e = ring.entry_bytes(first + t);
            }
            Some(CodedRows {
                entries: &entries[..ahead],
                keys: coded_keys,
                values: coded_values.then(|| (lj.rows.k.row_bytes(), lj.rows.v.staging)),
            })
        } else {
            None
        };
        let coded = coded.as_ref();
        if job.pairs <= PAIRS {
            let piece = (4096 / d).clamp(16, GROUP);
            let fill = |t0: usize, value: bool, out: &mut [f32]| {
                for (t, row) in out.chunks_exact_mut(d).enumerate() {
                    ring_row(first + t0 + t, value, row);
                }
            };
            fold_dense(
                ctx,
                states,
                0..job.pairs,
                first,
                rows,
                sc,
                piece,
                coded,
                fill,
            );
        } else {
            for t in 0..rows {
                if !coded_keys {
                    ring_row(first + t, false, &mut sc.kblk[t * d..(t + 1) * d]);
                }
                if !coded_values {
                    ring_row(first + t, true, &mut sc.vblk[t * d..(t + 1) * d]);
                }
            }
            for pairs in blocks.clone() {
                fold_dense(
                    ctx,
                    states,
                    pairs,
                    first,
                    rows,
                    sc,
                    GROUP,
                    coded,
                    |_, _, _| {},
                );
            }
        }
        first += rows;
    }
    Ok(())
}

/// The ring entries (K row, then V row) of a block whose `tq6_0` keys and/or `tq6_0` or
/// `q8_0` values are read from their codes ([`key_scores`], [`value_sums`],
/// [`q8_value_sums`]) instead of decoded; entries past the block's rows are only fetched ahead.
struct CodedRows<'a> {
    entries: &'a [&'a [u8]],
    keys: bool,
    /// Where the value row starts in an entry and its staging, when values are coded.
    values: Option<(usize, Staging)>,
}

/// Ring positions fetched ahead of the one being decoded.
const RING_AHEAD: usize = 8;

/// Query (row, head) pairs scored together against one block: each K/V element loaded is
/// used by all of them, and their scratch (a few KiB) stays in L1.
const PAIRS: usize = MAX_ROWS;

/// The rotated query rows of one KV head's group, `[pairs][d]`. Pair `p` is query row
/// `p / gs`, head `p % gs` of the group.
struct Queries<'a> {
    rotated: &'a [f32],
    gs: usize,
    d: usize,
    /// Position of query row 0.
    base: usize,
    scale: f32,
    kv_head: usize,
    /// The layer's exact window and its width (0: off): the positions each query reads from
    /// it are hidden from the blocks.
    window: &'a ExactWindow,
    width: usize,
    /// The instruction set the arithmetic kernel runs on.
    level: SimdLevel,
    /// The integer kernel of 4-bit fragment sides (every one gives the same bits).
    fragments: FragmentKernel,
    /// The integer kernel of `tq6_0` ring keys (every one gives the same bits).
    ring: RingKernel,
    /// The integer kernel of trellis sides (every one gives the same bits).
    words: WordKernel,
}

impl Queries<'_> {
    /// The rotated queries of pairs `p..`, `d` apart.
    fn rows_from(&self, p: usize) -> &[f32] {
        &self.rotated[p * self.d..]
    }

    fn query(&self, p: usize) -> &[f32] {
        &self.rotated[p * self.d..(p + 1) * self.d]
    }

    /// Visible positions of each pair of `pairs` (at most `PAIRS`) in a block, without
    /// allocating: this runs once per block and pair block.
    fn visible_all(
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
    fn visible(&self, p: usize, first: usize, rows: usize) -> usize {
        self.window
            .exact_from(self.width, self.base + p / self.gs)
            .saturating_sub(first)
            .min(rows)
    }
}

/// Per-task buffers, reused block after block.
struct Scratch {
    /// `[PAIRS][GROUP]` logits, softmax weights and key partial sums.
    logits: Vec<f32>,
    weights: Vec<f32>,
    part_k: Vec<f32>,
    /// `[PAIRS][d]` value partial sums.
    part_v: Vec<f32>,
    /// `[PAIRS][inner]`: the left operand of a product (per-pair query or weight rows).
    a_rows: Vec<f32>,
    /// `[GROUP][d]` dense rows of a sink or ring block.
    kblk: Vec<f32>,
    vblk: Vec<f32>,
    halves: Vec<DecodedHalf>,
    fragments: FragmentScratch,
    ring_queries: FixedQueries,
    words: WordScratch,
}

/// One participant's buffers and record reader, kept by its thread between calls: building
/// them afresh on every call cost allocations, zeroing and page faults (the dense blocks alone
/// are 256 KiB at head_dim 256), a visible share of a short decode call. Each thread keeps at
/// most one, for the geometry it last served.
struct Workspace {
    d: usize,
    r: usize,
    scratch: Scratch,
    reader: HalfReader,
}

thread_local! {
    static SPARE: RefCell<Option<Workspace>> = const { RefCell::new(None) };
}

/// A workspace on loan from the thread's spare (or new, where the spare serves another
/// geometry or is already on loan), handed back to the thread when dropped. Every buffer is
/// written before it is read, block by block, so a reused workspace gives the same bits.
struct Lease(Option<Workspace>);

impl Lease {
    fn take(codec: &BodyCodec, d: usize, r: usize) -> Self {
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

    fn parts(&mut self) -> (&mut Scratch, &mut HalfReader) {
        let ws = self
            .0
            .as_mut()
            .expect("a lease holds its workspace until dropped");
        (&mut ws.scratch, &mut ws.reader)
    }
}

/// Largest rounded-query buffer a kept workspace holds on to: a decode call's is a few KiB,
/// a 4,096-row prefill's about 12 MiB per thread.
const KEPT_QUERY_BYTES: usize = 1 << 20;

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(mut ws) = self.0.take() {
            ws.scratch.ring_queries.trim(KEPT_QUERY_BYTES);
            // During thread teardown the slot may be gone; the workspace is then just freed.
            let _ = SPARE.try_with(|s| *s.borrow_mut() = Some(ws));
        }
    }
}

impl Scratch {
    fn new(d: usize, r: usize) -> Self {
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

/// Folds a block of dense rotated rows into the states of `pairs`, `piece` rows at a time:
/// `fill(t0, value, out)` writes the block's K (or V) rows `t0..` into `out` (`[n][d]`, the
/// start of `sc.kblk` or `sc.vblk`); a block decoded beforehand passes `piece = GROUP` and a
/// `fill` that does nothing. Every sum keeps its order, so `piece` does not change the bits.
/// `coded`: a ring block whose `tq6_0` sides are read from their codes instead of `fill`ed.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
fn fold_dense(
    ctx: &Queries,
    states: &mut [Softmax],
    pairs: std::ops::Range<usize>,
    first: usize,
    rows: usize,
    sc: &mut Scratch,
    piece: usize,
    coded: Option<&CodedRows>,
    mut fill: impl FnMut(usize, bool, &mut [f32]),
) {
    let d = ctx.d;
    let (visible, np) = ctx.visible_all(pairs.clone(), first, rows);
    let most = visible[..np].iter().copied().max().unwrap_or(0);
    if most == 0 {
        return;
    }
    let queries = ctx.rows_from(pairs.start);
    if let Some(coded) = coded.filter(|c| c.keys) {
        let (fq, out) = (&sc.ring_queries, &mut sc.logits);
        key_scores(
            ctx.ring,
            fq,
            pairs.start,
            np,
            coded.entries,
            most,
            out,
            GROUP,
        );
    } else {
        for t0 in (0..most).step_by(piece) {
            let n = piece.min(most - t0);
            fill(t0, false, &mut sc.kblk[..n * d]);
            dots(
                ctx.level,
                np,
                queries,
                d,
                &sc.kblk,
                d,
                d,
                n,
                &mut sc.logits[t0..],
                GROUP,
            );
        }
    }
    let mut live = [false; PAIRS];
    for (slot, p) in pairs.clone().enumerate() {
        let lg = &mut sc.logits[slot * GROUP..(slot + 1) * GROUP];
        for l in lg[..visible[slot]].iter_mut() {
            *l *= ctx.scale;
        }
        let w = &mut sc.weights[slot * GROUP..(slot + 1) * GROUP];
        live[slot] = states[p].fold(lg, visible[slot], w);
    }
    // Weights past a pair's visible positions (all of them for a dead pair) are zero.
    for slot in 0..np {
        let seen = if live[slot] { visible[slot] } else { 0 };
        sc.weights[slot * GROUP + seen..slot * GROUP + most].fill(0.0);
    }
    if let Some((entries, (offset, staging))) = coded.and_then(|c| Some((c.entries, c.values?))) {
        let (w, out) = (&sc.weights, &mut sc.part_v);
        let sums = if staging == Staging::Q8_0 {
            q8_value_sums
        } else {
            value_sums
        };
        sums(
            ctx.ring, d, w, GROUP, np, entries, offset, most, out, d, false,
        );
    } else {
        for t0 in (0..most).step_by(piece) {
            let n = piece.min(most - t0);
            fill(t0, true, &mut sc.vblk[..n * d]);
            let (w, v, out) = (&sc.weights[t0..], &sc.vblk, &mut sc.part_v);
            product_from(ctx.level, np, w, GROUP, v, d, n, d, out, d, t0 > 0);
        }
    }
    for (slot, p) in pairs.enumerate() {
        if live[slot] {
            let part = &sc.part_v[slot * d..(slot + 1) * d];
            for (a, &x) in states[p].acc.iter_mut().zip(part) {
                *a += x;
            }
        }
    }
}

/// Folds one body record (`rec`, its absorbed-scale halves in `sc.halves`) into the states of
/// `pairs`: `logit[t] = s_K[t] (sum_c (q'_c a_K[c]) u[c,t] + sum_c q'_c z_K[c])` and
/// `acc[c] += s_V[c] (sum_t w_t a_V[t] u[t,c] + sum_t w_t z_V[t])`, each sum in ascending order,
/// or, for 4-bit sides read in place, exact in fixed point ([`fragment_products`]).
// Slots index several per-pair arrays in step; index loops say that more plainly than zips.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
fn fold_record(
    ctx: &Queries,
    states: &mut [Softmax],
    pairs: std::ops::Range<usize>,
    first: usize,
    r: usize,
    rec: &[u8],
    sc: &mut Scratch,
    ahead: &mut Ahead,
) {
    let (visible, np) = ctx.visible_all(pairs.clone(), first, GROUP);
    if visible[..np].iter().all(|&v| v == 0) {
        return;
    }
    sc.logits[..np * GROUP].fill(0.0);
    for (half, hd) in sc.halves.iter().enumerate() {
        let mut offset = [0.0f32; PAIRS];
        for (slot, p) in pairs.clone().enumerate() {
            let q = &ctx.query(p)[half * r..(half + 1) * r];
            let qa = &mut sc.a_rows[slot * r..(slot + 1) * r];
            for ((o, &qc), &a) in qa.iter_mut().zip(q).zip(&hd.a_k) {
                *o = qc * a;
            }
            offset[slot] = dot(q, &hd.z_k);
        }
        let (a, out) = (&sc.a_rows, &mut sc.part_k);
        if let Some([step, _]) = hd.word_steps {
            let (words, ws) = (&hd.k_words, &mut sc.words);
            word_products(
                ctx.words,
                WordSum::Keys,
                np,
                a,
                r,
                words,
                r,
                step,
                ws,
                out,
                GROUP,
                ahead,
            );
        } else if let Some(range) = &hd.k_fragments {
            // Columns: token tiles (a row of channel tiles apart); rows: channel tiles.
            let grid = TileGrid {
                cols: GROUP / TILE,
                rows: r / TILE,
                col_stride: r / TILE,
                row_stride: 1,
            };
            let (payload, fs) = (&rec[range.clone()], &mut sc.fragments);
            fragment_products(
                ctx.fragments,
                payload,
                grid,
                np,
                a,
                r,
                fs,
                out,
                GROUP,
                ahead,
            );
        } else {
            product(
                ctx.level,
                np,
                a,
                r,
                &hd.k_units,
                GROUP,
                r,
                GROUP,
                out,
                GROUP,
            );
        }
        for slot in 0..np {
            let lg = &mut sc.logits[slot * GROUP..(slot + 1) * GROUP];
            let part = &sc.part_k[slot * GROUP..(slot + 1) * GROUP];
            for ((l, &s), &pk) in lg.iter_mut().zip(&hd.s_k).zip(part) {
                *l += s * (pk + offset[slot]);
            }
        }
    }
    let mut live = [false; PAIRS];
    for (slot, p) in pairs.clone().enumerate() {
        let lg = &mut sc.logits[slot * GROUP..(slot + 1) * GROUP];
        for l in lg[..visible[slot]].iter_mut() {
            *l *= ctx.scale;
        }
        let w = &mut sc.weights[slot * GROUP..(slot + 1) * GROUP];
        live[slot] = states[p].fold(lg, visible[slot], w);
    }
    let most = (0..np)
        .filter(|&s| live[s])
        .map(|s| visible[s])
        .max()
        .unwrap_or(0);
    if most == 0 {
        return;
    }
    for (half, hd) in sc.halves.iter().enumerate() {
        // Rows w_t a_V[t] (0 past the pair's visible positions), offsets sum_t w_t z_V[t].
        // Trellis words take whole rows; fragment tiles, rows to a 16-token step.
        let inner = if hd.word_steps.is_some() {
            GROUP
        } else if hd.v_fragments.is_some() {
            most.next_multiple_of(TILE)
        } else {
            most
        };
        let mut offset = [0.0f32; PAIRS];
        for slot in 0..np {
            let seen = if live[slot] { visible[slot] } else { 0 };
            let w = &sc.weights[slot * GROUP..slot * GROUP + seen];
            let wa = &mut sc.a_rows[slot * GROUP..slot * GROUP + inner];
            for ((o, &wt), &a) in wa.iter_mut().zip(w).zip(&hd.a_v) {
                *o = wt * a;
            }
            wa[seen..].fill(0.0);
            offset[slot] = dot(w, &hd.z_v[..seen]);
        }
        if let Some([_, step]) = hd.word_steps {
            let (a, words, out, ws) = (&sc.a_rows, &hd.v_words, &mut sc.part_v, &mut sc.words);
            word_products(
                ctx.words,
                WordSum::Values,
                np,
                a,
                GROUP,
                words,
                r,
                step,
                ws,
                out,
                r,
                ahead,
            );
        } else if let Some(range) = &hd.v_fragments {
            // Columns: channel tiles; rows: the token tiles up to the last visible token.
            let grid = TileGrid {
                cols: r / TILE,
                rows: inner / TILE,
                col_stride: 1,
                row_stride: r / TILE,
            };
            let (payload, fs) = (&rec[range.clone()], &mut sc.fragments);
            let (a, out) = (&sc.a_rows, &mut sc.part_v);
            fragment_products(
                ctx.fragments,
                payload,
                grid,
                np,
                a,
                GROUP,
                fs,
                out,
                r,
                ahead,
            );
        } else {
            let (a, b, out) = (&sc.a_rows, &hd.v_units, &mut sc.part_v);
            product(ctx.level, np, a, GROUP, b, r, inner, r, out, r);
        }
        for (slot, p) in pairs.clone().enumerate() {
            if !live[slot] {
                continue;
            }
            let acc = &mut states[p].acc[half * r..(half + 1) * r];
            let part = &sc.part_v[slot * r..(slot + 1) * r];
            for ((x, &s), &pv) in acc.iter_mut().zip(&hd.s_v).zip(part) {
                *x += s * (pv + offset[slot]);
            }
        }
    }
}

/// Attention of `n` query rows `q` (`[n][q_heads][head_dim]`, model frame, post-RoPE) over
/// `layer`. Row `i` sits at position `len - n + i` and sees positions up to its own. Scores use
/// `scale` (default `1/sqrt(head_dim)`). Returns `[n][q_heads][head_dim]`.
pub fn attend(
    seq: &Sequence,
    layer: usize,
    q: &[f32],
    scale: Option<f32>,
) -> CacheResult<Vec<f32>> {
    attend_at(simd_level(), seq, layer, q, scale, None)
}

/// [`attend`] on at most `threads` threads (the caller and rayon's workers; never more than
/// the pool has): `Some(1)` runs on the calling thread alone. For a server that shares its
/// cores between attention and other work, and for benchmarks that compare thread counts
/// side by side in one process. The result is the same for every thread count. Calls too small
/// to gain from a second thread (under about 2,300 cached positions at 9 query heads of 64, 210
/// at 24 of 256: `PARALLEL_MIN_WORK`) run on the caller alone whatever the limit.
pub fn attend_with_threads(
    seq: &Sequence,
    layer: usize,
    q: &[f32],
    scale: Option<f32>,
    threads: Option<usize>,
) -> CacheResult<Vec<f32>> {
    if threads == Some(0) {
        return Err(crate::CodecError::InvalidSetting("threads must be at least 1".into()).into());
    }
    attend_at(simd_level(), seq, layer, q, scale, threads)
}

/// [`attend`] with the hot loops compiled for `level` (at most the detected level), on at
/// most `threads` threads.
fn attend_at(
    level: SimdLevel,
    seq: &Sequence,
    layer: usize,
    q: &[f32],
    scale: Option<f32>,
    threads: Option<usize>,
) -> CacheResult<Vec<f32>> {
    let cfg = seq.config();
    let (qh, kvh, d) = (cfg.q_heads, cfg.kv_heads, cfg.head_dim);
    let lj = seq.layer(layer)?;
    if !q.len().is_multiple_of(qh * d) || q.is_empty() {
        return Err(CacheError::Shape {
            what: "attend q",
            expected: format!("[tokens, {qh}, {d}]"),
            got: format!("{} values", q.len()),
        });
    }
    let n = q.len() / (qh * d);
    if n > lj.len {
        return Err(CacheError::Position {
            position: n,
            len: lj.len,
        });
    }
    check_finite(q)?;
    if let Some(s) = scale {
        if !s.is_finite() {
            return Err(crate::CodecError::InvalidSetting(format!(
                "scale must be finite, got {s}"
            ))
            .into());
        }
    }
    let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
    let gs = cfg.group_size();
    let by_head = rotated_by_head(q, qh, kvh, d, scale)?;
    let base = lj.len - n;
    let codec = cfg.body_codec(layer)?;
    let r = codec.half_width();

    let job = Job {
        seq,
        lj,
        codec: &codec,
        d,
        r,
        kvh,
        sink: cfg.sink,
        pairs: n * gs,
    };
    // Work items are (KV head, split-K chunk of CHUNK positions). The chunking is fixed by
    // position, never by the thread count or the number of query rows, and the partial states
    // are merged in chunk order, so every query row's result is the same however the work is
    // scheduled. Small calls (decode) run every item in parallel and merge afterwards; large
    // ones (prefill, whose states are large) run one task per head over its chunks in order.
    let threads = thread_limit(n * lj.len * qh * d, threads);
    if n >= prefill::MIN_ROWS && cfg.exact_recent == 0 {
        let out = prefill::Prefill {
            job: &job,
            rotated: &by_head,
            n,
            gs,
            qh,
            base,
            scale,
            level,
        }
        .run(threads)?;
        if out.iter().any(|x| !x.is_finite()) {
            return Err(score_overflow(q, d, scale));
        }
        return Ok(out);
    }
    let chunks = lj.len.div_ceil(CHUNK);
    let head_len = n * gs * d;
    let ctx_of = |h: usize| Queries {
        rotated: &by_head[h * head_len..(h + 1) * head_len],
        gs,
        d,
        base,
        scale,
        kv_head: h,
        window: &lj.window,
        width: cfg.exact_recent,
        level,
        fragments: FragmentKernel::for_level(level),
        ring: RingKernel::for_level(level),
        words: WordKernel::for_level(level),
    };
    let state_bytes = n * gs * d * 4;
    let per_head: Vec<CacheResult<Vec<Softmax>>> =
        if state_bytes * chunks * kvh <= PARALLEL_STATE_BYTES {
            // One item per (head, chunk), head-major; the caller works on them too.
            let parts: Vec<CacheResult<Vec<Softmax>>> = run_items(
                kvh * chunks,
                threads,
                || Lease::take(&codec, d, r),
                |lease, item| {
                    let (h, c) = (item / chunks, item % chunks);
                    let (sc, reader) = lease.parts();
                    let mut states = vec![Softmax::new(d); n * gs];
                    fold_chunk_at(level, &job, &ctx_of(h), c, &mut states, sc, reader)?;
                    Ok(states)
                },
            );
            let mut parts = parts.into_iter();
            (0..kvh)
                .map(|_| {
                    let mut merged = vec![Softmax::new(d); n * gs];
                    for part in parts.by_ref().take(chunks) {
                        merge_states(&mut merged, &part?);
                    }
                    Ok(merged)
                })
                .collect()
        } else {
            // One item per head, its chunks in order.
            run_items(
                kvh,
                threads,
                || Lease::take(&codec, d, r),
                |lease, h| {
                    let (sc, reader) = lease.parts();
                    let mut merged = vec![Softmax::new(d); n * gs];
                    let mut part = vec![Softmax::new(d); n * gs];
                    for c in 0..chunks {
                        part.iter_mut().for_each(Softmax::clear);
                        fold_chunk_at(level, &job, &ctx_of(h), c, &mut part, sc, reader)?;
                        merge_states(&mut merged, &part);
                    }
                    Ok(merged)
                },
            )
        };

    // Normalise and rotate the value sums back to the model frame: [n][q_heads][head_dim].
    let mut out = vec![0.0f32; n * qh * d];
    for (h, states) in per_head.into_iter().enumerate() {
        let mut states = states?;
        if cfg.exact_recent > 0 {
            fold_window(&ctx_of(h), kvh, &mut states);
        }
        write_head(&states, h, gs, qh, d, &mut out)?;
    }
    // Keys and queries are finite, so a non-finite output means the scores overflowed.
    if out.iter().any(|x| !x.is_finite()) {
        return Err(score_overflow(q, d, scale));
    }
    Ok(out)
}

/// The queries `[n][q_heads][d]` rotated and regrouped by KV head, `[kv_heads][n][gs][d]`, so
/// a head's pairs are contiguous. A finite query whose rotation, or its product with the
/// scale, leaves f32 would feed the kernels infinities (their fixed-point sums would be
/// meaningless, not just NaN): that is refused.
fn rotated_by_head(
    q: &[f32],
    qh: usize,
    kvh: usize,
    d: usize,
    scale: f32,
) -> CacheResult<Vec<f32>> {
    let mut q_rot = q.to_vec();
    rotate_rows(&mut q_rot, d)?;
    if q_rot
        .iter()
        .any(|x| !x.is_finite() || !(x * scale).is_finite())
    {
        return Err(score_overflow(q, d, scale));
    }
    let (n, gs) = (q.len() / (qh * d), qh / kvh);
    let mut by_head = vec![0.0f32; q_rot.len()];
    for i in 0..n {
        for h in 0..kvh {
            let from = (i * qh + h * gs) * d;
            let to = ((h * n + i) * gs) * d;
            by_head[to..to + gs * d].copy_from_slice(&q_rot[from..from + gs * d]);
        }
    }
    Ok(by_head)
}

/// Writes KV head `h`'s pair states into `out` (`[n][q_heads][d]`): normalised, rotated back
/// to the model frame.
fn write_head(
    states: &[Softmax],
    h: usize,
    gs: usize,
    qh: usize,
    d: usize,
    out: &mut [f32],
) -> CacheResult<()> {
    for (p, st) in states.iter().enumerate() {
        let (i, j) = (p / gs, p % gs);
        let o = &mut out[(i * qh + h * gs + j) * d..(i * qh + h * gs + j + 1) * d];
        finish(st, o, d)?;
    }
    Ok(())
}

/// One pair's output from its state: the value sum normalised and rotated back to the model
/// frame.
fn finish(st: &Softmax, o: &mut [f32], d: usize) -> CacheResult<()> {
    finish_sums(&st.acc, st.sum, o, d)
}

/// [`finish`] from a value sum `acc` and a weight sum `sum`.
fn finish_sums(acc: &[f32], sum: f32, o: &mut [f32], d: usize) -> CacheResult<()> {
    o.copy_from_slice(acc);
    rotate_rows(o, d)?;
    let inv = 1.0 / sum;
    o.iter_mut().for_each(|x| *x *= inv);
    Ok(())
}

/// Folds each pair's exact-window positions (fp16 copies, read after every block) into its
/// state: pair `p` at position `pos` reads `exact_from(pos)..=pos`. Plain sums in a fixed order,
/// the same in every build.
fn fold_window(ctx: &Queries, kvh: usize, states: &mut [Softmax]) {
    let (d, w) = (ctx.d, ctx.window);
    let pairs = states.len();
    let last = ctx.base + (pairs.max(1) - 1) / ctx.gs;
    // The first position any pair reads (queries in the sink read none).
    let from = w.exact_from(ctx.width, ctx.base).max(w.first);
    if from > last {
        return;
    }
    // The head's copies in f32, once per call.
    let rows = last + 1 - from;
    let (mut keys, mut values) = (vec![0.0f32; rows * d], vec![0.0f32; rows * d]);
    for (t, pos) in (from..=last).enumerate() {
        let at = t * d..(t + 1) * d;
        w.row(pos, ctx.kv_head, kvh, d, false)
            .convert_to_f32_slice(&mut keys[at.clone()]);
        w.row(pos, ctx.kv_head, kvh, d, true)
            .convert_to_f32_slice(&mut values[at]);
    }
    let (mut logits, mut weights) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    let mut part = [Softmax::new(d)];
    for (p, state) in states.iter_mut().enumerate() {
        let pos = ctx.base + p / ctx.gs;
        let start = w.exact_from(ctx.width, pos);
        if start > pos {
            continue;
        }
        let (t0, count) = (start - from, pos + 1 - start);
        let q = ctx.query(p);
        for (l, k) in logits
            .iter_mut()
            .zip(keys[t0 * d..].chunks_exact(d))
            .take(count)
        {
            *l = lane_dot(q, k) * ctx.scale;
        }
        part[0].clear();
        part[0].fold(&logits, count, &mut weights);
        for (&wt, v) in weights
            .iter()
            .zip(values[t0 * d..].chunks_exact(d))
            .take(count)
        {
            for (a, &x) in part[0].acc.iter_mut().zip(v) {
                *a += wt * x;
            }
        }
        merge_states(std::slice::from_mut(state), &part);
    }
}

/// `a . b` in 16 lanes over ascending 16-value chunks, then [`pairwise`]: a fixed order that
/// vectorises (`a.len()` is a head width, a multiple of 16).
#[inline(always)]
fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    for (ca, cb) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        for l in 0..16 {
            lanes[l] += ca[l] * cb[l];
        }
    }
    pairwise(&mut lanes)
}

/// The error of scores that left the f32 range: names the largest `scale * |q_row|`.
pub(crate) fn score_overflow(q: &[f32], d: usize, scale: f32) -> CacheError {
    let largest = q
        .chunks_exact(d)
        .map(|row| row.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt())
        .fold(0.0f64, f64::max);
    CacheError::ScoreOverflow {
        scaled_query: (largest * scale.abs() as f64) as f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{CacheConfig, LayerCoding};
    use crate::codec::extension::body::{BodyCoding, TrellisAxis};
    use crate::rng::SplitMix64;
    use crate::simd::detected_level;
    use std::sync::Arc;

    /// One layer of `q_heads` over `kv_heads` of `d` under `coding`, a 256/512 tail, filled
    /// with `tokens` Gaussian positions in the journal's own ubatches.
    fn filled(
        q_heads: usize,
        kv_heads: usize,
        d: usize,
        coding: LayerCoding,
        tokens: usize,
        rng: &mut SplitMix64,
    ) -> Sequence {
        let mut c = CacheConfig::uniform(1, q_heads, kv_heads, d, coding, tokens + 1000);
        (c.min_tail, c.max_tail) = (256, 512);
        let cfg = Arc::new(c);
        let mut seq = Sequence::new(cfg.clone(), Sequence::pool_for(&cfg, 1)).unwrap();
        let per_pos = kv_heads * d;
        while seq.len(0).unwrap() < tokens {
            let n = seq
                .chunk_limit(0)
                .unwrap()
                .min(tokens - seq.len(0).unwrap());
            seq.append(0, &rng.gaussians(n * per_pos), &rng.gaussians(n * per_pos))
                .unwrap();
        }
        seq
    }

    /// 3-bit keys and 2-bit values, both trellis-coded along tokens.
    fn trellis_3_2() -> LayerCoding {
        LayerCoding {
            k_coding: BodyCoding::Trellis(TrellisAxis::Token),
            v_coding: BodyCoding::Trellis(TrellisAxis::Token),
            ..LayerCoding::scalar(3, 2)
        }
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// Every instruction-set level this CPU has gives the same bits, for decode and prefill
    /// rows, over sink, scalar or trellis records and the ring.
    #[test]
    fn every_simd_level_gives_the_same_bits() {
        let levels: Vec<SimdLevel> = [SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512]
            .into_iter()
            .filter(|&l| l <= detected_level())
            .collect();
        eprintln!("levels compared: {levels:?}");
        let trellis = trellis_3_2();
        for coding in [LayerCoding::scalar(4, 4), trellis] {
            let mut rng = SplitMix64::new(5);
            let seq = filled(8, 2, 128, coding, 5000, &mut rng);
            assert!(seq.memory().sealed_tokens > 2 * CHUNK);
            for rows in [1usize, 37] {
                let q = rng.gaussians(rows * 8 * 128);
                let want = attend_at(SimdLevel::Portable, &seq, 0, &q, None, None).unwrap();
                for &level in &levels {
                    let got = attend_at(level, &seq, 0, &q, None, None).unwrap();
                    assert!(same_bits(&want, &got), "{level:?}, {rows} rows");
                }
            }
        }
    }

    /// A thread's kept workspace serves later calls as a fresh one would: calls on two caches
    /// of different geometry and body, interleaved on one thread (so each finds the other's
    /// workspace, or its own), give the bits of the first call on each.
    #[test]
    fn kept_workspaces_give_the_same_bits() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let trellis = trellis_3_2();
        let mut rng = SplitMix64::new(17);
        let mut cases = Vec::new();
        for (d, coding) in [(128, LayerCoding::scalar(4, 4)), (64, trellis)] {
            let seq = filled(4, 2, d, coding, 2500, &mut rng);
            assert!(seq.memory().sealed_tokens > 0);
            let q = rng.gaussians(3 * 4 * d);
            cases.push((seq, q));
        }
        pool.install(|| {
            let first: Vec<Vec<f32>> = cases
                .iter()
                .map(|(seq, q)| attend(seq, 0, q, None).unwrap())
                .collect();
            for round in 0..3 {
                for ((seq, q), want) in cases.iter().zip(&first).rev() {
                    let got = attend(seq, 0, q, None).unwrap();
                    assert!(same_bits(want, &got), "round {round}");
                }
            }
        });
    }

    /// Prefill items that share decoded key tiles give the bits of items that each decode
    /// their own, for scalar and trellis records, the sink and the ring.
    #[test]
    fn shared_prefill_tiles_give_the_same_bits() {
        use std::sync::atomic::Ordering;
        let trellis = trellis_3_2();
        for coding in [LayerCoding::scalar(4, 4), trellis] {
            let mut rng = SplitMix64::new(29);
            let seq = filled(6, 3, 64, coding, 5000, &mut rng);
            assert!(seq.memory().sealed_tokens > 0);
            // Three items per KV head, on two threads.
            let q = rng.gaussians(2100 * 6 * 64);
            let shared = attend_with_threads(&seq, 0, &q, None, Some(2)).unwrap();
            prefill::SHARE_TILES.store(false, Ordering::Relaxed);
            let own = attend_with_threads(&seq, 0, &q, None, Some(2));
            prefill::SHARE_TILES.store(true, Ordering::Relaxed);
            assert!(same_bits(&shared, &own.unwrap()));
        }
    }

    /// Calls below the work threshold run on the caller alone, whatever the limit.
    #[test]
    fn small_calls_run_on_the_caller_alone() {
        assert_eq!(thread_limit(PARALLEL_MIN_WORK - 1, None), Some(1));
        assert_eq!(thread_limit(PARALLEL_MIN_WORK - 1, Some(2)), Some(1));
        assert_eq!(thread_limit(PARALLEL_MIN_WORK, None), None);
        assert_eq!(thread_limit(PARALLEL_MIN_WORK, Some(2)), Some(2));
        // SmolLM2's geometry (9 query heads of 64): one decode row over 2,048 positions is
        // small, over 3,072 it is not.
        assert_eq!(thread_limit(2048 * 9 * 64, None), Some(1));
        assert_eq!(thread_limit(3072 * 9 * 64, None), None);
    }

    /// Any thread limit gives the bits of the unlimited call, and a limit of zero is refused.
    #[test]
    fn every_thread_limit_gives_the_same_bits() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let mut rng = SplitMix64::new(23);
        let seq = filled(6, 3, 64, LayerCoding::scalar(4, 4), 5000, &mut rng);
        // Decode calls, and prefill chunks of one and of several work items.
        for rows in [1usize, 9, 40, 2100] {
            let q = rng.gaussians(rows * 6 * 64);
            let want = attend(&seq, 0, &q, None).unwrap();
            for threads in [1, 2, 3, 5] {
                // From inside the pool and from the calling thread outside it.
                let inside = pool
                    .install(|| attend_with_threads(&seq, 0, &q, None, Some(threads)))
                    .unwrap();
                let outside = attend_with_threads(&seq, 0, &q, None, Some(threads)).unwrap();
                for got in [inside, outside] {
                    assert!(same_bits(&want, &got), "{threads} threads, {rows} rows");
                }
            }
        }
        let q = rng.gaussians(6 * 64);
        assert!(matches!(
            attend_with_threads(&seq, 0, &q, None, Some(0)),
            Err(CacheError::Codec(crate::CodecError::InvalidSetting(_)))
        ));
    }
}
