//! The engine-paged journal (`sjkvarn.vllm`): attention over an engine's page tensor, and the
//! crate's per-layer journals and per-step plan (`sjkvarn::backend::paged`) as Python classes.

use crate::dlpack::{
    read_f32, read_i64, with_bytes, with_f32_out, with_pages_mut, HostArray, HostInts, PageSpan,
};
use crate::errors::{self, invalid, paged_err};
use pyo3::prelude::*;
use pyo3::types::PyByteArray;
use sjkvarn::attention::{attend_paged as core_attend_paged, PagedBlock};
use sjkvarn::backend::paged::{
    Dense, PageDtype, PagedJournal as CoreJournal, PagedSettings, Pages, PagesMut, StepPlan,
    WindowJournal as CoreWindow, WindowPages, WindowPagesMut,
};
use sjkvarn::codec::extension::body::GROUP;
use std::sync::{Mutex, MutexGuard, TryLockError};

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

/// A step's new rows and their slots, checked: `key`/`value` `[slots, kv_heads, head_dim]`.
fn step_rows(
    key: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    kv_heads: usize,
    head_dim: usize,
) -> PyResult<(HostArray, HostArray, HostInts)> {
    let (k, v) = (read_f32(key, "key")?, read_f32(value, "value")?);
    let slots = read_i64(slots, "slots")?;
    let want = [slots.values.len(), kv_heads, head_dim];
    if k.shape != want || v.shape != want {
        return Err(invalid(format!(
            "key/value: expected {want:?} each, got {:?} and {:?}",
            k.shape, v.shape
        )));
    }
    Ok((k, v, slots))
}

/// Settings from the plugin's values, checked by the crate (the plugin's messages).
fn settings_of(
    k_bits: i64,
    v_bits: i64,
    body: &str,
    sink: bool,
    lossless: bool,
    max_sink_blocks: i64,
) -> PyResult<PagedSettings> {
    PagedSettings::new(k_bits, v_bits, body, sink, lossless, max_sink_blocks).map_err(paged_err)
}

/// Checks paged-cache settings; raises `InvalidInputError` naming the bad value.
#[pyfunction]
pub(crate) fn paged_check(
    k_bits: i64,
    v_bits: i64,
    body: &str,
    sink: bool,
    lossless: bool,
    max_sink_blocks: i64,
) -> PyResult<()> {
    settings_of(k_bits, v_bits, body, sink, lossless, max_sink_blocks).map(|_| ())
}

/// `(state_bytes, window_block_tokens)` for a head size and page dtype: one KV head's share
/// of a block page, and the tokens a sliding-window page holds.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_sizes(
    k_bits: i64,
    v_bits: i64,
    body: &str,
    sink: bool,
    lossless: bool,
    max_sink_blocks: i64,
    head_dim: usize,
    dtype: &str,
) -> PyResult<(usize, usize)> {
    let s = settings_of(k_bits, v_bits, body, sink, lossless, max_sink_blocks)?;
    let dtype = PageDtype::from_name(dtype).map_err(paged_err)?;
    Ok((
        s.state_bytes(head_dim, dtype).map_err(paged_err)?,
        s.window_block_tokens(head_dim).map_err(paged_err)?,
    ))
}

/// Sequences of `tokens` per GiB of KV memory (`PagedSettings::sequences_per_gib`).
#[pyfunction]
#[pyo3(signature = (k_bits, v_bits, body, sink, lossless, max_sink_blocks, tokens, layers, kv_heads, head_dim, dtype, window_layers, window))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_sequences_per_gib(
    k_bits: i64,
    v_bits: i64,
    body: &str,
    sink: bool,
    lossless: bool,
    max_sink_blocks: i64,
    tokens: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: &str,
    window_layers: usize,
    window: usize,
) -> PyResult<f64> {
    let s = settings_of(k_bits, v_bits, body, sink, lossless, max_sink_blocks)?;
    let dtype = PageDtype::from_name(dtype).map_err(paged_err)?;
    s.sequences_per_gib(
        tokens,
        layers,
        kv_heads,
        head_dim,
        dtype,
        window_layers,
        window,
    )
    .map_err(paged_err)
}

/// One engine step's read plan (`sjkvarn.vllm`): built once from the step's metadata and
/// shared, read only, by every layer of the step.
#[pyclass(frozen, module = "sjkvarn._core", name = "PagedStep")]
pub(crate) struct PagedStep {
    plan: StepPlan,
}

#[pymethods]
impl PagedStep {
    /// `query_start` (`[requests + 1]`), `seq_lens` (`[requests]`) and `block_table`
    /// (`[requests, width]`): int32 or int64 CPU tensors; `block_size`: tokens per page.
    #[new]
    fn new(
        query_start: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        block_table: &Bound<'_, PyAny>,
        block_size: usize,
    ) -> PyResult<Self> {
        let qs = read_i64(query_start, "query_start")?;
        let lens = read_i64(seq_lens, "seq_lens")?;
        let table = read_i64(block_table, "block_table")?;
        let width = match table.shape.as_slice() {
            [r, w] if *r == lens.values.len() => *w,
            s => {
                return Err(invalid(format!(
                    "block_table: expected [{}, blocks], got {s:?}",
                    lens.values.len()
                )))
            }
        };
        let plan = StepPlan::new(&qs.values, &lens.values, &table.values, width, block_size)
            .map_err(paged_err)?;
        Ok(Self { plan })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.plan.block_size()
    }

    /// Query rows the step covers.
    #[getter]
    fn tokens(&self) -> usize {
        self.plan.tokens()
    }

    /// First blocks of the step's sequences: the sinks layers keep exact.
    #[getter]
    fn live_sinks(&self) -> Vec<usize> {
        self.plan.live_sinks().to_vec()
    }

    /// `(start, end, position)` of each query block: rows `start:end` of the step's queries,
    /// the first at `position`.
    #[getter]
    fn query_blocks(&self) -> Vec<(usize, usize, usize)> {
        let qbs = self.plan.query_blocks();
        qbs.iter()
            .map(|b| (b.queries.start, b.queries.end, b.position))
            .collect()
    }

    /// `(start, end, position)` of each request with queries.
    #[getter]
    fn requests(&self) -> Vec<(usize, usize, usize)> {
        let spans = self.plan.spans();
        spans
            .iter()
            .map(|s| (s.queries.start, s.queries.end, s.first_position()))
            .collect()
    }
}

/// Dense K and V as `(k, v, tokens, first_position)`, each a bytearray of float32
/// `[kv_heads, tokens, head_dim]`.
fn dense_out(py: Python<'_>, d: Dense) -> (Py<PyByteArray>, Py<PyByteArray>, usize, usize) {
    let bytes = |x: &[f32]| -> Py<PyByteArray> {
        let raw: Vec<u8> = x.iter().flat_map(|v| v.to_ne_bytes()).collect();
        PyByteArray::new(py, &raw).unbind()
    };
    (bytes(&d.k), bytes(&d.v), d.tokens, d.first_position)
}

/// One full-attention layer's journal over the engine's page tensor: open blocks' exact rows,
/// sink copies and seals live here. Calls from several threads at once are refused (an engine
/// runs one layer's steps in order).
#[pyclass(frozen, module = "sjkvarn._core", name = "PagedJournal")]
pub(crate) struct PagedJournal {
    inner: Mutex<CoreJournal>,
    kv_heads: usize,
    head_dim: usize,
}

impl PagedJournal {
    fn lock(&self) -> PyResult<MutexGuard<'_, CoreJournal>> {
        match self.inner.try_lock() {
            Ok(guard) => Ok(guard),
            Err(TryLockError::WouldBlock) => Err(invalid(
                "PagedJournal is in use by another thread: one layer's calls must not overlap",
            )),
            Err(TryLockError::Poisoned(_)) => Err(invalid(
                "PagedJournal is unusable: an earlier call on it panicked",
            )),
        }
    }
}

fn pages_of<'a>(bytes: &'a [u8], span: &PageSpan, what: &str) -> PyResult<Pages<'a>> {
    if span.count > 1 && span.stride != bytes.len() / span.count.max(1) {
        return Err(invalid(format!("{what}: must be C-contiguous")));
    }
    Ok(Pages {
        bytes,
        count: span.count,
    })
}

#[pymethods]
impl PagedJournal {
    #[new]
    #[pyo3(signature = (k_bits, v_bits, body, sink, lossless, max_sink_blocks, kv_heads, head_dim, dtype, window=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        k_bits: i64,
        v_bits: i64,
        body: &str,
        sink: bool,
        lossless: bool,
        max_sink_blocks: i64,
        kv_heads: usize,
        head_dim: usize,
        dtype: &str,
        window: Option<i64>,
    ) -> PyResult<Self> {
        let settings = settings_of(k_bits, v_bits, body, sink, lossless, max_sink_blocks)?;
        let dtype = PageDtype::from_name(dtype).map_err(paged_err)?;
        let window = window
            .and_then(|w| usize::try_from(w).ok())
            .filter(|&w| w > 0);
        let journal =
            CoreJournal::new(settings, kv_heads, head_dim, dtype, window).map_err(paged_err)?;
        Ok(Self {
            inner: Mutex::new(journal),
            kv_heads,
            head_dim,
        })
    }

    /// Bytes of one KV head's share of a page.
    #[getter]
    fn state_bytes(&self) -> PyResult<usize> {
        Ok(self.lock()?.state_bytes())
    }

    /// Whether `attend` serves this layer (records read in place); otherwise `dense`.
    #[getter]
    fn reads_in_place(&self) -> PyResult<bool> {
        Ok(self.lock()?.reads_in_place())
    }

    /// Blocks held open (exact rows beside the pages), ascending.
    fn open_blocks(&self) -> PyResult<Vec<usize>> {
        Ok(self.lock()?.open_blocks())
    }

    /// Sink blocks held exact, least recently used first.
    fn sink_blocks(&self) -> PyResult<Vec<usize>> {
        Ok(self.lock()?.sink_blocks())
    }

    /// Stores rows `key`/`value` (`[tokens, kv_heads, head_dim]`) at `slots` (int tensor;
    /// negative is padding), sealing full blocks into `pages` in place.
    fn write(
        &self,
        py: Python<'_>,
        pages: &Bound<'_, PyAny>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (k, v, slots) = step_rows(key, value, slots, self.kv_heads, self.head_dim)?;
        let mut journal = self.lock()?;
        let journal = &mut *journal;
        with_pages_mut(pages, "pages", |bytes, span| {
            pages_of(bytes, &span, "pages")?;
            let count = span.count;
            py.detach(|| {
                journal.write(
                    PagesMut { bytes, count },
                    &k.values,
                    &v.values,
                    &slots.values,
                )
            })
            .map_err(paged_err)
        })
    }

    /// Attention of the step's queries (`[tokens, q_heads, head_dim]`) over `pages` as `step`
    /// plans it; writes `out` (float32, the query's shape).
    fn attend(
        &self,
        py: Python<'_>,
        pages: &Bound<'_, PyAny>,
        step: &Bound<'_, PagedStep>,
        query: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        scale: f32,
    ) -> PyResult<()> {
        let q = read_f32(query, "query")?;
        let q_heads = match q.shape.as_slice() {
            [_, h, d] if *d == self.head_dim => *h,
            s => {
                return Err(invalid(format!(
                    "query: expected [tokens, q_heads, {}], got {s:?}",
                    self.head_dim
                )))
            }
        };
        let journal = self.lock()?;
        let journal = &*journal;
        let plan = &step.get().plan;
        let result = with_pages_mut(pages, "pages", |bytes, span| {
            let pages = pages_of(bytes, &span, "pages")?;
            py.detach(|| journal.attend(pages, plan, &q.values, q_heads, scale))
                .map_err(paged_err)
        })?;
        with_f32_out(out, "out", |o, shape| {
            if o.len() != result.len() {
                return Err(invalid(format!(
                    "out: expected {:?}, got {shape:?}",
                    q.shape
                )));
            }
            o.copy_from_slice(&result);
            Ok(())
        })
    }

    /// `(k, v, tokens, first_position)`: the keys and values query block `index` of `step`
    /// reads (lossless pages, sliding windows), float32 `[kv_heads, tokens, head_dim]` bytes.
    fn dense(
        &self,
        py: Python<'_>,
        pages: &Bound<'_, PyAny>,
        step: &Bound<'_, PagedStep>,
        index: usize,
    ) -> PyResult<(Py<PyByteArray>, Py<PyByteArray>, usize, usize)> {
        let journal = self.lock()?;
        let journal = &*journal;
        let plan = &step.get().plan;
        let dense = with_pages_mut(pages, "pages", |bytes, span| {
            let pages = pages_of(bytes, &span, "pages")?;
            py.detach(|| journal.dense(pages, plan, index))
                .map_err(paged_err)
        })?;
        Ok(dense_out(py, dense))
    }

    /// Drops the exact rows of full blocks that are no sink; keeps `live_sinks` exact, up to
    /// `max_sink_blocks`.
    fn forget(&self, live_sinks: Vec<usize>) -> PyResult<()> {
        self.lock()?.forget(&live_sinks);
        Ok(())
    }
}

/// One sliding-window layer: fp16 rows in the (possibly padded) pages; no state beside them.
#[pyclass(frozen, module = "sjkvarn._core", name = "WindowJournal")]
pub(crate) struct WindowJournal {
    inner: CoreWindow,
    kv_heads: usize,
    head_dim: usize,
}

#[pymethods]
impl WindowJournal {
    #[new]
    fn new(kv_heads: usize, head_dim: usize, window: i64) -> PyResult<Self> {
        Ok(Self {
            inner: CoreWindow::new(kv_heads, head_dim, window).map_err(paged_err)?,
            kv_heads,
            head_dim,
        })
    }

    #[getter]
    fn window(&self) -> usize {
        self.inner.window()
    }

    /// Stores rows `key`/`value` (`[tokens, kv_heads, head_dim]`) at `slots` as fp16 in
    /// `pages` (`[blocks, kv_heads, tokens, row]`, any dtype).
    fn write(
        &self,
        py: Python<'_>,
        pages: &Bound<'_, PyAny>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (k, v, slots) = step_rows(key, value, slots, self.kv_heads, self.head_dim)?;
        if k.values.iter().chain(&v.values).any(|x| !x.is_finite()) {
            return Err(invalid("key/value rows hold NaN or Inf"));
        }
        let journal = &self.inner;
        with_pages_mut(pages, "pages", |bytes, span| {
            journal.check_shape(&span.shape_bytes).map_err(paged_err)?;
            let pages = WindowPagesMut {
                bytes,
                count: span.count,
                page_stride: span.stride,
                tokens: span.shape_bytes[2],
            };
            py.detach(|| journal.write(pages, &k.values, &v.values, &slots.values))
                .map_err(paged_err)
        })
    }

    /// `(k, v, tokens, first_position)`: what request `index` of `step` reads, float32
    /// `[kv_heads, tokens, head_dim]` bytes.
    fn dense(
        &self,
        py: Python<'_>,
        pages: &Bound<'_, PyAny>,
        step: &Bound<'_, PagedStep>,
        index: usize,
    ) -> PyResult<(Py<PyByteArray>, Py<PyByteArray>, usize, usize)> {
        let journal = &self.inner;
        let plan = &step.get().plan;
        let dense = with_pages_mut(pages, "pages", |bytes, span| {
            journal.check_shape(&span.shape_bytes).map_err(paged_err)?;
            let pages = WindowPages {
                bytes,
                count: span.count,
                page_stride: span.stride,
                tokens: span.shape_bytes[2],
            };
            py.detach(|| journal.dense(pages, plan, index))
                .map_err(paged_err)
        })?;
        Ok(dense_out(py, dense))
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(attend_paged, m)?)?;
    m.add_function(wrap_pyfunction!(paged_check, m)?)?;
    m.add_function(wrap_pyfunction!(paged_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(paged_sequences_per_gib, m)?)?;
    m.add_class::<PagedStep>()?;
    m.add_class::<PagedJournal>()?;
    m.add_class::<WindowJournal>()?;
    Ok(())
}
