"""sjkvarn: journaled, low-bit KV-cache compression (SJ-KVaRN).

The codec lives in the Rust core; this package is a thin typed layer over ``sjkvarn._core`` and
needs numpy only (torch only where torch tensors are passed in). ``sjkvarn.hf`` (the
``transformers`` integration) needs the ``hf`` extra; the evaluation harness ``sjkvarn.eval``
the ``eval`` extra.
"""

from sjkvarn import codec
from sjkvarn._core import GROUP
from sjkvarn.cache import Cache, Config, CudaStatus, backends, cuda_available
from sjkvarn.errors import (
    CacheError,
    CodecError,
    CorruptDataError,
    CudaBackendError,
    CudaUnavailableError,
    InvalidInputError,
    LayerIndexError,
    MissingFileError,
    OutOfMemoryError,
    PoolExhaustedError,
    SjkvarnError,
    SnapshotError,
    StorageError,
    UnsupportedTypeError,
)

__all__ = [
    "GROUP",
    "Cache",
    "CacheError",
    "CodecError",
    "Config",
    "CorruptDataError",
    "CudaBackendError",
    "CudaStatus",
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
    "backends",
    "codec",
    "cuda_available",
]
