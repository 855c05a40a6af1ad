//! The exception classes, defined once (in `errors.py`, compiled into `_core` at import) and
//! raised by kind, so every entry point and backend raises the same class for the same fault.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyModule, PyType};
use sjkvarn::error::CacheError as CoreError;

const SOURCE: &str = include_str!("errors.py");

/// The kinds of failure, one Python class each (see `errors.py` for what each covers).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Kind {
    InvalidInput,
    UnsupportedType,
    LayerIndex,
    CorruptData,
    PoolExhausted,
    OutOfMemory,
    Storage,
    MissingFile,
    CudaUnavailable,
    CudaBackend,
}

impl Kind {
    pub(crate) const ALL: [Kind; 10] = [
        Kind::InvalidInput,
        Kind::UnsupportedType,
        Kind::LayerIndex,
        Kind::CorruptData,
        Kind::PoolExhausted,
        Kind::OutOfMemory,
        Kind::Storage,
        Kind::MissingFile,
        Kind::CudaUnavailable,
        Kind::CudaBackend,
    ];

    pub(crate) fn class_name(self) -> &'static str {
        match self {
            Kind::InvalidInput => "InvalidInputError",
            Kind::UnsupportedType => "UnsupportedTypeError",
            Kind::LayerIndex => "LayerIndexError",
            Kind::CorruptData => "CorruptDataError",
            Kind::PoolExhausted => "PoolExhaustedError",
            Kind::OutOfMemory => "OutOfMemoryError",
            Kind::Storage => "StorageError",
            Kind::MissingFile => "MissingFileError",
            Kind::CudaUnavailable => "CudaUnavailableError",
            Kind::CudaBackend => "CudaBackendError",
        }
    }
}

static MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    MODULE
        .get_or_try_init(py, || {
            PyModule::from_code(
                py,
                &std::ffi::CString::new(SOURCE).expect("errors.py has no NUL byte"),
                c"sjkvarn/errors.py",
                c"sjkvarn._errors",
            )
            .map(Bound::unbind)
        })
        .map(|m| m.bind(py))
}

/// The class of `kind`.
pub(crate) fn class(py: Python<'_>, kind: Kind) -> PyResult<Bound<'_, PyType>> {
    Ok(module(py)?
        .getattr(kind.class_name())?
        .cast_into::<PyType>()?)
}

/// An exception of `kind` with `message`.
pub(crate) fn raise(kind: Kind, message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| match class(py, kind) {
        Ok(cls) => PyErr::from_type(cls, message),
        Err(e) => e,
    })
}

/// Adds the base class and every kind's class to `m`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("SjkvarnError", module(py)?.getattr("SjkvarnError")?)?;
    for kind in Kind::ALL {
        m.add(kind.class_name(), class(py, kind)?)?;
    }
    Ok(())
}

/// The exception for a codec error: all of them are bad input.
pub(crate) fn codec(e: sjkvarn::CodecError) -> PyErr {
    raise(Kind::InvalidInput, e.to_string())
}

/// The exception for a cache error, by kind.
pub(crate) fn cache(e: CoreError) -> PyErr {
    let kind = match e {
        CoreError::LayerOutOfRange { .. } => Kind::LayerIndex,
        CoreError::PoolExhausted { .. } => Kind::PoolExhausted,
        CoreError::Snapshot(_) | CoreError::State(_) => Kind::CorruptData,
        CoreError::OutOfMemory { .. } => Kind::OutOfMemory,
        CoreError::Io {
            path,
            kind,
            errno,
            detail,
        } => return file_error(&path, kind, errno, &detail),
        CoreError::InvalidConfig(_)
        | CoreError::Shape { .. }
        | CoreError::TooLong { .. }
        | CoreError::Position { .. }
        | CoreError::ScoreOverflow { .. }
        | CoreError::Codec(_) => Kind::InvalidInput,
    };
    raise(kind, e.to_string())
}

/// A `StorageError` (an `OSError` with `errno`, `strerror`, `filename` set), or its
/// `MissingFileError` subclass (also a `FileNotFoundError`) for a path that does not exist.
fn file_error(path: &str, kind: std::io::ErrorKind, errno: Option<i32>, detail: &str) -> PyErr {
    let which = if kind == std::io::ErrorKind::NotFound {
        Kind::MissingFile
    } else {
        Kind::Storage
    };
    let errno = errno.unwrap_or(0);
    let (path, detail) = (path.to_owned(), detail.to_owned());
    Python::attach(|py| match class(py, which) {
        Ok(cls) => PyErr::from_type(cls, (errno, detail, path)),
        Err(e) => e,
    })
}

/// The library's file error for `e` on `path`.
pub(crate) fn io(path: &std::path::Path, e: std::io::Error) -> PyErr {
    file_error(
        &path.display().to_string(),
        e.kind(),
        e.raw_os_error(),
        &e.to_string(),
    )
}

/// Bad input, with a message.
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    raise(Kind::InvalidInput, message)
}

/// An unsupported type or dtype, with a message.
pub(crate) fn unsupported_type(message: impl Into<String>) -> PyErr {
    raise(Kind::UnsupportedType, message)
}

/// The CUDA backend's errors: its cache errors as on the CPU, the rest by kind.
pub(crate) fn cuda_err(e: sjkvarn::backend::cuda::CudaError) -> PyErr {
    match e {
        sjkvarn::backend::cuda::CudaError::Cache(c) => cache(c),
        sjkvarn::backend::cuda::CudaError::Unavailable(_) => {
            raise(Kind::CudaUnavailable, e.to_string())
        }
        sjkvarn::backend::cuda::CudaError::Unsupported(_)
        | sjkvarn::backend::cuda::CudaError::Rejected(_) => invalid(e.to_string()),
        sjkvarn::backend::cuda::CudaError::Driver(_)
        | sjkvarn::backend::cuda::CudaError::Compile { .. } => {
            raise(Kind::CudaBackend, e.to_string())
        }
    }
}

/// The paged journal's errors: bad input by kind, cache and codec errors as everywhere.
pub(crate) fn paged_err(e: sjkvarn::backend::paged::PagedError) -> PyErr {
    match e {
        sjkvarn::backend::paged::PagedError::Invalid(m) => invalid(m),
        sjkvarn::backend::paged::PagedError::Cache(e) => cache(e),
        sjkvarn::backend::paged::PagedError::Codec(e) => codec(e),
    }
}
