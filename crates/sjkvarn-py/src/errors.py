"""sjkvarn's exceptions: one class per kind of failure, the same on every entry point and backend.

Every class derives from ``SjkvarnError``; each also derives from the built-in exception a
Python caller would expect for that kind (``ValueError`` for bad values, ``TypeError`` for
unsupported types, ``IndexError`` for a layer that does not exist, ``OSError`` for files,
``RuntimeError`` for a backend that cannot run). A call that raises leaves caches and output buffers as they were.
"""


class SjkvarnError(Exception):
    """Base class of every sjkvarn exception."""


class InvalidInputError(SjkvarnError, ValueError):
    """Bad input or settings: shapes, NaN/Inf, unknown names, out-of-range sizes or positions,
    a tensor on the wrong device, a configuration a backend does not implement."""


class UnsupportedTypeError(InvalidInputError, TypeError):
    """An argument of an unsupported type or dtype (not a numpy array / torch tensor, or not a
    float dtype)."""


class LayerIndexError(InvalidInputError, IndexError):
    """A layer index outside ``0 .. layers - 1``."""


class CorruptDataError(SjkvarnError, ValueError):
    """Stored bytes were refused: a snapshot, ``SJKVSEQ`` state stream or record blob that is
    truncated, damaged or written for another configuration."""


class PoolExhaustedError(SjkvarnError, RuntimeError):
    """The shared record pool has no free slot for a seal; free sequences or size the pool
    with more ``pool_sequences``."""


class OutOfMemoryError(SjkvarnError, MemoryError):
    """A valid configuration this machine (or device) cannot allocate; nothing was allocated."""


class StorageError(SjkvarnError, OSError):
    """Reading or writing a snapshot file failed (``errno``, ``strerror`` and ``filename`` are
    set as on ``OSError``); the file at the path is as it was."""


class MissingFileError(StorageError, FileNotFoundError):
    """A snapshot path that does not exist."""


class CudaUnavailableError(SjkvarnError, RuntimeError):
    """``device="cuda"`` cannot run here (no driver, GPU or NVRTC); the message says which."""


class CudaBackendError(SjkvarnError, RuntimeError):
    """The CUDA driver or the kernel compiler failed."""


for _cls in list(globals().values()):
    if isinstance(_cls, type) and issubclass(_cls, SjkvarnError):
        _cls.__module__ = "sjkvarn"
