//! `sjkvarn._core.Cache`: one sequence of the journaled cache, tensors by DLPack.

use crate::dlpack::{read_f32, with_f32_out};
use crate::{coding, CodecError};
use pyo3::create_exception;
use pyo3::exceptions::{PyIndexError, PyMemoryError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use sjkvarn::cache::attention::attend;
use sjkvarn::cache::pool::PoolStats;
use sjkvarn::cache::{
    CacheConfig, CacheError as CoreError, LayerCoding, MemoryReport, Sequence, Staging,
};
use sjkvarn::gtq::KeySchedule;
use sjkvarn::{BalanceConfig, BalanceMode, BalanceStat};
use std::path::PathBuf;
use std::sync::Arc;

create_exception!(
    _core,
    CacheError,
    PyValueError,
    "Invalid use of a cache; the cache is unchanged."
);
create_exception!(
    _core,
    PoolExhaustedError,
    CacheError,
    "The record pool has no free slots for a seal."
);
create_exception!(
    _core,
    SnapshotError,
    CacheError,
    "A snapshot file was refused."
);

pub(crate) fn err(e: CoreError) -> PyErr {
    match e {
        CoreError::LayerOutOfRange { .. } => PyIndexError::new_err(e.to_string()),
        CoreError::PoolExhausted { .. } => PoolExhaustedError::new_err(e.to_string()),
        CoreError::Snapshot(_) => SnapshotError::new_err(e.to_string()),
        CoreError::Io(_) => PyOSError::new_err(e.to_string()),
        CoreError::OutOfMemory { .. } => PyMemoryError::new_err(e.to_string()),
        CoreError::Codec(c) => CodecError::new_err(c.to_string()),
        _ => CacheError::new_err(e.to_string()),
    }
}

/// A validated cache configuration, built once from the Python-side arguments and handed to
/// either backend (`Cache`, `DeviceCache`).
#[pyclass(frozen, module = "sjkvarn._core")]
pub struct CacheSpec {
    pub(crate) config: CacheConfig,
}

#[pymethods]
impl CacheSpec {
    /// `layer_coding` is one `(k_bits, v_bits, k_body, v_body)` per layer.
    #[new]
    #[pyo3(signature = (layers, q_heads, kv_heads, head_dim, layer_coding, min_tail, max_tail, max_chunk, max_tokens, passes, mode, stat, staging, key_schedules=None))]
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
        key_schedules: Option<Vec<Vec<Vec<u32>>>>,
    ) -> PyResult<Self> {
        let config = build_config(
            layers,
            q_heads,
            kv_heads,
            head_dim,
            layer_coding,
            (min_tail, max_tail, max_chunk, max_tokens),
            (passes, mode, stat),
            staging,
            key_schedules,
        )?;
        Ok(Self { config })
    }
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
    staging: &str,
    key_schedules: Option<Vec<Vec<Vec<u32>>>>,
) -> PyResult<CacheConfig> {
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
        mode: match mode {
            "final" => BalanceMode::Final,
            "best" => BalanceMode::Best,
            _ => {
                return Err(CacheError::new_err(format!(
                    "mode must be 'final' or 'best', got '{mode}'"
                )))
            }
        },
        stat: match stat {
            "std" => BalanceStat::Std,
            "rms" => BalanceStat::Rms,
            _ => {
                return Err(CacheError::new_err(format!(
                    "stat must be 'std' or 'rms', got '{stat}'"
                )))
            }
        },
    };
    let mut config = CacheConfig {
        layers,
        q_heads,
        kv_heads,
        head_dim,
        layer_coding,
        min_tail,
        max_tail,
        max_chunk,
        max_tokens,
        balance,
        staging: Staging::from_name(staging).map_err(err)?,
        key_schedules: Vec::new(),
    };
    if let Some(layers) = key_schedules {
        config.key_schedules = layers
            .into_iter()
            .map(|heads| {
                heads
                    .into_iter()
                    .map(|bits| KeySchedule::new(config.head_dim, bits))
                    .collect::<sjkvarn::Result<Vec<_>>>()
            })
            .collect::<sjkvarn::Result<Vec<_>>>()
            .map_err(|e| CacheError::new_err(e.to_string()))?;
    }
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
    d.set_item("pool_capacity_slots", pool.capacity)?;
    d.set_item("pool_used_slots", pool.used)?;
    d.set_item("pool_slot_bytes", pool.slot_bytes)?;
    Ok(d)
}

/// One sequence: sink, staging ring and sealed records in a (shareable) pool.
#[pyclass(module = "sjkvarn._core")]
pub struct Cache {
    pub(crate) seq: Sequence,
}

pub(crate) fn check_3d(shape: &[usize], what: &str, heads: usize, d: usize) -> PyResult<usize> {
    match shape {
        [n, h, dd] if *h == heads && *dd == d && *n > 0 => Ok(*n),
        _ => Err(CacheError::new_err(format!(
            "{what}: expected shape [tokens, {heads}, {d}] with tokens >= 1, got {shape:?}"
        ))),
    }
}

#[pymethods]
impl Cache {
    /// An empty cache on the CPU with a pool sized for `pool_sequences` full sequences.
    #[new]
    #[pyo3(signature = (spec, pool_sequences=1))]
    fn new(spec: &CacheSpec, pool_sequences: usize) -> PyResult<Self> {
        let config = spec.config.clone();
        let pool = Sequence::pool_for(&config, pool_sequences);
        Ok(Self {
            seq: Sequence::new(Arc::new(config), pool).map_err(err)?,
        })
    }

    /// Appends post-RoPE K and V `[tokens, kv_heads, head_dim]` to `layer`.
    fn append(
        &mut self,
        py: Python<'_>,
        layer: usize,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let cfg = self.seq.config();
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        if layer >= cfg.layers {
            return Err(err(CoreError::LayerOutOfRange {
                layer,
                layers: cfg.layers,
            }));
        }
        let (kh, vh) = (read_f32(k, "k")?, read_f32(v, "v")?);
        check_3d(&kh.shape, "k", h, d)?;
        check_3d(&vh.shape, "v", h, d)?;
        if kh.shape != vh.shape {
            return Err(CacheError::new_err(format!(
                "k and v shapes differ: {:?} vs {:?}",
                kh.shape, vh.shape
            )));
        }
        let seq = &mut self.seq;
        py.detach(|| seq.append(layer, &kh.values, &vh.values))
            .map_err(err)
    }

    /// Attention of `q` `[tokens, q_heads, head_dim]` (the newest `tokens` positions) into `out`
    /// (float32, same shape).
    #[pyo3(signature = (layer, q, out, scale=None))]
    fn attend_into(
        &self,
        py: Python<'_>,
        layer: usize,
        q: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        scale: Option<f32>,
    ) -> PyResult<()> {
        let cfg = self.seq.config();
        if layer >= cfg.layers {
            return Err(err(CoreError::LayerOutOfRange {
                layer,
                layers: cfg.layers,
            }));
        }
        let qh = read_f32(q, "q")?;
        check_3d(&qh.shape, "q", cfg.q_heads, cfg.head_dim)?;
        let seq = &self.seq;
        let result = py
            .detach(|| attend(seq, layer, &qh.values, scale))
            .map_err(err)?;
        with_f32_out(out, "out", |o, shape| {
            if shape != qh.shape.as_slice() {
                return Err(CacheError::new_err(format!(
                    "out has shape {shape:?}, expected {:?}",
                    qh.shape
                )));
            }
            o.copy_from_slice(&result);
            Ok(())
        })
    }

    /// Keeps the first `n` tokens; returns the position to re-append from.
    fn truncate(&mut self, n: usize) -> PyResult<usize> {
        self.seq.truncate(n).map_err(err)
    }

    /// Seals every layer back to `min_tail` unsealed tokens.
    fn seal_idle(&mut self, py: Python<'_>) -> PyResult<()> {
        let seq = &mut self.seq;
        py.detach(|| seq.seal_idle()).map_err(err)
    }

    /// A child cache sharing this one's sealed records and pool.
    fn fork(&self) -> Cache {
        Cache {
            seq: self.seq.fork(),
        }
    }

    /// Tokens held by `layer`.
    fn length(&self, layer: usize) -> PyResult<usize> {
        self.seq.len(layer).map_err(err)
    }

    /// `((sink_start, sink_end), (body_start, body_end), (ring_start, ring_end))` of `layer`.
    fn regions(&self, layer: usize) -> PyResult<Vec<(usize, usize)>> {
        Ok(self
            .seq
            .regions(layer)
            .map_err(err)?
            .iter()
            .map(|r| (r.start, r.end))
            .collect())
    }

    /// Tokens the next append to `layer` can take without a seal inside it.
    fn chunk_limit(&self, layer: usize) -> PyResult<usize> {
        self.seq.chunk_limit(layer).map_err(err)
    }

    /// Allocated bytes per region and occupied bits per value.
    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        memory_dict(py, &self.seq.memory(), &self.seq.pool().stats())
    }

    /// The snapshot as bytes.
    fn snapshot<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.seq.snapshot_bytes())
    }

    /// Writes a snapshot atomically.
    fn save(&self, path: PathBuf) -> PyResult<()> {
        self.seq.save(&path).map_err(err)
    }

    /// Restores a snapshot (a new pool sized for `pool_sequences` sequences).
    #[staticmethod]
    #[pyo3(signature = (path, pool_sequences=1))]
    fn load(path: PathBuf, pool_sequences: usize) -> PyResult<Cache> {
        let bytes = std::fs::read(&path)
            .map_err(|e| PyOSError::new_err(format!("{}: {e}", path.display())))?;
        Self::from_snapshot(&bytes, pool_sequences)
    }

    /// Restores from snapshot bytes.
    #[staticmethod]
    #[pyo3(signature = (data, pool_sequences=1))]
    fn from_snapshot(data: &[u8], pool_sequences: usize) -> PyResult<Cache> {
        // Peek at the configuration to size the pool, then restore into it.
        let probe = Sequence::from_snapshot(data, None, None).map_err(err)?;
        let pool = Sequence::pool_for(probe.config(), pool_sequences.max(1));
        let seq = Sequence::from_snapshot(data, Some(pool), Some(probe.config())).map_err(err)?;
        Ok(Cache { seq })
    }

    /// `(layers, q_heads, kv_heads, head_dim)`.
    #[getter]
    fn geometry(&self) -> (usize, usize, usize, usize) {
        let c = self.seq.config();
        (c.layers, c.q_heads, c.kv_heads, c.head_dim)
    }
}
