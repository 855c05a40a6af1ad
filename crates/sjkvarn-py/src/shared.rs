//! Thread safety for Python callers: each cache is a `Shared` value whose calls take its lock
//! with the GIL released. One cache serialises its callers (no "Already borrowed" errors from
//! a thread pool); separate caches, even on one record pool, run in parallel.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::sync::Mutex;

pub(crate) struct Shared<T>(Mutex<T>);

impl<T: Send> Shared<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(Mutex::new(value))
    }

    /// Runs `f` on the value under its lock, with the GIL released while it waits and works.
    /// `f` must not touch Python objects (it cannot: it gets no GIL token).
    pub(crate) fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut T) -> R + Send,
    ) -> PyResult<R> {
        py.detach(|| match self.0.lock() {
            Ok(mut guard) => Ok(f(&mut guard)),
            Err(_) => Err(()),
        })
        .map_err(|()| {
            PyRuntimeError::new_err(
                "this cache is unusable: an earlier call panicked while holding it; \
                 restore it from a snapshot or build a new one",
            )
        })
    }
}
