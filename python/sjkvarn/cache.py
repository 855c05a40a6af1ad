"""The journaled KV cache for one sequence, on CPU tensors (numpy or torch) or, with
``device="cuda"``, on torch CUDA tensors; tensors cross by DLPack.

```python
cache = sjkvarn.Cache(sjkvarn.Config(layers=30, kv_heads=3, q_heads=9, head_dim=64))
cache.append(layer, k, v)       # [tokens, kv_heads, head_dim], post-RoPE
out = cache.attend(layer, q)    # [tokens, q_heads, head_dim]; causal over what was appended
```

CUDA caches keep the journal in device memory. Work is queued on sjkvarn's own stream, ordered
after the work already on torch's current stream (an event) and before anything torch queues
there afterwards (another event), so callers use the results as if they were computed on
torch's current stream. ``append`` returns once its inputs have been read.

Errors (``docs/errors.md``, the same on both backends): :class:`InvalidInputError` (a
``ValueError``) for bad shapes, values, settings, positions and devices,
:class:`UnsupportedTypeError` (also a ``TypeError``) for unsupported types and dtypes,
:class:`LayerIndexError` (also an ``IndexError``) for a layer that does not exist,
:class:`CorruptDataError` for a refused snapshot or state stream, :class:`PoolExhaustedError`
when a seal finds no free record slot, ``OSError`` for file errors, :class:`CudaUnavailableError`
when ``device="cuda"`` cannot run here. A call that raises leaves the cache as it was. A cache
may be shared by threads: its calls are serialised and run with the GIL released.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sjkvarn import _arguments as args
from sjkvarn import _core
from sjkvarn.errors import (
    CacheError,
    CorruptDataError,
    CudaBackendError,
    CudaUnavailableError,
    InvalidInputError,
    LayerIndexError,
    PoolExhaustedError,
    SnapshotError,
    UnsupportedTypeError,
)

__all__ = [
    "Cache",
    "CacheError",
    "Config",
    "CorruptDataError",
    "CudaBackendError",
    "CudaStatus",
    "CudaUnavailableError",
    "PoolExhaustedError",
    "SnapshotError",
    "cuda_available",
]


@dataclass(frozen=True)
class CudaStatus:
    """Whether ``device="cuda"`` can run here; ``reason`` names the device or what is missing."""

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available


def load_nvrtc() -> str | None:
    """Loads NVRTC from a pip-installed ``nvidia-cuda-nvrtc`` wheel if one is on ``sys.path``,
    so the CUDA backend finds it without ``LD_LIBRARY_PATH``; returns the folder it used."""
    import ctypes
    import glob
    import sys

    for base in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"):
            folder = os.path.join(base or ".", sub)
            main = os.path.join(folder, "libnvrtc.so.13")
            if not os.path.exists(main):
                continue
            try:
                # The builtins library is found by soname only once it is loaded globally.
                for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so.13*"))):
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                ctypes.CDLL(main, mode=ctypes.RTLD_GLOBAL)
                return folder
            except OSError:
                continue
    return None


def cuda_available(device: int = 0) -> CudaStatus:
    """Probes the CUDA driver, device ``device`` and NVRTC without raising."""
    load_nvrtc()
    ok, reason = _core.cuda_status(int(device))
    return CudaStatus(bool(ok), str(reason))


def _parse_device(device: str) -> tuple[str, int]:
    """``"cpu"``, ``"cuda"`` (torch's current device, else 0) or ``"cuda:N"``."""
    text = str(device).strip().lower()
    if text == "cpu":
        return "cpu", 0
    if text == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                return "cuda", int(torch.cuda.current_device())
        except ImportError:
            pass
        return "cuda", 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return "cuda", int(text[5:])
    raise InvalidInputError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


# The journal presets live in the Rust core (``DEFAULT_JOURNAL``, ``REFERENCE_JOURNAL``).
_PRESETS: dict[str, dict[str, Any]] = _core.journal_presets()
#: ``min_tail``, ``max_tail``, ``staging``, ``centre_keys`` and ``exact_recent`` of
#: ``Config()`` and of ``Config.reference()``.
DEFAULT_JOURNAL: dict[str, Any] = dict(_PRESETS["default"])
REFERENCE_JOURNAL: dict[str, Any] = dict(_PRESETS["reference"])
_DEFAULT, _REFERENCE = DEFAULT_JOURNAL, REFERENCE_JOURNAL


@dataclass
class Config:
    """Geometry, per-layer coding, tail sizes and staging of a cache.

    ``body`` is ``"scalar"`` or ``"trellis"`` (the reference trellis: 3/3, 3/2 or 2/2);
    ``layer_bits`` overrides ``(k_bits, v_bits, body)`` per layer (tiered edge layers). The
    3/2 trellis suits models whose cached layers put attention on the sink (Gemma 3 270M:
    0.50x the KL of KVarN 4/4 tail 0 at 16K tokens); on a model that caches every layer with
    64-wide heads (SmolLM2-135M) it has 2.4x that KL, and 4/4 is the body to use
    (``docs/results/quality.md``).

    ``staging`` is how ring rows are stored: ``"tq6_0"``, ``"f16"`` (rotated fp16) or
    ``"q8_0"`` (extension) for keys and values, ``"K/V"`` for different types, or ``"auto"``:
    each layer measures every type on its own first rows and keeps the smallest within
    ``staging_budget`` (default 0.04; see :meth:`Cache.staging_report`). ``staging``,
    ``min_tail``, ``max_tail`` and ``centre_keys`` left ``None`` take the journal that
    :func:`backends`' table gives the device: the core's ``DEFAULT_JOURNAL`` (``"q8_0"``,
    2,048..3,072 unsealed tokens, centred keys: keys of small models lose more in a 6-bit ring
    than in the 4-bit body, ``docs/results/quality.md``) where the backend runs it (the CPU),
    the reference's elsewhere (CUDA's ring stores ``tq6_0`` rows only).
    :meth:`Config.reference` gives the SJ-KVaRN reference codec's journal (``tq6_0``,
    4,096..8,192, keys as appended), which writes its format byte for byte. A cache's
    ``config`` holds the resolved values.

    ``centre_keys``: every key after the sink is stored minus the sink's mean key (positions
    1..``sink``). Softmax does not see an offset shared by all keys, so attention is unchanged
    while the coded keys lose the large shared component that costs them precision (CPU only;
    states carry it as an extension rotation id).
    Staging types are not part of sealed records.

    ``exact_recent`` (extension, CPU only; ``None`` takes the device journal's, 0 = off): each
    query reads the ``exact_recent`` positions up to its own from fp16 copies of their rows
    instead of the ring's codes. The newest positions carry much of the attention mass; on
    models that cache every layer with 64-wide heads their 8-bit keys cost more there than
    anywhere else (``docs/results/quality.md``). A decoding cache holds ``exact_recent`` copies
    per layer (16 bits per value, counted in ``memory()``); states carry them after the stream.

    ``min_tail``/``max_tail``/``max_chunk``/``flush_chunk`` are the reference's
    ``tail``/``tail_max``/``n_ubatch``/``flush_chunk`` (``max_tail = 0``: fixed tail); ``sink``
    is the number of leading positions kept exact (a non-zero multiple of 64, 128 by default;
    CPU only otherwise) and ``sink_type`` ``"f16"`` or ``"inherit"`` (with f16 staging). A
    configuration with 2..4-bit scalar or reference-trellis bodies, one of tq6_0 or f16 staging
    for keys and values and ``head_dim`` a multiple of 128 writes the reference SJ-KVaRN format
    (``Cache.reference_format``). ``pool_sequences`` sizes the record pool
    that this cache and its forks share (in sequences of ``max_tokens``).
    """

    layers: int
    kv_heads: int
    head_dim: int
    q_heads: int | None = None
    k_bits: int = 4
    v_bits: int = 4
    body: str = "scalar"
    layer_bits: list[tuple[int, int, str]] | None = field(default=None)
    min_tail: int | None = None
    max_tail: int | None = None
    max_chunk: int = 512
    flush_chunk: int = 0
    max_tokens: int = 32768
    passes: int = 16
    mode: str = "final"
    stat: str = "std"
    staging: str | None = None
    staging_budget: float | None = None
    centre_keys: bool | None = None
    exact_recent: int | None = None
    sink: int = 128
    sink_type: str = "f16"
    device: str = "cpu"
    pool_sequences: int = 1

    def __post_init__(self) -> None:
        # Refuse a bad setting where it is written, not later at ``Cache(config)``; the
        # cache checks again, since a dataclass's fields can be reassigned.
        _spec_of(self)
        _parse_device(self.device)

    @classmethod
    def reference(cls, **fields: Any) -> Config:
        """A configuration with the SJ-KVaRN reference codec's journal (``tq6_0`` ring rows,
        4,096..8,192 unsealed tokens): with 2..4-bit bodies and ``head_dim`` a multiple of 128
        it writes the reference format (``Cache.reference_format``); the CUDA backend's ring.
        ``fields`` are the other settings (geometry first)."""
        return cls(**{**_REFERENCE, **fields})

    def layer_coding(self) -> list[tuple[int, int, str, str]]:
        if self.layer_bits is not None:
            if len(self.layer_bits) != self.layers:
                raise InvalidInputError(
                    f"layer_bits has {len(self.layer_bits)} entries for {self.layers} layers"
                )
            rows = [(k, v, b, b) for k, v, b in self.layer_bits]
        else:
            rows = [(self.k_bits, self.v_bits, self.body, self.body)] * self.layers
        return rows


def backends() -> dict[str, dict[str, list[str]]]:
    """The capability table, stated once in the core: backend (``"cpu"``, ``"cuda"``,
    ``"paged"``) -> setting -> the values it runs, written as in :class:`Config` (``"lo..hi"``
    an inclusive range, ``"K/V"`` any pair of staging types, ``"any"``). A cache refuses a
    setting its backend does not run, naming what it runs (``docs/journal.md``)."""
    return _core.backends()


def _resolved(config: Config, device_kind: str) -> Config:
    """``config`` with unset journal fields (``None``) taken from the journal the capability
    table gives the device's backend."""
    preset = _core.journal_for(device_kind)
    unset = {k: v for k, v in preset.items() if getattr(config, k) is None}
    return replace(config, **unset) if unset else config


def _checked_coding(config: Config) -> list[tuple[int, int, str, str]]:
    """``config.layer_coding()`` with every entry type-checked."""
    checked = []
    for i, row in enumerate(config.layer_coding()):
        if not isinstance(row, (tuple, list)) or len(row) != 4:
            raise InvalidInputError(f"layer_bits[{i}] must be (k_bits, v_bits, body)")
        k, v, kb, vb = row
        uniform = config.layer_bits is None
        k_name, v_name = ("k_bits", "v_bits") if uniform else (f"layer_bits[{i}]",) * 2
        checked.append(
            (
                args.integer(k_name, k, maximum=args.MAX_U32),
                args.integer(v_name, v, maximum=args.MAX_U32),
                args.text("body", kb),
                args.text("body", vb),
            )
        )
    return checked


def _spec_of(config: Config) -> Any:
    """The validated core configuration of ``config``: every field is type- and range-checked
    here (an sjkvarn error naming it), then the core checks what the values mean."""
    config = _resolved(config, "cpu")
    count = args.integer
    # kv_heads first: an unset q_heads takes its value, and the error names the field set.
    kv_heads = count("kv_heads", config.kv_heads, minimum=1)
    q_heads = kv_heads if config.q_heads is None else config.q_heads
    budget = config.staging_budget
    for name in ("mode", "stat", "staging", "sink_type", "device"):
        args.text(name, getattr(config, name))
    count("pool_sequences", config.pool_sequences, minimum=1)
    if not isinstance(config.centre_keys, (bool, np.bool_)):
        raise UnsupportedTypeError(
            f"centre_keys must be True or False, got {type(config.centre_keys).__name__}"
        )
    return _core.CacheSpec(
        count("layers", config.layers, minimum=1),
        count("q_heads", q_heads, minimum=1),
        kv_heads,
        count("head_dim", config.head_dim, minimum=1),
        _checked_coding(config),
        count("min_tail", config.min_tail),
        count("max_tail", config.max_tail),
        count("max_chunk", config.max_chunk),
        count("max_tokens", config.max_tokens, minimum=1),
        count("passes", config.passes, maximum=args.MAX_U32),
        config.mode,
        config.stat,
        config.staging,
        count("flush_chunk", config.flush_chunk),
        config.sink_type,
        count("sink", config.sink),
        None if budget is None else args.real("staging_budget", budget),
        bool(config.centre_keys),
        count("exact_recent", config.exact_recent),
    )


def _config_from_core(d: dict[str, Any], pool_sequences: int) -> Config:
    """The :class:`Config` of a restored cache, from the core's full configuration."""
    coding = [tuple(c) for c in d["layer_coding"]]
    k, v, kb, vb = coding[0]
    uniform = all(c == coding[0] for c in coding)
    body = kb
    layer_bits = None if uniform else [(c[0], c[1], c[3]) for c in coding]
    return Config(
        layers=d["layers"],
        kv_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        q_heads=d["q_heads"],
        k_bits=k,
        v_bits=v,
        body=body,
        layer_bits=layer_bits,
        min_tail=d["min_tail"],
        max_tail=d["max_tail"],
        max_chunk=d["max_chunk"],
        flush_chunk=d["flush_chunk"],
        max_tokens=d["max_tokens"],
        passes=d["passes"],
        mode=d["mode"],
        stat=d["stat"],
        staging=d["staging"],
        staging_budget=d["staging_budget"],
        centre_keys=d["centre_keys"],
        exact_recent=d["exact_recent"],
        sink=d["sink"],
        sink_type=d["sink_type"],
        pool_sequences=pool_sequences,
    )


def _layer(layer: Any) -> int:
    """A layer index as the core takes it (an integer; negative indices do not exist)."""
    if isinstance(layer, (bool, np.bool_)) or not hasattr(type(layer), "__index__"):
        raise UnsupportedTypeError(f"layer must be an integer, got {type(layer).__name__}")
    i = operator.index(layer)
    if not 0 <= i <= args.MAX_COUNT:
        raise LayerIndexError(f"layer {i} does not exist (layers are numbered from 0)")
    return i


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _exportable(x: Any, name: str) -> Any:
    if _is_torch(x) and getattr(x, "requires_grad", False):
        return x.detach()
    x = args.native_array(name, x)
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        return x.copy()
    return x


class _HostTensors:
    """How a CPU cache takes and returns tensors: numpy arrays or CPU torch tensors (any float
    dtype, converted to float32), results of the query's kind."""

    def append(self, core: Any, layer: int, k: Any, v: Any, rotated: bool) -> None:
        if not isinstance(rotated, (bool, np.bool_)):
            raise UnsupportedTypeError(f"rotated must be a bool, got {type(rotated).__name__}")
        core.append(layer, _exportable(k, "k"), _exportable(v, "v"), bool(rotated))

    def attend(
        self, core: Any, layer: int, q: Any, scale: float | None, threads: int | None
    ) -> Any:
        q = _exportable(q, "q")
        if _is_torch(q):
            import torch

            out = torch.empty(tuple(q.shape), dtype=torch.float32)
            core.attend_into(layer, q, out, scale, threads)
            return out if q.dtype == torch.float32 else out.to(q.dtype)
        out_np = np.empty(tuple(np.shape(q)), dtype=np.float32)
        core.attend_into(layer, q, out_np, scale, threads)
        return out_np


class _CudaTensors:
    """How a device cache takes and returns tensors: torch CUDA tensors on its device, work
    ordered on torch's current stream."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal

    def _f32(self, x: Any, what: str) -> Any:
        """A compact float32 view of a torch CUDA tensor on this cache's device."""
        if not _is_torch(x):
            kind = type(x).__name__
            raise UnsupportedTypeError(f"{what}: a CUDA cache takes torch CUDA tensors, got {kind}")
        if x.device.type != "cuda" or x.device.index != self.ordinal:
            here = f"cuda:{self.ordinal}"
            raise InvalidInputError(f"{what} is on {x.device}, this cache is on {here}")
        import torch

        return x.detach().to(torch.float32).contiguous()

    def _stream(self) -> int:
        import torch

        return int(torch.cuda.current_stream(self.ordinal).cuda_stream)

    def append(self, core: Any, layer: int, k: Any, v: Any, rotated: bool) -> None:
        if rotated:
            raise InvalidInputError("rotated appends are CPU-only for now")
        k32, v32 = self._f32(k, "k"), self._f32(v, "v")
        core.append(layer, k32, v32, False, self._stream())

    def attend(
        self, core: Any, layer: int, q: Any, scale: float | None, threads: int | None
    ) -> Any:
        import torch

        if threads is not None:
            raise InvalidInputError("threads applies to CPU caches; this cache is on CUDA")
        q32 = self._f32(q, "q")
        out = torch.empty(tuple(q32.shape), dtype=torch.float32, device=q32.device)
        core.attend_into(layer, q32, out, scale, None, self._stream())
        if not bool(torch.isfinite(out).all()):
            # Keys and queries are finite, so only overflowing scores give a non-finite row.
            raise InvalidInputError(
                "attention overflowed float32: the scores scale * q.k passed 3.4e38; "
                "scale the query or `scale` down"
            )
        return out if q.dtype == torch.float32 else out.to(q.dtype)


class Cache:
    """One sequence of the journaled cache (sink, staging ring, sealed body records)."""

    @args.library_errors
    def __init__(self, config: Config, *, _core_cache: Any = None) -> None:
        if not isinstance(config, Config):
            raise UnsupportedTypeError(f"config must be a Config, got {type(config).__name__}")
        kind, ordinal = _parse_device(args.text("device", config.device))
        # q_heads=None means "as many as kv_heads", unset journal fields the device's journal:
        # store them resolved, as a restored cache has them.
        q_heads = config.kv_heads if config.q_heads is None else config.q_heads
        config = _resolved(replace(config, q_heads=q_heads), kind)
        self.config = config
        if _core_cache is None:
            if kind == "cuda":
                load_nvrtc()
            device = ordinal if kind == "cuda" else None
            _core_cache = _core.Cache(_spec_of(config), config.pool_sequences, device)
        self._core = _core_cache
        # The one place the backend is chosen: how tensors cross for it.
        device = self._core.ordinal
        self._tensors = _HostTensors() if device is None else _CudaTensors(device)

    @property
    def is_cuda(self) -> bool:
        return self._core.ordinal is not None

    @args.library_errors
    def append(self, layer: int, k: Any, v: Any, *, rotated: bool = False) -> None:
        """Appends post-RoPE K and V, each ``[tokens, kv_heads, head_dim]``.

        ``rotated=True`` takes rows already in the Hadamard frame (as the reference's ``store``
        does). An append of up to ``max_chunk`` tokens is one ubatch: a seal can only run at its
        start, when the unsealed span has reached ``max_tail``.
        """
        self._tensors.append(self._core, _layer(layer), k, v, rotated)

    @args.library_errors
    def attend(
        self, layer: int, q: Any, *, scale: float | None = None, threads: int | None = None
    ) -> Any:
        """Attention of the newest ``tokens`` positions' queries ``[tokens, q_heads, head_dim]``.

        Row ``i`` sits at position ``length - tokens + i`` and sees positions up to its own.
        Returns a tensor of ``q``'s kind and dtype (computed in float32). ``threads`` caps the
        CPU threads of this call (the calling thread and the pool's workers, at most
        ``RAYON_NUM_THREADS``; ``1``: the calling thread alone); the result does not depend
        on it. Calls too small to gain from a second thread (under about 2,300 positions at 9
        query heads of 64) run on the calling thread whatever the cap. CPU caches only.
        """
        threads = args.optional_integer("threads", threads, minimum=1)
        scale = None if scale is None else args.real("scale", scale)
        return self._tensors.attend(self._core, _layer(layer), q, scale, threads)

    @args.library_errors
    def truncate(self, n: int) -> int:
        """Keeps the first ``n`` tokens; returns the position to re-append K/V from.

        A cut in the ring or the sink is free and returns ``n``; a cut in the sealed body drops
        the groups from the group floor on and returns it (at most 127 tokens before ``n``);
        ``n`` at or past the length changes nothing and returns the length.
        """
        n = args.integer("n", n)
        return int(self._core.truncate(n))

    @args.library_errors
    def seal_idle(self, keep_recent: int = 0) -> None:
        """Seals every layer back to ``min_tail`` unsealed tokens (between requests), never the
        last ``max(keep_recent, min_tail)`` positions (pass ``length - k`` to keep a turn that
        starts at ``k`` exact)."""
        self._core.seal_idle(args.integer("keep_recent", keep_recent))

    @args.library_errors
    def fork(self) -> Cache:
        """A child sequence sharing this one's sealed records (copy-on-write) and pool."""
        return Cache(self.config, _core_cache=self._core.fork())

    @args.library_errors
    def length(self, layer: int = 0) -> int:
        return int(self._core.length(_layer(layer)))

    @args.library_errors
    def regions(self, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Position ranges ``[start, end)`` of the sink, body and ring of ``layer``."""
        sink, body, ring = self._core.regions(_layer(layer))
        return {"sink": sink, "body": body, "ring": ring}

    @args.library_errors
    def chunk_limit(self, layer: int = 0) -> int:
        """Tokens the next append runs as one ubatch (a seal can only run at its start)."""
        return int(self._core.chunk_limit(_layer(layer)))

    @args.library_errors
    def memory(self) -> dict[str, float]:
        """Allocated bytes per region, token counts and occupied effective bits per value."""
        return dict(self._core.memory())

    @args.library_errors
    def staging_report(self) -> list[dict[str, Any] | None]:
        """Per layer, what ``staging="auto"`` picked and why: the K and V types, each
        candidate's measured score (keys: logit error centred over positions; values: relative
        error; both relative to the rows' spread), the budget and a one-line explanation.
        ``None`` for a fixed staging, or a layer nothing was appended to yet."""
        return [None if r is None else dict(r) for r in self._core.staging_report()]

    @args.library_errors
    def snapshot(self) -> bytes:
        return bytes(self._core.snapshot())

    @property
    def reference_format(self) -> bool:
        """Whether this cache writes the SJ-KVaRN reference format (records, staging, state)."""
        return bool(self._core.config()["reference_format"])

    @args.library_errors
    def state(self) -> bytes:
        """The sequence as an ``SJKVSEQ`` v1 stream: the reference codec's per-sequence state
        (``sj_kvarn_seq_state_write``), loadable there for a reference-format cache."""
        return bytes(self._core.state())

    @classmethod
    @args.library_errors
    def from_state(cls, config: Config, data: bytes) -> Cache:
        """A CPU cache of ``config`` restored from an ``SJKVSEQ`` stream (from :meth:`state` or
        the reference codec). Every mismatch or damage raises CorruptDataError naming it."""
        if not isinstance(config, Config):
            raise UnsupportedTypeError(f"config must be a Config, got {type(config).__name__}")
        data = args.byte_string("data", data)
        config = _resolved(config, "cpu")  # the restored cache's config holds the values used
        core = _core.Cache.from_state(_spec_of(config), data, config.pool_sequences)
        return cls(replace(config, device="cpu"), _core_cache=core)

    @args.library_errors
    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes a versioned, checksummed snapshot, atomically and durably: a temporary file of
        this call's own next to ``path`` (``.NAME.<pid>-<n>-<t>.sjkvarn-tmp``, created
        exclusively), fsync, rename, fsync of the directory. Concurrent saves never mix: each
        file holds one whole snapshot, and when two calls save the same path at once both
        succeed and the later rename wins. A failure raises :class:`StorageError` (an
        ``OSError``) and leaves ``path`` as it was. Temporaries of killed processes are removed
        by the next save to the same path. CUDA and CPU caches write the same bytes."""
        self._core.save(os.fspath(path))

    @args.library_errors
    def to(self, device: str, *, pool_sequences: int = 1) -> Cache:
        """A byte-for-byte copy of this cache on ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
        kind, ordinal = _parse_device(args.text("device", device))
        pool_sequences = args.integer("pool_sequences", pool_sequences, minimum=1)
        config = replace(self.config, device=device, pool_sequences=pool_sequences)
        if kind == "cuda":
            load_nvrtc()
        target = ordinal if kind == "cuda" else None
        return Cache(config, _core_cache=self._core.copy_to(target, pool_sequences))

    @classmethod
    @args.library_errors
    def load(
        cls, path: str | os.PathLike[str], *, pool_sequences: int = 1, device: str = "cpu"
    ) -> Cache:
        """Restores a snapshot; a mismatched, truncated or corrupted file raises
        CorruptDataError, a missing one MissingFileError."""
        pool_sequences = args.integer("pool_sequences", pool_sequences, minimum=1)
        core = _core.Cache.load(os.fspath(path), pool_sequences)
        config = _config_from_core(core.config(), pool_sequences)
        cache = cls(config, _core_cache=core)
        return cache if device == "cpu" else cache.to(device, pool_sequences=pool_sequences)
