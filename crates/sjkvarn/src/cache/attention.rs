//! One-pass CPU attention over sink, body records and ring, without a dequantized copy of the
//! cache: one online softmax spans all three regions, the query heads of a KV head share every
//! block they read, and body records are read in the absorbed-scale form.
//!
//! Frames: the sink, the body records and the ring rows are all Hadamard-rotated, as the
//! reference stores them, so they are scored with the rotated query `q' = H q` and the value sum
//! is rotated back once at the end (`H` is orthonormal: `q . k = q' . k'`).
//!
//! Each query row is processed on its own, in a fixed block order (sink, groups, ring blocks
//! aligned to 128 positions), and masked positions are skipped, not zeroed: a row's output does
//! not depend on how many other rows share the call. Chunked prefill therefore equals
//! token-by-token decoding bit for bit when chunks do not straddle a seal.

use super::sequence::Sequence;
use super::{CacheError, CacheResult};
use crate::body::{DecodedHalf, GROUP};
use crate::codec::rotation::rotate_heads as rotate_rows;
use crate::error::check_finite;
use rayon::prelude::*;

/// Online-softmax state of one (query row, query head).
#[derive(Clone)]
struct Softmax {
    max: f32,
    sum: f32,
    /// Value sum in the rotated frame.
    acc: Vec<f32>,
}

impl Softmax {
    fn new(d: usize) -> Self {
        Self {
            max: f32::NEG_INFINITY,
            sum: 0.0,
            acc: vec![0.0; d],
        }
    }

    /// Folds a block of logits in: returns the weight of each logit (0 for masked ones) after
    /// rescaling the running sums, or `None` when the whole block is masked.
    fn fold(&mut self, logits: &[f32], visible: usize, weights: &mut [f32]) -> bool {
        if visible == 0 {
            return false;
        }
        let block_max = logits[..visible]
            .iter()
            .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let new_max = self.max.max(block_max);
        let rescale = (self.max - new_max).exp();
        if rescale != 1.0 {
            self.sum *= rescale;
            self.acc.iter_mut().for_each(|v| *v *= rescale);
        }
        self.max = new_max;
        for (w, &x) in weights[..visible].iter_mut().zip(&logits[..visible]) {
            *w = (x - new_max).exp();
            self.sum += *w;
        }
        true
    }
}

/// The rotated query rows of one KV head's group.
struct Queries<'a> {
    rotated: &'a [f32],
    n: usize,
    gs: usize,
    qh: usize,
    d: usize,
    /// Position of query row 0.
    base: usize,
    scale: f32,
    kv_head: usize,
}

impl Queries<'_> {
    fn query(&self, i: usize, j: usize) -> &[f32] {
        let head = self.kv_head * self.gs + j;
        &self.rotated[(i * self.qh + head) * self.d..(i * self.qh + head + 1) * self.d]
    }

    /// Positions visible to query row `i` in a block of `rows` starting at `first`.
    fn visible(&self, i: usize, first: usize, rows: usize) -> usize {
        (self.base + i + 1).saturating_sub(first).min(rows)
    }

    /// Folds a block of dense rotated K/V rows (`[rows][d]`) into every state.
    #[allow(clippy::too_many_arguments)]
    fn dense(
        &self,
        states: &mut [Softmax],
        first: usize,
        rows: usize,
        kb: &[f32],
        vb: &[f32],
        logits: &mut [f32],
        weights: &mut [f32],
    ) {
        let d = self.d;
        for i in 0..self.n {
            let visible = self.visible(i, first, rows);
            for j in 0..self.gs {
                let qv = self.query(i, j);
                for t in 0..visible {
                    logits[t] = dot(qv, &kb[t * d..(t + 1) * d]) * self.scale;
                }
                let st = &mut states[i * self.gs + j];
                if st.fold(logits, visible, weights) {
                    let acc = &mut st.acc;
                    for t in 0..visible {
                        let w = weights[t];
                        for (a, &vv) in acc.iter_mut().zip(&vb[t * d..(t + 1) * d]) {
                            *a += w * vv;
                        }
                    }
                }
            }
        }
    }
}

/// `logits[t] += s_K[t] * (sum_c (q'_c a_K[c]) u[c,t] + sum_c q'_c z_K[c])` for one record half:
/// the per-channel products `q' * a_K` and the offset term are formed once per block.
fn add_key_scores(hd: &DecodedHalf, q: &[f32], logits: &mut [f32]) {
    let visible = logits.len();
    let mut part = vec![0.0f32; visible];
    let mut offset = 0.0f32;
    for (c, ((&qc, &a), &z)) in q.iter().zip(&hd.a_k).zip(&hd.z_k).enumerate() {
        let qa = qc * a;
        offset += qc * z;
        for (p, &u) in part
            .iter_mut()
            .zip(&hd.k_units[c * GROUP..c * GROUP + visible])
        {
            *p += qa * u;
        }
    }
    for ((l, &s), &p) in logits.iter_mut().zip(&hd.s_k).zip(&part) {
        *l += s * (p + offset);
    }
}

/// `acc[c] += s_V[c] * (sum_t w_t a_V[t] u[t,c] + sum_t w_t z_V[t])` for one record half.
fn add_values(hd: &DecodedHalf, weights: &[f32], acc: &mut [f32]) {
    let r = acc.len();
    let mut part = vec![0.0f32; r];
    let mut offset = 0.0f32;
    for (t, ((&w, &a), &z)) in weights.iter().zip(&hd.a_v).zip(&hd.z_v).enumerate() {
        let wa = w * a;
        offset += w * z;
        for (p, &u) in part.iter_mut().zip(&hd.v_units[t * r..(t + 1) * r]) {
            *p += wa * u;
        }
    }
    for ((x, &s), &p) in acc.iter_mut().zip(&hd.s_v).zip(&part) {
        *x += s * (p + offset);
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
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
    let cfg = seq.config();
    let (qh, kvh, d) = (cfg.q_heads, cfg.kv_heads, cfg.head_dim);
    let lj = seq.layer(layer)?;
    if q.len() % (qh * d) != 0 || q.is_empty() {
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
            return Err(crate::CodecError::NonFinite { index: 0 }.into());
        }
    }
    let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
    let mut q_rot = q.to_vec();
    rotate_rows(&mut q_rot, d)?;
    let gs = cfg.group_size();
    let base = lj.len - n;
    let codec = cfg.body_codec(layer);
    let r = codec.half_width();

    // One task per KV head; each returns [n][gs][d].
    let per_head: Vec<CacheResult<Vec<f32>>> = (0..kvh)
        .into_par_iter()
        .map(|h| {
            let mut states = vec![Softmax::new(d); n * gs];
            let ctx = Queries {
                rotated: &q_rot,
                n,
                gs,
                qh,
                d,
                base,
                scale,
                kv_head: h,
            };
            let mut logits = vec![0.0f32; GROUP];
            let mut weights = vec![0.0f32; GROUP];
            let mut kblk = vec![0.0f32; GROUP * d];
            let mut vblk = vec![0.0f32; GROUP * d];

            // Sink (rotated fp16), in blocks of at most 128 positions.
            let sink_rows = lj.len.min(cfg.sink);
            let mut first = 0;
            while first < sink_rows {
                let rows = (sink_rows - first).min(GROUP);
                for t in 0..rows {
                    let at = ((first + t) * kvh + h) * d;
                    for c in 0..d {
                        kblk[t * d + c] = lj.sink_k[at + c].to_f32();
                        vblk[t * d + c] = lj.sink_v[at + c].to_f32();
                    }
                }
                ctx.dense(
                    &mut states,
                    first,
                    rows,
                    &kblk,
                    &vblk,
                    &mut logits,
                    &mut weights,
                );
                first += rows;
            }

            // Body records (rotated frame, absorbed scales).
            let rb = codec.record_bytes();
            for (g, &slot) in lj.blocks.iter().enumerate() {
                let first = cfg.sink + g * GROUP;
                let bytes = seq.pool().get(slot);
                let record = &bytes[h * rb..(h + 1) * rb];
                let halves = codec.halves(record)?;
                for i in 0..n {
                    let visible = ctx.visible(i, first, GROUP);
                    for j in 0..gs {
                        let qv = ctx.query(i, j);
                        logits[..visible].fill(0.0);
                        for (half, hd) in halves.iter().enumerate() {
                            add_key_scores(
                                hd,
                                &qv[half * r..(half + 1) * r],
                                &mut logits[..visible],
                            );
                        }
                        for l in logits[..visible].iter_mut() {
                            *l *= scale;
                        }
                        let st = &mut states[i * gs + j];
                        if st.fold(&logits, visible, &mut weights) {
                            for (half, hd) in halves.iter().enumerate() {
                                add_values(
                                    hd,
                                    &weights[..visible],
                                    &mut st.acc[half * r..(half + 1) * r],
                                );
                            }
                        }
                    }
                }
            }

            // Ring, in blocks aligned to 128 positions.
            let mut first = lj.ring_start(cfg.sink);
            while first < lj.len {
                let rows = (lj.len - first).min(GROUP);
                for t in 0..rows {
                    seq.ring_row(lj, first + t, h, false, &mut kblk[t * d..(t + 1) * d]);
                    seq.ring_row(lj, first + t, h, true, &mut vblk[t * d..(t + 1) * d]);
                }
                ctx.dense(
                    &mut states,
                    first,
                    rows,
                    &kblk,
                    &vblk,
                    &mut logits,
                    &mut weights,
                );
                first += rows;
            }

            // Normalise and rotate the value sum back to the model frame.
            let mut out = vec![0.0f32; n * gs * d];
            for (o, st) in out.chunks_exact_mut(d).zip(&states) {
                o.copy_from_slice(&st.acc);
                rotate_rows(o, d)?;
                let inv = 1.0 / st.sum;
                o.iter_mut().for_each(|x| *x *= inv);
            }
            Ok(out)
        })
        .collect();

    let mut out = vec![0.0f32; n * qh * d];
    for (h, res) in per_head.into_iter().enumerate() {
        let part = res?;
        for i in 0..n {
            for j in 0..gs {
                let head = h * gs + j;
                out[(i * qh + head) * d..(i * qh + head + 1) * d]
                    .copy_from_slice(&part[(i * gs + j) * d..(i * gs + j + 1) * d]);
            }
        }
    }
    Ok(out)
}
