"""Encode and decode KV tensors in every sjkvarn format.

Inputs are numpy arrays or CPU torch tensors (float32, float16, bfloat16 or float64); they cross
into Rust by DLPack, never through Python lists. Outputs are numpy float32 arrays (or a
caller-provided float32 tensor via ``out=``). Bad input raises :class:`sjkvarn.InvalidInputError`
(a ``ValueError``; ``CodecError`` is its former name) or :class:`sjkvarn.UnsupportedTypeError`
(also a ``TypeError``) for wrong types and dtypes; see ``docs/errors.md``.

Flat block formats (``FORMATS``): ``f16``, llama.cpp ``q8_0 q4_0 q4_1 q5_0 q5_1`` (bit-exact with
``gguf.quants.quantize``), and the rotated norm-coded ``turbo3 turbo4 tq5_0 tq6_0`` (``tq6_0`` is
the SJ-KVaRN reference staging block). Blocks run along the last dimension; ``rotated=True``
means values already in the Hadamard frame (as the cache holds them). The body record
(``encode_body``) codes K and V tiles of one KV head and one 128-token group in the SJ-KVaRN
reference format (scalar 2..4 bits, trellis 3/3, 3/2, 2/2) or an sjkvarn extension.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sjkvarn import _core
from sjkvarn.errors import InvalidInputError, UnsupportedTypeError

GROUP: int = _core.GROUP


@dataclass(frozen=True)
class FormatInfo:
    """Geometry of a flat block format."""

    name: str
    block_values: int
    block_bytes: int
    rotated: bool

    @property
    def bits_per_value(self) -> float:
        return self.block_bytes * 8 / self.block_values


FORMATS: dict[str, FormatInfo] = {
    name: FormatInfo(name, values, nbytes, rotated)
    for name, values, nbytes, rotated in _core.formats()
}


def format_info(fmt: str) -> FormatInfo:
    """Block geometry of ``fmt``; raises InvalidInputError for an unknown name."""
    try:
        return FORMATS[fmt.lower()]
    except KeyError:
        raise InvalidInputError(
            f"unknown format {fmt!r}; known formats: {', '.join(FORMATS)}"
        ) from None


def _exportable(array: Any) -> Any:
    """Something whose ``__dlpack__`` works: detaches autograd tensors, copies read-only arrays."""
    if hasattr(array, "detach") and getattr(array, "requires_grad", False):
        array = array.detach()
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        array = array.copy()
    return array


def _blob(blob: bytes | bytearray | memoryview) -> bytes:
    if isinstance(blob, bytes):
        return blob
    if isinstance(blob, (bytearray, memoryview)):
        return bytes(blob)
    raise UnsupportedTypeError(
        f"blob must be bytes, bytearray or memoryview, got {type(blob).__name__}"
    )


def encode(fmt: str, array: Any, *, rotated: bool = False, threads: int | None = None) -> bytes:
    """Encodes ``array`` (last dimension a multiple of the format's block size) to bytes.

    ``rotated=True``: the values are already in the Hadamard frame (rotated formats code them
    as they are; the others ignore the flag).
    """
    return _core.encode(fmt, _exportable(array), threads, bool(rotated))


def decode(
    fmt: str,
    blob: bytes | bytearray | memoryview,
    shape: Sequence[int],
    *,
    rotated: bool = False,
    out: Any = None,
    threads: int | None = None,
) -> Any:
    """Decodes ``blob`` into a float32 array of ``shape`` (or into ``out``, which it returns);
    ``rotated=True`` leaves rotated formats' values in the Hadamard frame."""
    if out is None:
        out = np.empty(tuple(int(s) for s in shape), dtype=np.float32)
    elif tuple(out.shape) != tuple(shape):
        raise InvalidInputError(f"out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    _core.decode_into(fmt, _blob(blob), out, threads, bool(rotated))
    return out


@dataclass(frozen=True)
class BodyLayout:
    """Size of one scalar body record (K and V of one KV head, one 128-token group)."""

    record_bytes: int
    metadata_bytes: int
    bits_per_value: float


def body_layout(head_dim: int, k_bits: int, v_bits: int) -> BodyLayout:
    """Record size; raises InvalidInputError for unsupported head sizes or bit widths."""
    return BodyLayout(*_core.body_layout(head_dim, k_bits, v_bits))


def encode_body(
    k: Any,
    v: Any,
    *,
    k_bits: int = 4,
    v_bits: int = 4,
    passes: int = 16,
    mode: str = "final",
    stat: str = "std",
    rotated: bool = False,
    threads: int | None = None,
    k_body: str = "scalar",
    v_body: str = "scalar",
) -> bytes:
    """Seals K and V tiles ``[..., 128, head_dim]`` into one body record per tile.

    The seal input is the tile in the Hadamard frame rounded to fp16: ``rotated=True`` means
    the tiles are already rotated (as the cache stores them); otherwise each head row is rotated
    first. With ``k_body == v_body`` in ``"scalar"`` (2..4 bits) or ``"trellis"`` (3/3, 3/2,
    2/2), ``mode="final"`` and ``stat="std"``, the records are SJ-KVaRN reference records
    (``passes`` balancing iterations, 16 in the format); 5/6/8-bit scalar sides and
    ``mode="best"``/``stat="rms"`` give the sjkvarn v1 extension record instead. Decode with
    the same settings.
    """
    return _core.encode_body(
        _exportable(k),
        _exportable(v),
        k_bits,
        v_bits,
        passes,
        mode,
        stat,
        rotated,
        threads,
        k_body,
        v_body,
    )


def decode_body(
    blob: bytes | bytearray | memoryview,
    *,
    head_dim: int,
    k_bits: int = 4,
    v_bits: int = 4,
    rotated: bool = False,
    threads: int | None = None,
    k_body: str = "scalar",
    v_body: str = "scalar",
    passes: int = 16,
    mode: str = "final",
    stat: str = "std",
) -> tuple[np.ndarray, np.ndarray]:
    """Decodes records into float32 ``(k, v)``, each ``[records, 128, head_dim]`` (in the
    Hadamard frame when ``rotated``); the settings must be those the records were sealed with."""
    data = _blob(blob)
    record = body_layout(head_dim, k_bits, v_bits).record_bytes
    if len(data) == 0 or len(data) % record:
        raise InvalidInputError(
            f"blob of {len(data)} bytes is not a whole number of {record}-byte records"
        )
    shape = (len(data) // record, GROUP, head_dim)
    k = np.empty(shape, dtype=np.float32)
    v = np.empty(shape, dtype=np.float32)
    _core.decode_body_into(
        data, k, v, k_bits, v_bits, rotated, threads, k_body, v_body, passes, mode, stat
    )
    return k, v


def trellis_codebook(bits: int, *, values: bool = False) -> np.ndarray:
    """The reference's trained ``2^(6+bits)``-entry trellis codebook (``bits`` 2 or 3) for keys,
    or for values with ``values=True``, in units of the row step; entry ``w`` is the value of a
    code whose window (the code over the six stream bits before it) is ``w``."""
    return np.frombuffer(_core.trellis_codebook(bits, values), dtype="<f4").copy()


def rotate(array: Any) -> np.ndarray:
    """Orthonormal Walsh-Hadamard rotation of each head vector (last dim 64/128/256/512).

    The rotation is its own inverse: ``rotate(rotate(x)) == x`` up to rounding.
    """
    data, shape = _core.to_float32(_exportable(array))
    host = np.frombuffer(bytearray(data), dtype=np.float32).reshape(shape)
    _core.rotate_inplace(host)
    return host
