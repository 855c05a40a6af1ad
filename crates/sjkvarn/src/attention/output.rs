//! Queries in, outputs out: the rotated, regrouped queries of a call and each pair's output
//! normalised and rotated back to the model frame.

use super::online_softmax::Softmax;
use crate::codec::rotation::rotate_heads as rotate_rows;
use crate::error::{CacheError, CacheResult};

/// The queries `[n][q_heads][d]` rotated and regrouped by KV head, `[kv_heads][n][gs][d]`, so
/// a head's pairs are contiguous. A finite query whose rotation, or its product with the
/// scale, leaves f32 would feed the kernels infinities (their fixed-point sums would be
/// meaningless, not just NaN): that is refused.
pub(crate) fn rotated_by_head(
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
pub(crate) fn write_head(
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
pub(crate) fn finish(st: &Softmax, o: &mut [f32], d: usize) -> CacheResult<()> {
    finish_sums(&st.acc, st.sum, o, d)
}

/// [`finish`] from a value sum `acc` and a weight sum `sum`.
pub(crate) fn finish_sums(acc: &[f32], sum: f32, o: &mut [f32], d: usize) -> CacheResult<()> {
    o.copy_from_slice(acc);
    rotate_rows(o, d)?;
    let inv = 1.0 / sum;
    o.iter_mut().for_each(|x| *x *= inv);
    Ok(())
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
