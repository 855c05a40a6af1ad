"""The journaled KV cache for one sequence, on CPU tensors (numpy or torch) via DLPack.

```python
cache = sjkvarn.Cache(sjkvarn.Config(layers=30, kv_heads=3, q_heads=9, head_dim=64))
cache.append(layer, k, v)       # [tokens, kv_heads, head_dim], post-RoPE
out = cache.attend(layer, q)    # [tokens, q_heads, head_dim]; causal over what was appended
```

Errors: :class:`CacheError` (a ``ValueError``) for bad shapes, values, settings and positions,
:class:`PoolExhaustedError` when a seal finds no free record slot, :class:`SnapshotError` for a
refused snapshot, ``IndexError`` for a layer that does not exist, ``TypeError`` for unsupported
types and dtypes, ``OSError`` for file errors. A call that raises leaves the cache as it was.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sjkvarn import _core

CacheError = _core.CacheError
PoolExhaustedError = _core.PoolExhaustedError
SnapshotError = _core.SnapshotError


@dataclass
class Config:
    """Geometry, per-layer coding, tail sizes and staging of a cache.

    ``body`` is ``"scalar"``, ``"trellis"`` (token axis) or ``"trellis-channel"``; ``layer_bits``
    overrides ``(k_bits, v_bits, body)`` per layer (tiered edge layers). ``staging`` is
    ``"tq6_0"`` (default), ``"q8_0"`` or ``"f16"``. ``pool_sequences`` sizes the record pool
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
    min_tail: int = 4096
    max_tail: int = 8192
    max_chunk: int = 512
    max_tokens: int = 32768
    passes: int = 16
    mode: str = "final"
    stat: str = "std"
    staging: str = "tq6_0"
    device: str = "cpu"
    pool_sequences: int = 1

    def layer_coding(self) -> list[tuple[int, int, str, str]]:
        if self.layer_bits is not None:
            if len(self.layer_bits) != self.layers:
                raise CacheError(
                    f"layer_bits has {len(self.layer_bits)} entries for {self.layers} layers"
                )
            return [(k, v, b, b) for k, v, b in self.layer_bits]
        return [(self.k_bits, self.v_bits, self.body, self.body)] * self.layers


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _exportable(x: Any) -> Any:
    if _is_torch(x) and getattr(x, "requires_grad", False):
        return x.detach()
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        return x.copy()
    return x


class Cache:
    """One sequence of the journaled cache (sink, staging ring, sealed body records)."""

    def __init__(self, config: Config, *, _core_cache: Any = None) -> None:
        self.config = config
        if _core_cache is not None:
            self._core = _core_cache
            return
        if config.device != "cpu":
            raise CacheError(
                f"device {config.device!r} is not available: this build has the CPU backend only"
            )
        for name in ("layers", "kv_heads", "head_dim", "max_tokens", "pool_sequences"):
            if int(getattr(config, name)) < 1:
                raise CacheError(f"{name} must be at least 1")
        self._core = _core.Cache(
            config.layers,
            config.q_heads or config.kv_heads,
            config.kv_heads,
            config.head_dim,
            config.layer_coding(),
            config.min_tail,
            config.max_tail,
            config.max_chunk,
            config.max_tokens,
            config.passes,
            config.mode,
            config.stat,
            config.staging,
            config.pool_sequences,
        )

    def append(self, layer: int, k: Any, v: Any) -> None:
        """Appends post-RoPE K and V, each ``[tokens, kv_heads, head_dim]``."""
        self._core.append(int(layer), _exportable(k), _exportable(v))

    def attend(self, layer: int, q: Any, *, scale: float | None = None) -> Any:
        """Attention of the newest ``tokens`` positions' queries ``[tokens, q_heads, head_dim]``.

        Row ``i`` sits at position ``length - tokens + i`` and sees positions up to its own.
        Returns a tensor of ``q``'s kind and dtype (computed in float32).
        """
        q = _exportable(q)
        if _is_torch(q):
            import torch

            out = torch.empty(tuple(q.shape), dtype=torch.float32)
            self._core.attend_into(int(layer), q, out, scale)
            return out if q.dtype == torch.float32 else out.to(q.dtype)
        shape = tuple(np.shape(q))
        out_np = np.empty(shape, dtype=np.float32)
        self._core.attend_into(int(layer), q, out_np, scale)
        return out_np

    def truncate(self, n: int) -> int:
        """Keeps the first ``n`` tokens; returns ``reprocess_from`` (re-append K/V from there)."""
        if n < 0:
            raise CacheError(f"cannot truncate to {n} tokens")
        return int(self._core.truncate(int(n)))

    def seal_idle(self) -> None:
        """Seals every layer back to ``min_tail`` unsealed tokens (between requests)."""
        self._core.seal_idle()

    def fork(self) -> Cache:
        """A child sequence sharing this one's sealed records (copy-on-write) and pool."""
        return Cache(self.config, _core_cache=self._core.fork())

    def length(self, layer: int = 0) -> int:
        return int(self._core.length(int(layer)))

    def regions(self, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Position ranges ``[start, end)`` of the sink, body and ring of ``layer``."""
        sink, body, ring = self._core.regions(int(layer))
        return {"sink": sink, "body": body, "ring": ring}

    def chunk_limit(self, layer: int = 0) -> int:
        """Tokens the next append can take with no seal inside it (chunked replay is exact)."""
        return int(self._core.chunk_limit(int(layer)))

    def memory(self) -> dict[str, float]:
        """Allocated bytes per region, token counts and occupied effective bits per value."""
        return dict(self._core.memory())

    def snapshot(self) -> bytes:
        return bytes(self._core.snapshot())

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes a versioned, checksummed snapshot (temporary file, fsync, rename)."""
        self._core.save(os.fspath(path))

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, pool_sequences: int = 1) -> Cache:
        """Restores a snapshot; a mismatched, truncated or corrupted file raises SnapshotError."""
        core = _core.Cache.load(os.fspath(path), pool_sequences)
        layers, q_heads, kv_heads, head_dim = core.geometry
        config = Config(layers=layers, kv_heads=kv_heads, head_dim=head_dim, q_heads=q_heads)
        return cls(config, _core_cache=core)
