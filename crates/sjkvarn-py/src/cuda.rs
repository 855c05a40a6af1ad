//! `sjkvarn._core.DeviceCache`: one sequence with its journal in CUDA memory, torch CUDA
//! tensors by DLPack, work ordered against the caller's stream with events.

use crate::cache::{check_3d, err, memory_dict, Cache, CacheSpec};
use crate::dlpack::cuda_f32;
use crate::errors::{invalid, raise, Kind};
use crate::shared::Shared;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use sjkvarn::cache::{CacheConfig, CacheError as CoreError, RecordPool};
use sjkvarn::cuda::{availability, CudaError, DevicePool, DeviceSequence, ExternalStream};
use std::sync::Arc;

fn cuda_err(e: CudaError) -> PyErr {
    match e {
        CudaError::Cache(c) => err(c),
        CudaError::Unavailable(_) => raise(Kind::CudaUnavailable, e.to_string()),
        CudaError::Unsupported(_) | CudaError::Rejected(_) => invalid(e.to_string()),
        CudaError::Driver(_) | CudaError::Compile { .. } => raise(Kind::CudaBackend, e.to_string()),
    }
}

/// `(available, description)`: the device found, or why the backend cannot run.
#[pyfunction]
#[pyo3(signature = (ordinal=0))]
pub fn cuda_status(ordinal: usize) -> (bool, String) {
    match availability(ordinal) {
        Ok(info) => (
            true,
            format!(
                "{} (compute capability {}.{}, {:.1} GiB), device {} of {}",
                info.name,
                info.compute_capability.0,
                info.compute_capability.1,
                info.total_memory as f64 / (1u64 << 30) as f64,
                info.ordinal,
                info.devices
            ),
        ),
        Err(e) => (false, e.to_string()),
    }
}

/// Compiles the kernels with NVRTC for `arch` (e.g. `compute_90`) through the on-disk cache and
/// returns the PTX. Needs libnvrtc only, no GPU.
#[pyfunction]
pub fn compile_kernels(arch: &str) -> PyResult<String> {
    let known = sjkvarn::cuda::KERNEL_ARCHES
        .iter()
        .find(|a| **a == arch)
        .ok_or_else(|| {
            invalid(format!(
                "unknown architecture {arch}; known: {:?}",
                sjkvarn::cuda::KERNEL_ARCHES
            ))
        })?;
    sjkvarn::cuda::compile_ptx(known).map_err(cuda_err)
}

/// One sequence on a CUDA device. Safe to share between Python threads (see `shared`).
#[pyclass(frozen, module = "sjkvarn._core")]
pub struct DeviceCache {
    seq: Shared<DeviceSequence>,
    config: Arc<CacheConfig>,
    ordinal: usize,
}

fn external(raw: Option<u64>) -> Option<ExternalStream> {
    raw.map(ExternalStream)
}

impl DeviceCache {
    fn wrap(seq: DeviceSequence, ordinal: usize) -> Self {
        let config = Arc::new(seq.config().clone());
        Self {
            seq: Shared::new(seq),
            config,
            ordinal,
        }
    }

    fn check_layer(&self, layer: usize) -> PyResult<()> {
        let layers = self.config.layers;
        if layer >= layers {
            return Err(err(CoreError::LayerOutOfRange { layer, layers }));
        }
        Ok(())
    }

    fn check_device(&self, id: i32, what: &str) -> PyResult<()> {
        if id as usize != self.ordinal {
            return Err(invalid(format!(
                "{what} is on cuda:{id}, this cache is on cuda:{}",
                self.ordinal
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl DeviceCache {
    /// An empty cache on `cuda:ordinal` with a pool sized for `pool_sequences` full sequences.
    #[new]
    #[pyo3(signature = (ordinal, spec, pool_sequences=1))]
    fn new(ordinal: usize, spec: &CacheSpec, pool_sequences: usize) -> PyResult<Self> {
        let config = spec.config.clone();
        let pool = DevicePool::for_config(ordinal, &config, pool_sequences).map_err(cuda_err)?;
        let seq = DeviceSequence::new(Arc::new(config), pool).map_err(cuda_err)?;
        Ok(Self::wrap(seq, ordinal))
    }

    /// Appends float32 contiguous CUDA K and V `[tokens, kv_heads, head_dim]`; `stream` is the
    /// caller's raw CUDA stream (inputs are read after the work queued on it).
    #[pyo3(signature = (layer, k, v, stream=None))]
    fn append(
        &self,
        py: Python<'_>,
        layer: usize,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        self.check_layer(layer)?;
        let (h, d) = (self.config.kv_heads, self.config.head_dim);
        let (kt, vt) = (cuda_f32(k, "k")?, cuda_f32(v, "v")?);
        self.check_device(kt.device_id(), "k")?;
        self.check_device(vt.device_id(), "v")?;
        let n = check_3d(kt.shape(), "k", h, d)?;
        check_3d(vt.shape(), "v", h, d)?;
        if kt.shape() != vt.shape() {
            return Err(invalid(format!(
                "k and v shapes differ: {:?} vs {:?}",
                kt.shape(),
                vt.shape()
            )));
        }
        let (kp, vp) = (kt.ptr(), vt.ptr());
        self.seq
            .with(py, |seq| {
                // SAFETY: kp/vp address n compact float32 rows on this device (checked above);
                // the capsules (kt, vt) keep them alive for this call, which reads them before
                // it returns (the append waits for its staging kernel's status).
                unsafe { seq.append_raw(layer, kp, vp, n, external(stream)) }
            })?
            .map_err(cuda_err)
    }

    /// Attention of float32 contiguous CUDA `q` `[tokens, q_heads, head_dim]` into `out`.
    #[pyo3(signature = (layer, q, out, scale=None, stream=None))]
    fn attend_into(
        &self,
        py: Python<'_>,
        layer: usize,
        q: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        scale: Option<f32>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        self.check_layer(layer)?;
        let (qt, ot) = (cuda_f32(q, "q")?, cuda_f32(out, "out")?);
        self.check_device(qt.device_id(), "q")?;
        self.check_device(ot.device_id(), "out")?;
        let n = check_3d(qt.shape(), "q", self.config.q_heads, self.config.head_dim)?;
        if ot.shape() != qt.shape() {
            return Err(invalid(format!(
                "out has shape {:?}, expected {:?}",
                ot.shape(),
                qt.shape()
            )));
        }
        let (qp, op) = (qt.ptr(), ot.ptr());
        self.seq
            .with(py, |seq| {
                // SAFETY: both address n x q_heads x head_dim float32 on this device, kept
                // alive by the capsules (qt, ot); the caller's stream waits for the queued
                // kernels before it may reuse or read them.
                unsafe { seq.attend_raw(layer, qp, n, op, scale, external(stream)) }
            })?
            .map_err(cuda_err)
    }

    fn truncate(&self, py: Python<'_>, n: usize) -> PyResult<usize> {
        self.seq.with(py, |s| s.truncate(n))?.map_err(cuda_err)
    }

    #[pyo3(signature = (keep_recent=0))]
    fn seal_idle(&self, py: Python<'_>, keep_recent: usize) -> PyResult<()> {
        self.seq
            .with(py, |s| s.seal_idle(keep_recent))?
            .map_err(cuda_err)
    }

    fn fork(&self, py: Python<'_>) -> PyResult<DeviceCache> {
        let seq = self.seq.with(py, |s| s.fork())?.map_err(cuda_err)?;
        Ok(DeviceCache::wrap(seq, self.ordinal))
    }

    fn length(&self, py: Python<'_>, layer: usize) -> PyResult<usize> {
        self.seq.with(py, |s| s.len(layer))?.map_err(cuda_err)
    }

    fn regions(&self, py: Python<'_>, layer: usize) -> PyResult<Vec<(usize, usize)>> {
        let regions = self.seq.with(py, |s| s.regions(layer))?.map_err(cuda_err)?;
        Ok(regions.iter().map(|r| (r.start, r.end)).collect())
    }

    fn chunk_limit(&self, py: Python<'_>, layer: usize) -> PyResult<usize> {
        self.seq
            .with(py, |s| s.chunk_limit(layer))?
            .map_err(cuda_err)
    }

    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (m, stats) = self.seq.with(py, |s| (s.memory(), s.pool().stats()))?;
        memory_dict(py, &m, &stats)
    }

    /// A CPU cache holding the same bytes (snapshots, comparison with the reference).
    fn to_cpu(&self, py: Python<'_>) -> PyResult<Cache> {
        let cfg = &self.config;
        let pool = RecordPool::new(cfg.slot_bytes(), cfg.slots_per_sequence());
        let host = self.seq.with(py, |s| s.to_host(pool))?.map_err(cuda_err)?;
        Ok(Cache::wrap(host))
    }

    /// The snapshot bytes (the same format and bytes as the CPU cache's).
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let host = self.to_cpu(py)?;
        let bytes = host
            .seq
            .with(py, |s| s.snapshot_bytes())?
            .map_err(crate::cache::err)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// A device cache on `ordinal` holding a CPU cache's bytes.
    #[staticmethod]
    #[pyo3(signature = (cache, ordinal=0, pool_sequences=1))]
    fn from_cpu(
        py: Python<'_>,
        cache: &Cache,
        ordinal: usize,
        pool_sequences: usize,
    ) -> PyResult<DeviceCache> {
        let pool =
            DevicePool::for_config(ordinal, &cache.config, pool_sequences).map_err(cuda_err)?;
        let seq = cache
            .seq
            .with(py, |h| DeviceSequence::from_host(h, pool))?
            .map_err(cuda_err)?;
        Ok(DeviceCache::wrap(seq, ordinal))
    }

    #[getter]
    fn geometry(&self) -> (usize, usize, usize, usize) {
        let c = &self.config;
        (c.layers, c.q_heads, c.kv_heads, c.head_dim)
    }

    #[getter]
    fn ordinal(&self) -> usize {
        self.ordinal
    }
}
