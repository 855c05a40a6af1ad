//! The attention driver: one call over a layer's regions, cut into split-K chunks of fixed
//! positions, (KV head, chunk) items run on the pool, their partial softmax states merged in
//! chunk order. The chunking never depends on the thread count or the number of query rows.

use super::fragment_dots::FragmentKernel;
use super::job::Job;
use super::online_softmax::{merge_states, Softmax};
use super::output::{rotated_by_head, score_overflow, write_head};
use super::prefill;
use super::region::dense::{fold_dense, CodedRows, RING_AHEAD};
use super::region::record::fold_record;
use super::region::window::fold_window;
use super::ring_tq6::RingKernel;
use super::word_dots::WordKernel;
use super::workspace::{Lease, Queries, Scratch, PAIRS};
use crate::backend::cpu::sequence::Sequence;
use crate::codec::extension::body::GROUP;
use crate::codec::HalfReader;
use crate::error::check_finite;
use crate::error::{CacheError, CacheResult};
use crate::journal::Staging;
use crate::parallel::run_items;
use crate::simd::{simd_level, Ahead, SimdLevel};
use half::slice::HalfFloatSliceExt;

/// Positions per split-K chunk: the unit of parallel work along the context. Fixed (never
/// derived from the thread count or the call), so results do not depend on scheduling.
pub(crate) const CHUNK: usize = 16 * GROUP;

/// Least work (query rows x cached positions x query heads x head width) worth a second
/// thread. Below it the caller runs every item alone: waking a pool worker that went to sleep
/// since the last call (as it does while a model runs its other layers) costs tens of
/// microseconds in a virtual machine, and the call waits for it even when it comes too late to
/// take an item. Measured on a 2-vCPU guest (`attend_decode --paired 2 --evict-mb 4`, so the
/// worker sleeps between calls), 2 threads against 1: 9q/3kv/64 0.80x at 1,024 positions,
/// 0.99x at 2,048, 1.25x at 3,072; 24q/4kv/256 1.14x at 256, 1.31x at 512.
pub(crate) const PARALLEL_MIN_WORK: usize = 1280 * 1024;

/// The thread limit a call of `work` (see [`PARALLEL_MIN_WORK`]) runs under: the caller's
/// `limit`, or the calling thread alone for a call too small to gain from more.
pub(crate) fn thread_limit(work: usize, limit: Option<usize>) -> Option<usize> {
    if work < PARALLEL_MIN_WORK {
        Some(1)
    } else {
        limit
    }
}

/// Largest total of partial softmax states (bytes) for which every (head, chunk) item runs in
/// parallel; above it (long prefill chunks) each head runs its chunks in order.
pub(crate) const PARALLEL_STATE_BYTES: usize = 32 << 20;

/// Folds split-K chunk `chunk` (positions `[chunk * CHUNK, (chunk + 1) * CHUNK)`) of KV head
/// `ctx.kv_head` into `states`, compiled for `level`.
pub(crate) fn fold_chunk_at(
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

/// The blocks of one chunk, in position order: sink blocks, body records, ring blocks (each
/// block belongs to the chunk holding its first position). Inlined into each SIMD level.
#[inline(always)]
pub(crate) fn fold_chunk_body(
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
    let sink_rows = lj.state.len.min(job.sink);
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
    if coded_keys && lj.ring_start(job.sink).max(span.start) < lj.state.len.min(span.end) {
        // Every query pair in fixed point, once per chunk.
        sc.ring_queries.prepare(ctx.rotated, d, job.pairs, d);
    }
    let ring_row = |pos: usize, value: bool, out: &mut [f32]| {
        if pos + RING_AHEAD < lj.state.len && !value {
            ring.prefetch(pos + RING_AHEAD);
        }
        ring.row(pos, value, out);
    };
    let mut entries: [&[u8]; GROUP + RING_AHEAD] = [&[]; GROUP + RING_AHEAD];
    let mut first = lj.ring_start(job.sink);
    while first < lj.state.len {
        let rows = (lj.state.len - first).min(GROUP);
        if !span.contains(&first) {
            first += rows;
            continue;
        }
        let coded = if coded_keys || coded_values {
            let ahead = (lj.state.len - first).min(GROUP + RING_AHEAD);
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
pub(crate) fn attend_at(
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
    if n > lj.state.len {
        return Err(CacheError::Position {
            position: n,
            len: lj.state.len,
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
    let base = lj.state.len - n;
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
    let threads = thread_limit(n * lj.state.len * qh * d, threads);
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
    let chunks = lj.state.len.div_ceil(CHUNK);
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
