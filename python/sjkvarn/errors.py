"""sjkvarn's exceptions: one class per kind of failure, raised alike by every entry point
(``codec``, ``Cache``, ``hf``) and every backend (CPU, CUDA). The table in
``docs/errors.md`` lists which input raises which; ``tests/test_errors.py`` checks it.

Every class derives from :class:`SjkvarnError` and from the built-in exception Python callers
expect for that kind, so ``except ValueError`` keeps working. A call that raises leaves caches
and output buffers as they were.

``CodecError`` and ``CacheError`` are the former names of :class:`InvalidInputError`, and
``SnapshotError`` of :class:`CorruptDataError`; they are the same classes, kept for existing code.
"""

from __future__ import annotations

from sjkvarn import _core

SjkvarnError: type[Exception] = _core.SjkvarnError
InvalidInputError: type[ValueError] = _core.InvalidInputError
UnsupportedTypeError: type[TypeError] = _core.UnsupportedTypeError
LayerIndexError: type[IndexError] = _core.LayerIndexError
CorruptDataError: type[ValueError] = _core.CorruptDataError
PoolExhaustedError: type[RuntimeError] = _core.PoolExhaustedError
OutOfMemoryError: type[MemoryError] = _core.OutOfMemoryError
StorageError: type[OSError] = _core.StorageError
MissingFileError: type[FileNotFoundError] = _core.MissingFileError
CudaUnavailableError: type[RuntimeError] = _core.CudaUnavailableError
CudaBackendError: type[RuntimeError] = _core.CudaBackendError

CodecError = InvalidInputError
CacheError = InvalidInputError
SnapshotError = CorruptDataError

__all__ = [
    "CacheError",
    "CodecError",
    "CorruptDataError",
    "CudaBackendError",
    "CudaUnavailableError",
    "InvalidInputError",
    "LayerIndexError",
    "MissingFileError",
    "OutOfMemoryError",
    "PoolExhaustedError",
    "SjkvarnError",
    "SnapshotError",
    "StorageError",
    "UnsupportedTypeError",
]
