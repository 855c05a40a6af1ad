"""sjkvarn: journaled, low-bit KV-cache compression (SJ-KVaRN).

The codec lives in the Rust core; this package is a thin typed layer over ``sjkvarn._core``.
"""

from sjkvarn import codec
from sjkvarn._core import GROUP, CodecError
from sjkvarn.cache import (
    Cache,
    CacheError,
    Config,
    CudaBackendError,
    CudaStatus,
    CudaUnavailableError,
    PoolExhaustedError,
    SnapshotError,
    cuda_available,
)

__all__ = [
    "GROUP",
    "Cache",
    "CacheError",
    "CodecError",
    "Config",
    "CudaBackendError",
    "CudaStatus",
    "CudaUnavailableError",
    "PoolExhaustedError",
    "SnapshotError",
    "codec",
    "cuda_available",
]
