//! The exact window: the newest positions read from fp16 copies of their rows.

use super::super::online_softmax::{merge_states, pairwise, Softmax};
use super::super::workspace::Queries;
use half::slice::HalfFloatSliceExt;

/// Folds each pair's exact-window positions (fp16 copies, read after every block) into its
/// state: pair `p` at position `pos` reads `exact_from(pos)..=pos`. Plain sums in a fixed order,
/// the same in every build.
pub(crate) fn fold_window(ctx: &Queries, kvh: usize, states: &mut [Softmax]) {
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
pub(crate) fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    for (ca, cb) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        for l in 0..16 {
            lanes[l] += ca[l] * cb[l];
        }
    }
    pairwise(&mut lanes)
}
