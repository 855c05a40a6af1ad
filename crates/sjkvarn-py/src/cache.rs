//! `sjkvarn._core.Cache`: one sequence of the journaled cache, tensors by DLPack.

use crate::codec::coding;
use crate::dlpack::{cuda_f32, read_f32, with_f32_out};
use crate::errors::{self, cuda_err, invalid};
use crate::shared::Shared;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use sjkvarn::attention::attend_with_threads;
use sjkvarn::backend::cuda::{DevicePool, DeviceSequence, ExternalStream};
use sjkvarn::backend::PoolStats;
use sjkvarn::backend::{MemoryReport, Sequence};
use sjkvarn::error::CacheError as CoreError;
use sjkvarn::journal::{CacheConfig, LayerCoding, SinkType};
use sjkvarn::{BalanceConfig, BalanceMode, BalanceStat, Journal};
use std::path::PathBuf;
use std::sync::Arc;

pub(crate) fn err(e: CoreError) -> PyErr {
    errors::cache(e)
}

/// A validated cache configuration, built once from the Python-side arguments and handed to
/// either backend.
#[pyclass(frozen, module = "sjkvarn._core")]
pub struct CacheSpec {
    pub(crate) config: CacheConfig,
}

#[pymethods]
impl CacheSpec {
    /// `layer_coding` is one `(k_bits, v_bits, k_body, v_body)` per layer.
    #[new]
    #[pyo3(signature = (layers, q_heads, kv_heads, head_dim, layer_coding, min_tail, max_tail, max_chunk, max_tokens, passes, mode, stat, staging, flush_chunk=0, sink_type="f16", sink=128, staging_budget=None, centre_keys=false, exact_recent=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        layer_coding: Vec<(u32, u32, String, String)>,
        min_tail: usize,
        max_tail: usize,
        max_chunk: usize,
        max_tokens: usize,
        passes: u32,
        mode: &str,
        stat: &str,
        staging: &str,
        flush_chunk: usize,
        sink_type: &str,
        sink: usize,
        staging_budget: Option<f32>,
        centre_keys: bool,
        exact_recent: usize,
    ) -> PyResult<Self> {
        let mut config = build_config(
            layers,
            q_heads,
            kv_heads,
            head_dim,
            layer_coding,
            (min_tail, max_tail, max_chunk, max_tokens),
            (passes, mode, stat),
            (staging, staging_budget),
        )?;
        config.flush_chunk = flush_chunk;
        config.sink = sink;
        config.centre_keys = centre_keys;
        config.exact_recent = exact_recent;
        config.sink_type = sink_type.parse::<SinkType>().map_err(err)?;
        config.validate().map_err(err)?;
        Ok(Self { config })
    }

    /// The validated configuration as a dict of the constructor's arguments.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_dict(py, &self.config)
    }
}

/// Every setting of a configuration, under the names `sjkvarn.Config` uses.
pub(crate) fn config_dict<'py>(py: Python<'py>, c: &CacheConfig) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("layers", c.layers)?;
    d.set_item("q_heads", c.q_heads)?;
    d.set_item("kv_heads", c.kv_heads)?;
    d.set_item("head_dim", c.head_dim)?;
    let coding: Vec<(u32, u32, &str, &str)> = c
        .layer_coding
        .iter()
        .map(|lc| (lc.k_bits, lc.v_bits, lc.k_coding.name(), lc.v_coding.name()))
        .collect();
    d.set_item("layer_coding", coding)?;
    d.set_item("min_tail", c.min_tail)?;
    d.set_item("max_tail", c.max_tail)?;
    d.set_item("max_chunk", c.max_chunk)?;
    d.set_item("max_tokens", c.max_tokens)?;
    d.set_item("flush_chunk", c.flush_chunk)?;
    d.set_item("sink", c.sink)?;
    d.set_item("passes", c.balance.passes)?;
    d.set_item("mode", c.balance.mode.name())?;
    d.set_item("stat", c.balance.stat.name())?;
    d.set_item("staging", c.staging_name())?;
    d.set_item("staging_budget", c.auto_staging)?;
    d.set_item("sink_type", c.sink_type.name())?;
    d.set_item("centre_keys", c.centre_keys)?;
    d.set_item("exact_recent", c.exact_recent)?;
    d.set_item("reference_format", c.is_reference())?;
    Ok(d)
}

/// Builds and validates a configuration from the Python-side arguments.
#[allow(clippy::too_many_arguments)]
fn build_config(
    layers: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    layer_coding: Vec<(u32, u32, String, String)>,
    (min_tail, max_tail, max_chunk, max_tokens): (usize, usize, usize, usize),
    (passes, mode, stat): (u32, &str, &str),
    (staging, staging_budget): (&str, Option<f32>),
) -> PyResult<CacheConfig> {
    let (k_staging, v_staging, auto_staging) =
        sjkvarn::journal::parse_staging(staging, staging_budget).map_err(err)?;
    let layer_coding = layer_coding
        .iter()
        .map(|(k, v, kb, vb)| {
            Ok(LayerCoding {
                k_bits: *k,
                v_bits: *v,
                k_coding: coding(kb)?,
                v_coding: coding(vb)?,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let balance = BalanceConfig {
        passes,
        mode: mode
            .parse::<BalanceMode>()
            .map_err(|e| invalid(e.to_string()))?,
        stat: stat
            .parse::<BalanceStat>()
            .map_err(|e| invalid(e.to_string()))?,
    };
    let config = CacheConfig {
        layers,
        q_heads,
        kv_heads,
        head_dim,
        layer_coding,
        min_tail,
        max_tail,
        max_chunk,
        flush_chunk: 0,
        max_tokens,
        balance,
        k_staging,
        v_staging,
        auto_staging,
        sink: sjkvarn::journal::SINK,
        sink_type: SinkType::F16,
        centre_keys: false,
        exact_recent: 0,
    };
    config.validate().map_err(err)?;
    Ok(config)
}

/// The Python view of a memory report and its pool's counters.
pub(crate) fn memory_dict<'py>(
    py: Python<'py>,
    m: &MemoryReport,
    pool: &PoolStats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("sink_bytes", m.sink_bytes)?;
    d.set_item("ring_bytes", m.ring_bytes)?;
    d.set_item("body_bytes", m.body_bytes)?;
    d.set_item(
        "allocated_bytes",
        m.sink_bytes + m.ring_bytes + m.body_bytes,
    )?;
    d.set_item("tokens", m.tokens)?;
    d.set_item("sink_tokens", m.sink_tokens)?;
    d.set_item("sealed_tokens", m.sealed_tokens)?;
    d.set_item("ring_tokens", m.ring_tokens)?;
    d.set_item("effective_bits", m.effective_bits)?;
    d.set_item("in_use_layers", m.in_use_layers)?;
    d.set_item("in_use_bytes", m.in_use_bytes)?;
    d.set_item("pool_capacity_slots", pool.capacity)?;
    d.set_item("pool_used_slots", pool.used)?;
    d.set_item("pool_slot_bytes", pool.slot_bytes)?;
    Ok(d)
}

/// One sequence: sink, staging ring and sealed records in a (shareable) pool. Safe to share
/// between Python threads (see `shared`).
/// Where a cache's sequence lives: host memory (the reference) or a CUDA device.
enum Backend {
    Cpu(Shared<Sequence>),
    Device {
        seq: Shared<DeviceSequence>,
        ordinal: usize,
    },
}

/// One sequence of the journaled cache on either backend; tensors by DLPack (host arrays for
/// a CPU cache, CUDA tensors on its device for a device cache). Safe to share between Python
/// threads (see `shared`).
#[pyclass(frozen, module = "sjkvarn._core")]
pub struct Cache {
    backend: Backend,
    /// The sequence's configuration, readable without taking the lock.
    pub(crate) config: Arc<CacheConfig>,
}

/// Runs `$body` on the sequence `$s` whichever backend holds it (through the
/// [`sjkvarn::Journal`] shell both implement), its error raised as the library's.
macro_rules! on_journal {
    ($self:expr, $py:expr, |$s:ident| $body:expr) => {
        match &$self.backend {
            Backend::Cpu(seq) => seq.with($py, |$s| $body)?.map_err(err),
            Backend::Device { seq, .. } => seq.with($py, |$s| $body)?.map_err(cuda_err),
        }
    };
}

impl Cache {
    pub(crate) fn wrap(seq: Sequence) -> Self {
        let config = Arc::new(seq.config().clone());
        Self {
            backend: Backend::Cpu(Shared::new(seq)),
            config,
        }
    }

    fn wrap_device(seq: DeviceSequence, ordinal: usize) -> Self {
        let config = Arc::new(seq.config().clone());
        Self {
            backend: Backend::Device {
                seq: Shared::new(seq),
                ordinal,
            },
            config,
        }
    }

    fn check_layer(&self, layer: usize) -> PyResult<()> {
        let layers = self.config.layers;
        if layer >= layers {
            return Err(err(CoreError::LayerOutOfRange { layer, layers }));
        }
        Ok(())
    }

    /// Runs `f` on the sequence in host memory: the CPU sequence itself, or a host copy of a
    /// device sequence (snapshots and states are the same bytes on both backends).
    fn on_host<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Sequence) -> Result<R, CoreError> + Send,
    ) -> PyResult<R> {
        match &self.backend {
            Backend::Cpu(seq) => seq.with(py, |s| f(s))?.map_err(err),
            Backend::Device { seq, .. } => {
                let host = seq.with(py, |s| Journal::to_host(s))?.map_err(cuda_err)?;
                py.detach(|| f(&host)).map_err(err)
            }
        }
    }

    fn check_device(ordinal: usize, id: i32, what: &str) -> PyResult<()> {
        if id as usize != ordinal {
            return Err(invalid(format!(
                "{what} is on cuda:{id}, this cache is on cuda:{ordinal}"
            )));
        }
        Ok(())
    }
}

pub(crate) fn check_3d(shape: &[usize], what: &str, heads: usize, d: usize) -> PyResult<usize> {
    match shape {
        [n, h, dd] if *h == heads && *dd == d && *n > 0 => Ok(*n),
        _ => Err(invalid(format!(
            "{what}: expected shape [tokens, {heads}, {d}] with tokens >= 1, got {shape:?}"
        ))),
    }
}

fn same_shape(k: &[usize], v: &[usize]) -> PyResult<()> {
    if k != v {
        return Err(invalid(format!("k and v shapes differ: {k:?} vs {v:?}")));
    }
    Ok(())
}

fn external(raw: Option<u64>) -> Option<ExternalStream> {
    raw.map(ExternalStream)
}

#[pymethods]
impl Cache {
    /// An empty cache with a pool sized for `pool_sequences` full sequences: on the CPU, or on
    /// `cuda:ordinal` when `ordinal` is given.
    #[new]
    #[pyo3(signature = (spec, pool_sequences=1, ordinal=None))]
    fn new(spec: &CacheSpec, pool_sequences: usize, ordinal: Option<usize>) -> PyResult<Self> {
        let config = Arc::new(spec.config.clone());
        match ordinal {
            None => {
                let pool = Sequence::pool_for(&config, pool_sequences);
                Ok(Self::wrap(Sequence::new(config, pool).map_err(err)?))
            }
            Some(ordinal) => {
                let pool =
                    DevicePool::for_config(ordinal, &config, pool_sequences).map_err(cuda_err)?;
                let seq = DeviceSequence::new(config, pool).map_err(cuda_err)?;
                Ok(Self::wrap_device(seq, ordinal))
            }
        }
    }

    /// Appends post-RoPE K and V `[tokens, kv_heads, head_dim]` to `layer`: host arrays
    /// (already in the Hadamard frame when `rotated`) on a CPU cache; float32 contiguous CUDA
    /// tensors on a device cache, read after the work queued on `stream` (the caller's raw
    /// CUDA stream).
    #[pyo3(signature = (layer, k, v, rotated=false, stream=None))]
    fn append(
        &self,
        py: Python<'_>,
        layer: usize,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        rotated: bool,
        stream: Option<u64>,
    ) -> PyResult<()> {
        self.check_layer(layer)?;
        let (h, d) = (self.config.kv_heads, self.config.head_dim);
        match &self.backend {
            Backend::Cpu(seq) => {
                let (kh, vh) = (read_f32(k, "k")?, read_f32(v, "v")?);
                check_3d(&kh.shape, "k", h, d)?;
                check_3d(&vh.shape, "v", h, d)?;
                same_shape(&kh.shape, &vh.shape)?;
                let (kv, vv) = (&kh.values, &vh.values);
                seq.with(py, |s| s.append_frame(layer, kv, vv, rotated))?
                    .map_err(err)
            }
            Backend::Device { seq, ordinal } => {
                if rotated {
                    return Err(invalid("rotated appends are CPU-only for now"));
                }
                let (kt, vt) = (cuda_f32(k, "k")?, cuda_f32(v, "v")?);
                Self::check_device(*ordinal, kt.device_id(), "k")?;
                Self::check_device(*ordinal, vt.device_id(), "v")?;
                let n = check_3d(kt.shape(), "k", h, d)?;
                check_3d(vt.shape(), "v", h, d)?;
                same_shape(kt.shape(), vt.shape())?;
                let (kp, vp) = (kt.ptr(), vt.ptr());
                seq.with(py, |s| {
                    // SAFETY: kp/vp address n compact float32 rows on this device (checked
                    // above); the capsules (kt, vt) keep them alive for this call, which reads
                    // them before it returns (the append waits for its staging kernel's status).
                    unsafe { s.append_raw(layer, kp, vp, n, external(stream)) }
                })?
                .map_err(cuda_err)
            }
        }
    }

    /// Attention of `q` `[tokens, q_heads, head_dim]` (the newest `tokens` positions) into `out`
    /// (float32, same shape): host arrays on at most `threads` threads on a CPU cache, float32
    /// contiguous CUDA tensors ordered after `stream` on a device cache.
    #[pyo3(signature = (layer, q, out, scale=None, threads=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn attend_into(
        &self,
        py: Python<'_>,
        layer: usize,
        q: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        scale: Option<f32>,
        threads: Option<usize>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        self.check_layer(layer)?;
        let (qh_count, d) = (self.config.q_heads, self.config.head_dim);
        match &self.backend {
            Backend::Cpu(seq) => {
                let qh = read_f32(q, "q")?;
                check_3d(&qh.shape, "q", qh_count, d)?;
                let qv = &qh.values;
                let result = seq
                    .with(py, |s| attend_with_threads(s, layer, qv, scale, threads))?
                    .map_err(err)?;
                with_f32_out(out, "out", |o, shape| {
                    if shape != qh.shape.as_slice() {
                        return Err(invalid(format!(
                            "out has shape {shape:?}, expected {:?}",
                            qh.shape
                        )));
                    }
                    o.copy_from_slice(&result);
                    Ok(())
                })
            }
            Backend::Device { seq, ordinal } => {
                if threads.is_some() {
                    return Err(invalid(
                        "threads applies to CPU caches; this cache is on CUDA",
                    ));
                }
                let (qt, ot) = (cuda_f32(q, "q")?, cuda_f32(out, "out")?);
                Self::check_device(*ordinal, qt.device_id(), "q")?;
                Self::check_device(*ordinal, ot.device_id(), "out")?;
                let n = check_3d(qt.shape(), "q", qh_count, d)?;
                if ot.shape() != qt.shape() {
                    return Err(invalid(format!(
                        "out has shape {:?}, expected {:?}",
                        ot.shape(),
                        qt.shape()
                    )));
                }
                let (qp, op) = (qt.ptr(), ot.ptr());
                seq.with(py, |s| {
                    // SAFETY: both address n x q_heads x head_dim float32 on this device, kept
                    // alive by the capsules (qt, ot); the caller's stream waits for the queued
                    // kernels before it may reuse or read them.
                    unsafe { s.attend_raw(layer, qp, n, op, scale, external(stream)) }
                })?
                .map_err(cuda_err)
            }
        }
    }

    /// Keeps the first `n` tokens; returns the position to re-append from.
    fn truncate(&self, py: Python<'_>, n: usize) -> PyResult<usize> {
        on_journal!(self, py, |s| Journal::truncate(s, n))
    }

    /// The idle step: seals every layer back to `min_tail` unsealed tokens, never the last
    /// `max(keep_recent, min_tail)` positions.
    #[pyo3(signature = (keep_recent=0))]
    fn seal_idle(&self, py: Python<'_>, keep_recent: usize) -> PyResult<()> {
        on_journal!(self, py, |s| Journal::seal_idle(s, keep_recent))
    }

    /// A child cache sharing this one's sealed records and pool, on the same backend.
    fn fork(&self, py: Python<'_>) -> PyResult<Cache> {
        Ok(match &self.backend {
            Backend::Cpu(seq) => Cache::wrap(seq.with(py, |s| s.fork())?),
            Backend::Device { seq, ordinal } => {
                Cache::wrap_device(seq.with(py, |s| s.fork())?.map_err(cuda_err)?, *ordinal)
            }
        })
    }

    /// Tokens held by `layer`.
    fn length(&self, py: Python<'_>, layer: usize) -> PyResult<usize> {
        on_journal!(self, py, |s| Journal::len(s, layer))
    }

    /// `((sink_start, sink_end), (body_start, body_end), (ring_start, ring_end))` of `layer`.
    fn regions(&self, py: Python<'_>, layer: usize) -> PyResult<Vec<(usize, usize)>> {
        let regions = on_journal!(self, py, |s| Journal::regions(s, layer))?;
        Ok(regions.iter().map(|r| (r.start, r.end)).collect())
    }

    /// Tokens the next append to `layer` can take without a seal inside it.
    fn chunk_limit(&self, py: Python<'_>, layer: usize) -> PyResult<usize> {
        on_journal!(self, py, |s| Journal::chunk_limit(s, layer))
    }

    /// Allocated bytes per region and occupied bits per value.
    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (m, stats) = match &self.backend {
            Backend::Cpu(seq) => seq.with(py, |s| (Journal::memory(s), s.pool_stats()))?,
            Backend::Device { seq, .. } => {
                seq.with(py, |s| (Journal::memory(s), s.pool_stats()))?
            }
        };
        memory_dict(py, &m, &stats)
    }

    /// Per layer, what `staging="auto"` measured and picked (`None` for a fixed staging, a
    /// layer nothing was appended to yet, or a device cache, whose ring is always `tq6_0`).
    fn staging_report<'py>(&self, py: Python<'py>) -> PyResult<Vec<Option<Bound<'py, PyDict>>>> {
        let Backend::Cpu(seq) = &self.backend else {
            return Ok(vec![None; self.config.layers]);
        };
        let picks = seq.with(py, |s| {
            (0..s.config().layers)
                .map(|l| s.staging_pick(l).map(|p| p.cloned()))
                .collect::<Result<Vec<_>, _>>()
        })?;
        picks
            .map_err(err)?
            .into_iter()
            .map(|p| {
                p.map(|p| {
                    let d = PyDict::new(py);
                    d.set_item("k", p.k.name())?;
                    d.set_item("v", p.v.name())?;
                    let names: Vec<&str> = sjkvarn::journal::auto_staging::CANDIDATES
                        .iter()
                        .map(|c| c.name())
                        .collect();
                    d.set_item("candidates", names)?;
                    d.set_item("k_scores", p.k_scores.to_vec())?;
                    d.set_item("v_scores", p.v_scores.to_vec())?;
                    d.set_item("rows", p.rows)?;
                    d.set_item("budget", p.budget)?;
                    d.set_item("restored", p.restored)?;
                    d.set_item("explanation", p.explain())?;
                    Ok(d)
                })
                .transpose()
            })
            .collect()
    }

    /// The snapshot as bytes (the same on both backends).
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.on_host(py, |s| s.snapshot_bytes())?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The sequence as an `SJKVSEQ` v1 state stream (the reference codec's layout).
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.on_host(py, |s| s.state_bytes())?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Restores an `SJKVSEQ` stream into a new CPU cache of `spec`.
    #[staticmethod]
    #[pyo3(signature = (spec, data, pool_sequences=1))]
    fn from_state(spec: &CacheSpec, data: &[u8], pool_sequences: usize) -> PyResult<Cache> {
        let config = spec.config.clone();
        let pool = Sequence::pool_for(&config, pool_sequences);
        let seq = Sequence::from_state(Arc::new(config), Some(pool), data).map_err(err)?;
        Ok(Cache::wrap(seq))
    }

    /// The cache's full configuration (see `CacheSpec.to_dict`).
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_dict(py, &self.config)
    }

    /// Writes a snapshot atomically (the same bytes on both backends).
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        self.on_host(py, |s| s.save(&path))
    }

    /// Restores a snapshot into a CPU cache (a new pool sized for `pool_sequences` sequences).
    #[staticmethod]
    #[pyo3(signature = (path, pool_sequences=1))]
    fn load(path: PathBuf, pool_sequences: usize) -> PyResult<Cache> {
        let bytes = std::fs::read(&path).map_err(|e| errors::io(&path, e))?;
        Self::from_snapshot(&bytes, pool_sequences)
    }

    /// Restores from snapshot bytes into a CPU cache.
    #[staticmethod]
    #[pyo3(signature = (data, pool_sequences=1))]
    fn from_snapshot(data: &[u8], pool_sequences: usize) -> PyResult<Cache> {
        // Peek at the configuration to size the pool, then restore into it.
        let probe = Sequence::from_snapshot(data, None, None).map_err(err)?;
        let pool = Sequence::pool_for(probe.config(), pool_sequences.max(1));
        let seq = Sequence::from_snapshot(data, Some(pool), Some(probe.config())).map_err(err)?;
        Ok(Cache::wrap(seq))
    }

    /// A copy holding the same bytes on the CPU (`ordinal=None`) or on `cuda:ordinal`, with a
    /// pool of its own sized for `pool_sequences` sequences.
    #[pyo3(signature = (ordinal=None, pool_sequences=1))]
    fn copy_to(
        &self,
        py: Python<'_>,
        ordinal: Option<usize>,
        pool_sequences: usize,
    ) -> PyResult<Cache> {
        let config = self.config.clone();
        match ordinal {
            None => {
                let bytes = self.on_host(py, |s| s.snapshot_bytes())?;
                Self::from_snapshot(&bytes, pool_sequences)
            }
            Some(ordinal) => {
                let pool =
                    DevicePool::for_config(ordinal, &config, pool_sequences).map_err(cuda_err)?;
                let seq = match &self.backend {
                    Backend::Cpu(seq) => seq
                        .with(py, |h| DeviceSequence::from_host(h, pool))?
                        .map_err(cuda_err)?,
                    Backend::Device { seq, .. } => {
                        let host = seq.with(py, |s| Journal::to_host(s))?.map_err(cuda_err)?;
                        py.detach(|| DeviceSequence::from_host(&host, pool))
                            .map_err(cuda_err)?
                    }
                };
                Ok(Self::wrap_device(seq, ordinal))
            }
        }
    }

    /// `(layers, q_heads, kv_heads, head_dim)`.
    #[getter]
    fn geometry(&self) -> (usize, usize, usize, usize) {
        let c = &self.config;
        (c.layers, c.q_heads, c.kv_heads, c.head_dim)
    }

    /// The CUDA device ordinal of a device cache, `None` on the CPU.
    #[getter]
    fn ordinal(&self) -> Option<usize> {
        match &self.backend {
            Backend::Cpu(_) => None,
            Backend::Device { ordinal, .. } => Some(*ordinal),
        }
    }
}

/// Test hook: every seal record encode after the next `after` fails (`None` disarms). For the
/// tests that check a failed seal leaves a cache as it was, on the CPU and on a GPU; only in the
/// test build (`fault-injection` feature).
#[cfg(feature = "fault-injection")]
#[pyfunction]
#[pyo3(signature = (after))]
fn _inject_seal_failure(after: Option<usize>) {
    match after {
        Some(n) => sjkvarn::backend::cpu::faults::fail_seals_after(n),
        None => sjkvarn::backend::cpu::faults::clear(),
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Cache>()?;
    m.add_class::<CacheSpec>()?;
    #[cfg(feature = "fault-injection")]
    m.add_function(wrap_pyfunction!(_inject_seal_failure, m)?)?;
    Ok(())
}
