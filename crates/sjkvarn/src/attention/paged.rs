//! Attention over an engine's paged blocks (vLLM's block table): the same kernels as
//! [`attend`](super::attend), over blocks the caller names one by one instead of a
//! [`Sequence`](crate::backend::Sequence)'s journal. A block is either a sealed body record, read
//! in place, or exact rows (the sink, the block being filled).

use super::fragment_dots::FragmentKernel;
use super::online_softmax::Softmax;
use super::output::{rotated_by_head, score_overflow, write_head};
use super::region::dense::fold_dense;
use super::region::record::fold_record;
use super::ring_tq6::RingKernel;
use super::word_dots::WordKernel;
use super::workspace::{Lease, Queries, PAIRS};
use crate::backend::cpu::exact_window::ExactWindow;
use crate::codec::extension::body::GROUP;
use crate::codec::rotation::rotate_heads as rotate_rows;
use crate::codec::BodyCodec;
use crate::error::check_finite;
use crate::error::{CacheError, CacheResult};
use crate::simd::simd_level;
use crate::simd::Ahead;

/// One 128-position block of a paged cache.
#[derive(Clone, Copy, Debug)]
pub enum PagedBlock<'a> {
    /// A sealed body record per KV head, head after head (`kv_heads * record_bytes`).
    Record(&'a [u8]),
    /// Exact K and V rows, model frame, `[GROUP][kv_heads][head_dim]` each; rows past the
    /// queries' positions are never read.
    Rows { k: &'a [f32], v: &'a [f32] },
}

/// Attention of `n` query rows `q` (`[n][q_heads][head_dim]`, model frame, post-RoPE) at
/// positions `query_position..` over `blocks`, block `i` holding positions
/// `first_position + 128 i ..`. Causal: each row sees the positions up to its own. Scores use
/// `scale`. Returns `[n][q_heads][head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn attend_paged(
    codec: &BodyCodec,
    q_heads: usize,
    kv_heads: usize,
    blocks: &[PagedBlock<'_>],
    first_position: usize,
    q: &[f32],
    query_position: usize,
    scale: f32,
) -> CacheResult<Vec<f32>> {
    let d = codec.head_dim();
    let r = codec.half_width();
    let rb = codec.record_bytes();
    if kv_heads == 0 || q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Err(crate::CodecError::InvalidSetting(format!(
            "{q_heads} query heads do not group over {kv_heads} KV heads"
        ))
        .into());
    }
    if q.is_empty() || !q.len().is_multiple_of(q_heads * d) {
        return Err(CacheError::Shape {
            what: "paged attention q",
            expected: format!("[tokens, {q_heads}, {d}]"),
            got: format!("{} values", q.len()),
        });
    }
    if !first_position.is_multiple_of(GROUP) {
        return Err(crate::CodecError::InvalidSetting(format!(
            "blocks start at multiples of {GROUP}, got {first_position}"
        ))
        .into());
    }
    for block in blocks {
        match block {
            PagedBlock::Record(bytes) if bytes.len() != kv_heads * rb => {
                return Err(CacheError::Shape {
                    what: "paged record",
                    expected: format!("{kv_heads} x {rb} bytes"),
                    got: format!("{} bytes", bytes.len()),
                })
            }
            PagedBlock::Rows { k, v } if k.len() != GROUP * kv_heads * d || v.len() != k.len() => {
                return Err(CacheError::Shape {
                    what: "paged rows",
                    expected: format!("[{GROUP}, {kv_heads}, {d}]"),
                    got: format!("{} and {} values", k.len(), v.len()),
                })
            }
            _ => {}
        }
    }
    check_finite(q)?;
    if !scale.is_finite() {
        return Err(crate::CodecError::InvalidSetting(format!(
            "scale must be finite, got {scale}"
        ))
        .into());
    }
    let n = q.len() / (q_heads * d);
    let gs = q_heads / kv_heads;
    let by_head = rotated_by_head(q, q_heads, kv_heads, d, scale)?;
    let level = simd_level();
    // No exact window: each pair sees the positions up to its own.
    let window = ExactWindow::new(0);
    let pairs = n * gs;
    let pair_blocks = (0..pairs).step_by(PAIRS).map(|p| p..(p + PAIRS).min(pairs));
    let mut lease = Lease::take(codec, d, r);
    let (sc, reader) = lease.parts();
    let mut out = vec![0.0f32; n * q_heads * d];
    for h in 0..kv_heads {
        let ctx = Queries {
            rotated: &by_head[h * n * gs * d..(h + 1) * n * gs * d],
            gs,
            d,
            base: query_position,
            scale,
            kv_head: h,
            window: &window,
            width: 0,
            level,
            fragments: FragmentKernel::for_level(level),
            ring: RingKernel::for_level(level),
            words: WordKernel::for_level(level),
        };
        let mut states = vec![Softmax::new(d); pairs];
        for (i, block) in blocks.iter().enumerate() {
            let first = first_position + i * GROUP;
            match *block {
                PagedBlock::Record(bytes) => {
                    let rec = &bytes[h * rb..(h + 1) * rb];
                    reader.read(rec, &mut sc.halves)?;
                    let mut ahead = Ahead::new(&[]);
                    for p in pair_blocks.clone() {
                        fold_record(&ctx, &mut states, p, first, r, rec, sc, &mut ahead);
                    }
                    ahead.finish();
                }
                PagedBlock::Rows { k, v } => {
                    for t in 0..GROUP {
                        let at = (t * kv_heads + h) * d;
                        sc.kblk[t * d..(t + 1) * d].copy_from_slice(&k[at..at + d]);
                        sc.vblk[t * d..(t + 1) * d].copy_from_slice(&v[at..at + d]);
                    }
                    rotate_rows(&mut sc.kblk[..GROUP * d], d)?;
                    rotate_rows(&mut sc.vblk[..GROUP * d], d)?;
                    for p in pair_blocks.clone() {
                        fold_dense(
                            &ctx,
                            &mut states,
                            p,
                            first,
                            GROUP,
                            sc,
                            GROUP,
                            None,
                            |_, _, _| {},
                        );
                    }
                }
            }
        }
        if let Some(p) = states.iter().position(|st| st.sum == 0.0) {
            // A query with no visible position (none of the blocks reaches it).
            return Err(CacheError::Position {
                position: query_position + p / gs,
                len: first_position + blocks.len() * GROUP,
            });
        }
        write_head(&states, h, gs, q_heads, d, &mut out)?;
    }
    if out.iter().any(|x| !x.is_finite()) {
        return Err(score_overflow(q, d, scale));
    }
    Ok(out)
}
