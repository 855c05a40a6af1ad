//! `sjkvarn._core.DeviceCache`: one sequence with its journal in CUDA memory, torch CUDA
//! tensors by DLPack, work ordered against the caller's stream with events.

use crate::cache::{check_3d, err, memory_dict, Cache, CacheError, CacheSpec};
use crate::dlpack::cuda_f32;
use pyo3::create_exception;
use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use sjkvarn::cache::{CacheError as CoreError, RecordPool};
use sjkvarn::cuda::{availability, CudaError, DevicePool, DeviceSequence, ExternalStream};
use std::sync::Arc;

create_exception!(
    _core,
    CudaUnavailableError,
    PyRuntimeError,
    "The CUDA backend cannot run here (no driver, no GPU or no NVRTC); the message says which."
);
create_exception!(
    _core,
    CudaBackendError,
    PyRuntimeError,
    "The CUDA driver or kernel compiler failed."
);

fn cuda_err(e: CudaError) -> PyErr {
    match e {
        CudaError::Cache(c) => err(c),
        CudaError::Unavailable(_) => CudaUnavailableError::new_err(e.to_string()),
        CudaError::Unsupported(_) => PyValueError::new_err(e.to_string()),
        CudaError::Rejected(_) => CacheError::new_err(e.to_string()),
        CudaError::Driver(_) | CudaError::Compile { .. } => {
            CudaBackendError::new_err(e.to_string())
        }
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
            PyValueError::new_err(format!(
                "unknown architecture {arch}; known: {:?}",
                sjkvarn::cuda::KERNEL_ARCHES
            ))
        })?;
    sjkvarn::cuda::compile_ptx(known).map_err(cuda_err)
}

/// One sequence on a CUDA device.
#[pyclass(module = "sjkvarn._core", unsendable)]
pub struct DeviceCache {
    seq: DeviceSequence,
    ordinal: usize,
}

fn external(raw: Option<u64>) -> Option<ExternalStream> {
    raw.map(ExternalStream)
}

impl DeviceCache {
    fn check_layer(&self, layer: usize) -> PyResult<()> {
        let layers = self.seq.config().layers;
        if layer >= layers {
            return Err(PyIndexError::new_err(
                CoreError::LayerOutOfRange { layer, layers }.to_string(),
            ));
        }
        Ok(())
    }

    fn check_device(&self, id: i32, what: &str) -> PyResult<()> {
        if id as usize != self.ordinal {
            return Err(PyValueError::new_err(format!(
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
        Ok(Self { seq, ordinal })
    }

    /// Appends float32 contiguous CUDA K and V `[tokens, kv_heads, head_dim]`; `stream` is the
    /// caller's raw CUDA stream (inputs are read after the work queued on it).
    #[pyo3(signature = (layer, k, v, stream=None))]
    fn append(
        &mut self,
        py: Python<'_>,
        layer: usize,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        self.check_layer(layer)?;
        let (h, d) = (self.seq.config().kv_heads, self.seq.config().head_dim);
        let (kt, vt) = (cuda_f32(k, "k")?, cuda_f32(v, "v")?);
        self.check_device(kt.device_id(), "k")?;
        self.check_device(vt.device_id(), "v")?;
        let n = check_3d(kt.shape(), "k", h, d)?;
        check_3d(vt.shape(), "v", h, d)?;
        if kt.shape() != vt.shape() {
            return Err(CacheError::new_err(format!(
                "k and v shapes differ: {:?} vs {:?}",
                kt.shape(),
                vt.shape()
            )));
        }
        let (kp, vp) = (kt.ptr(), vt.ptr());
        let seq = &mut self.seq;
        // SAFETY: kp/vp address n compact float32 rows on this device (checked above); the
        // capsules keep them alive for this call, which reads them before it returns (the
        // append waits for its staging kernel's status).
        py.detach(|| unsafe { seq.append_raw(layer, kp, vp, n, external(stream)) })
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
        let cfg = self.seq.config();
        let (qt, ot) = (cuda_f32(q, "q")?, cuda_f32(out, "out")?);
        self.check_device(qt.device_id(), "q")?;
        self.check_device(ot.device_id(), "out")?;
        let n = check_3d(qt.shape(), "q", cfg.q_heads, cfg.head_dim)?;
        if ot.shape() != qt.shape() {
            return Err(CacheError::new_err(format!(
                "out has shape {:?}, expected {:?}",
                ot.shape(),
                qt.shape()
            )));
        }
        let (qp, op) = (qt.ptr(), ot.ptr());
        let seq = &self.seq;
        // SAFETY: both address n x q_heads x head_dim float32 on this device; the caller's
        // stream waits for the queued kernels before it may reuse or read them.
        py.detach(|| unsafe { seq.attend_raw(layer, qp, n, op, scale, external(stream)) })
            .map_err(cuda_err)
    }

    fn truncate(&mut self, n: usize) -> PyResult<usize> {
        self.seq.truncate(n).map_err(cuda_err)
    }

    #[pyo3(signature = (keep_recent=0))]
    fn seal_idle(&mut self, py: Python<'_>, keep_recent: usize) -> PyResult<()> {
        let seq = &mut self.seq;
        py.detach(|| seq.seal_idle(keep_recent)).map_err(cuda_err)
    }

    fn fork(&self) -> PyResult<DeviceCache> {
        Ok(DeviceCache {
            seq: self.seq.fork().map_err(cuda_err)?,
            ordinal: self.ordinal,
        })
    }

    fn length(&self, layer: usize) -> PyResult<usize> {
        self.seq.len(layer).map_err(cuda_err)
    }

    fn regions(&self, layer: usize) -> PyResult<Vec<(usize, usize)>> {
        Ok(self
            .seq
            .regions(layer)
            .map_err(cuda_err)?
            .iter()
            .map(|r| (r.start, r.end))
            .collect())
    }

    fn chunk_limit(&self, layer: usize) -> PyResult<usize> {
        self.seq.chunk_limit(layer).map_err(cuda_err)
    }

    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        memory_dict(py, &self.seq.memory(), &self.seq.pool().stats())
    }

    /// A CPU cache holding the same bytes (snapshots, comparison with the reference).
    fn to_cpu(&self) -> PyResult<Cache> {
        let cfg = self.seq.config();
        let pool = RecordPool::new(cfg.slot_bytes(), cfg.slots_per_sequence());
        Ok(Cache {
            seq: self.seq.to_host(pool).map_err(cuda_err)?,
        })
    }

    /// The snapshot bytes (the same format and bytes as the CPU cache's).
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let host = self.to_cpu()?;
        Ok(PyBytes::new(
            py,
            &host.seq.snapshot_bytes().map_err(crate::cache::err)?,
        ))
    }

    /// A device cache on `ordinal` holding a CPU cache's bytes.
    #[staticmethod]
    #[pyo3(signature = (cache, ordinal=0, pool_sequences=1))]
    fn from_cpu(cache: &Cache, ordinal: usize, pool_sequences: usize) -> PyResult<DeviceCache> {
        let pool = DevicePool::for_config(ordinal, cache.seq.config(), pool_sequences)
            .map_err(cuda_err)?;
        Ok(DeviceCache {
            seq: DeviceSequence::from_host(&cache.seq, pool).map_err(cuda_err)?,
            ordinal,
        })
    }

    #[getter]
    fn geometry(&self) -> (usize, usize, usize, usize) {
        let c = self.seq.config();
        (c.layers, c.q_heads, c.kv_heads, c.head_dim)
    }

    #[getter]
    fn ordinal(&self) -> usize {
        self.ordinal
    }
}
