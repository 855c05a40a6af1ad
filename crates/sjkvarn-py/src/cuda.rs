//! The CUDA backend's errors and availability; device caches are `sjkvarn._core.Cache` built
//! with an ordinal (see `cache`).

use crate::errors::{cuda_err, invalid};
use pyo3::prelude::*;
use sjkvarn::backend::cuda::availability;

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
    let known = sjkvarn::backend::cuda::KERNEL_ARCHES
        .iter()
        .find(|a| **a == arch)
        .ok_or_else(|| {
            invalid(format!(
                "unknown architecture {arch}; known: {:?}",
                sjkvarn::backend::cuda::KERNEL_ARCHES
            ))
        })?;
    sjkvarn::backend::cuda::compile_ptx(known).map_err(cuda_err)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(compile_kernels, m)?)?;
    Ok(())
}
