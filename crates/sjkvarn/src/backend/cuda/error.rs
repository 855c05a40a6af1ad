//! The CUDA backend's errors.

use crate::error::CacheError;

/// Everything that can go wrong on the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No driver, no GPU or no NVRTC: the backend cannot run on this machine.
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    #[error("CUDA driver error: {0}")]
    Driver(String),
    #[error("NVRTC could not compile the sjkvarn kernels for {arch}:\n{log}")]
    Compile { arch: String, log: String },
    /// A configuration or input the device path does not implement.
    #[error("not supported on the CUDA backend: {0}")]
    Unsupported(String),
    /// A kernel refused its input (non-finite values, an fp16 overflow); nothing changed.
    #[error("{0}")]
    Rejected(String),
    #[error(transparent)]
    Cache(#[from] CacheError),
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

pub type CudaResult<T> = std::result::Result<T, CudaError>;
