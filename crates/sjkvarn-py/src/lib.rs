//! `sjkvarn._core`: thin PyO3 bindings over the `sjkvarn` crate, one file per core module
//! (`codec`, `journal`, `cache` for the CPU and CUDA sequences, `cuda`, `paged`), every error
//! conversion in `errors`. Arrays cross by DLPack; heavy work runs with the GIL released. This
//! file only registers the modules.

mod cache;
mod codec;
mod cuda;
mod dlpack;
mod errors;
mod journal;
mod paged;
mod shared;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    codec::register(m)?;
    journal::register(m)?;
    cache::register(m)?;
    cuda::register(m)?;
    paged::register(m)?;
    Ok(())
}
