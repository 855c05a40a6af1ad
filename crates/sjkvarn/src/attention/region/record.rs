//! Sealed body records, read in place in their absorbed-scale form: fragment or trellis-word
//! dot products for the keys, weighted sums for the values.

use super::super::fragment_dots::{fragment_products, TileGrid, TILE};
use super::super::online_softmax::Softmax;
use super::super::tile_gemm::{dot, product};
use super::super::word_dots::{word_products, WordSum};
use super::super::workspace::{Queries, Scratch, PAIRS};
use crate::codec::extension::body::GROUP;
use crate::simd::Ahead;

/// Folds one body record (`rec`, its absorbed-scale halves in `sc.halves`) into the states of
/// `pairs`: `logit[t] = s_K[t] (sum_c (q'_c a_K[c]) u[c,t] + sum_c q'_c z_K[c])` and
/// `acc[c] += s_V[c] (sum_t w_t a_V[t] u[t,c] + sum_t w_t z_V[t])`, each sum in ascending order,
/// or, for 4-bit sides read in place, exact in fixed point ([`fragment_products`]).
// Slots index several per-pair arrays in step; index loops say that more plainly than zips.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn fold_record(
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
