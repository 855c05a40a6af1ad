//! Many body records at once: one record per (K tile, V tile) pair, tiles in parallel.
//!
//! Each tile is balanced and rounded on its own with sequential reductions, so the bytes do not
//! depend on the thread count.

use crate::balance::BalanceConfig;
use crate::body::{BodySpec, GROUP};
use crate::error::{check_finite, CodecError, Result};
use crate::format::with_threads;
use rayon::prelude::*;

fn tile_count(spec: &BodySpec, what: &'static str, len: usize) -> Result<usize> {
    let tile = GROUP * spec.head_dim;
    if len == 0 || len % tile != 0 {
        return Err(CodecError::NotBlockMultiple {
            what,
            len,
            block: tile,
        });
    }
    Ok(len / tile)
}

/// Encodes `k` and `v` (each `[n][G][head_dim]`, model frame unless `rotated`) into `n` records.
pub fn encode_records(
    spec: &BodySpec,
    config: &BalanceConfig,
    k: &[f32],
    v: &[f32],
    rotated: bool,
    threads: Option<usize>,
) -> Result<Vec<u8>> {
    let n = tile_count(spec, "K tiles", k.len())?;
    if v.len() != k.len() {
        return Err(CodecError::LengthMismatch {
            what: "V tiles",
            expected: k.len(),
            got: v.len(),
        });
    }
    check_finite(k)?;
    check_finite(v).map_err(|e| match e {
        CodecError::NonFinite { index } => CodecError::NonFinite {
            index: k.len() + index,
        },
        other => other,
    })?;
    config.validate()?;
    let tile = GROUP * spec.head_dim;
    let rb = spec.record_bytes();
    let mut out = vec![0u8; n * rb];
    with_threads(threads, || {
        out.par_chunks_mut(rb)
            .zip(k.par_chunks(tile).zip(v.par_chunks(tile)))
            .try_for_each(|(rec, (kt, vt))| {
                if rotated {
                    spec.encode_rotated(kt, vt, config, rec)
                } else {
                    spec.encode(kt, vt, config, rec)
                }
            })
    })??;
    Ok(out)
}

/// Decodes `n` records into `k` and `v` (each `[n][G][head_dim]`).
pub fn decode_records(
    spec: &BodySpec,
    records: &[u8],
    k: &mut [f32],
    v: &mut [f32],
    rotated: bool,
    threads: Option<usize>,
) -> Result<()> {
    let n = tile_count(spec, "K output", k.len())?;
    if v.len() != k.len() {
        return Err(CodecError::LengthMismatch {
            what: "V output",
            expected: k.len(),
            got: v.len(),
        });
    }
    let rb = spec.record_bytes();
    if records.len() != n * rb {
        return Err(CodecError::LengthMismatch {
            what: "record bytes",
            expected: n * rb,
            got: records.len(),
        });
    }
    let tile = GROUP * spec.head_dim;
    with_threads(threads, || {
        records
            .par_chunks(rb)
            .zip(k.par_chunks_mut(tile).zip(v.par_chunks_mut(tile)))
            .try_for_each(|(rec, (kt, vt))| {
                if rotated {
                    spec.decode_rotated(rec, kt, vt)
                } else {
                    spec.decode(rec, kt, vt)
                }
            })
    })?
}
