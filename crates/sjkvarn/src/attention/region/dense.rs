//! Dense rows: the sink's fp16 rows and the ring's staged rows (`tq6_0` and `q8_0` read from
//! their codes, fp16 decoded), a block of up to 128 positions at a time.

use super::super::online_softmax::Softmax;
use super::super::ring_q8::q8_value_sums;
use super::super::ring_tq6::{key_scores, value_sums};
use super::super::tile_gemm::{dots, product_from};
use super::super::workspace::{Queries, Scratch, PAIRS};
use crate::codec::extension::body::GROUP;
use crate::journal::Staging;

/// Folds a block of dense rotated rows into the states of `pairs`, `piece` rows at a time:
/// `fill(t0, value, out)` writes the block's K (or V) rows `t0..` into `out` (`[n][d]`, the
/// start of `sc.kblk` or `sc.vblk`); a block decoded beforehand passes `piece = GROUP` and a
/// `fill` that does nothing. Every sum keeps its order, so `piece` does not change the bits.
/// `coded`: a ring block whose `tq6_0` sides are read from their codes instead of `fill`ed.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn fold_dense(
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

/// The ring entries (K row, then V row) of a block whose `tq6_0` keys and/or `tq6_0` or
/// `q8_0` values are read from their codes ([`key_scores`], [`value_sums`],
/// [`q8_value_sums`]) instead of decoded; entries past the block's rows are only fetched ahead.
pub(crate) struct CodedRows<'a> {
    pub(crate) entries: &'a [&'a [u8]],
    pub(crate) keys: bool,
    /// Where the value row starts in an entry and its staging, when values are coded.
    pub(crate) values: Option<(usize, Staging)>,
}

/// Ring positions fetched ahead of the one being decoded.
pub(crate) const RING_AHEAD: usize = 8;
