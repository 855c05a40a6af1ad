//! Attention over an engine's paged blocks (`sjkvarn.vllm`): records read in place from the
//! engine's page tensor, exact rows for the sink and the block being filled.

use crate::dlpack::{read_f32, with_bytes, with_f32_out};
use crate::errors::{self, invalid};
use pyo3::prelude::*;
use sjkvarn::attention::{attend_paged as core_attend_paged, PagedBlock};
use sjkvarn::codec::extension::body::GROUP;

/// Attention of queries `q` (`[n, q_heads, d]`, positions `query_position..`) over blocks
/// `blocks[i]` (positions `first_position + 128 i..`): a page index into `pages`
/// (`[pages, ...]`, each page `kv_heads` records) or `-1 - j` for exact rows `j` of
/// `exact_k`/`exact_v` (`[m, 128, kv_heads, d]`). Writes `out` (`[n, q_heads, d]`).
#[pyfunction]
#[pyo3(signature = (pages, blocks, exact_k, exact_v, q, out, first_position, query_position, scale, q_heads, kv_heads, k_bits, v_bits, body))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_paged(
    py: Python<'_>,
    pages: &Bound<'_, PyAny>,
    blocks: Vec<i64>,
    exact_k: &Bound<'_, PyAny>,
    exact_v: &Bound<'_, PyAny>,
    q: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    first_position: usize,
    query_position: usize,
    scale: f32,
    q_heads: usize,
    kv_heads: usize,
    k_bits: u32,
    v_bits: u32,
    body: &str,
) -> PyResult<()> {
    let (ek, ev, qh) = (
        read_f32(exact_k, "exact_k")?,
        read_f32(exact_v, "exact_v")?,
        read_f32(q, "q")?,
    );
    let d = match qh.shape.as_slice() {
        [_, h, d] if *h == q_heads => *d,
        s => {
            return Err(invalid(format!(
                "q: expected [tokens, {q_heads}, head_dim], got {s:?}"
            )))
        }
    };
    let exact_rows = GROUP * kv_heads * d;
    if ek.shape != ev.shape || ek.values.len() % exact_rows.max(1) != 0 {
        return Err(invalid(format!(
            "exact_k/exact_v: expected equal [m, {GROUP}, {kv_heads}, {d}], got {:?} and {:?}",
            ek.shape, ev.shape
        )));
    }
    let coding = crate::codec::coding(body)?;
    let codec = sjkvarn::codec::BodyCodec::for_layer(
        d,
        k_bits,
        v_bits,
        coding,
        coding,
        sjkvarn::BalanceConfig::default(),
    )
    .map_err(errors::codec)?;
    with_bytes(pages, "pages", |bytes, shape| {
        let count = shape.first().copied().unwrap_or(0);
        let page = bytes.len().checked_div(count).unwrap_or(0);
        let exact = ek.values.len() / exact_rows.max(1);
        let mut list = Vec::with_capacity(blocks.len());
        for &b in &blocks {
            if b >= 0 {
                let b = b as usize;
                if b >= count {
                    return Err(invalid(format!("block {b} is past the {count} pages")));
                }
                list.push(PagedBlock::Record(&bytes[b * page..(b + 1) * page]));
            } else {
                let j = (-1 - b) as usize;
                if j >= exact {
                    return Err(invalid(format!(
                        "exact block {j} is past the {exact} given"
                    )));
                }
                let at = j * exact_rows..(j + 1) * exact_rows;
                list.push(PagedBlock::Rows {
                    k: &ek.values[at.clone()],
                    v: &ev.values[at],
                });
            }
        }
        let result = py
            .detach(|| {
                core_attend_paged(
                    &codec,
                    q_heads,
                    kv_heads,
                    &list,
                    first_position,
                    &qh.values,
                    query_position,
                    scale,
                )
            })
            .map_err(errors::cache)?;
        with_f32_out(out, "out", |o, shape| {
            if o.len() != result.len() {
                return Err(invalid(format!(
                    "out: expected {} values, got shape {shape:?}",
                    result.len()
                )));
            }
            o.copy_from_slice(&result);
            Ok(())
        })
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(attend_paged, m)?)?;
    Ok(())
}
