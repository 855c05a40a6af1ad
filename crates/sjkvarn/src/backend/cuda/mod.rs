//! CUDA backend (feature `cuda`): the journal of [`crate::backend::Sequence`] with its bytes in
//! device memory, driven by the kernels in the crate's `cuda/` folder (compiled with NVRTC at
//! first use).
//!
//! `libcuda` and `libnvrtc` are loaded at run time, so the crate builds and every CPU path runs
//! on machines with no CUDA at all; [`availability`] says why the backend cannot run there.
//! The reference is `crate::codec`: the kernels stage rows and seal SJ-KVaRN records
//! byte-identical to it (checked on the host by `crates/sjkvarn-cuda-host`); only the reference
//! bodies are supported on the device.

mod error;
mod journal;
mod kernels;
mod pool;
mod sequence;

pub use error::{CudaError, CudaResult};
pub use kernels::{compile_ptx, kernel_cache_dir, KERNEL_ARCHES};
pub use pool::{DevicePool, ExternalStream};
pub use sequence::DeviceSequence;

/// What the backend found on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    pub devices: usize,
}

/// Whether the backend can run on device `ordinal`: Ok with what it found, or the reason.
/// Never panics, whatever is (not) installed.
pub fn availability(ordinal: usize) -> CudaResult<DeviceInfo> {
    // SAFETY: probing for the shared library only loads it; no CUDA call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "the CUDA driver library (libcuda.so) was not found; no NVIDIA driver is installed"
                .into(),
        ));
    }
    // SAFETY: as above, for libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "NVRTC (libnvrtc.so.13) was not found: install the `nvidia-cuda-nvrtc` wheel or put \
             a CUDA 13 toolkit's lib folder on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    cudarc::driver::result::init()
        .map_err(|e| CudaError::Unavailable(format!("the CUDA driver did not start: {e}")))?;
    let devices = cudarc::driver::CudaContext::device_count()
        .map_err(|e| CudaError::Unavailable(format!("no CUDA device: {e}")))?
        as usize;
    if ordinal >= devices {
        return Err(CudaError::Unavailable(format!(
            "CUDA device {ordinal} requested, {devices} present"
        )));
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal)?;
    Ok(DeviceInfo {
        ordinal,
        name: ctx.name()?,
        compute_capability: ctx.compute_capability()?,
        total_memory: ctx.total_mem()?,
        devices,
    })
}
