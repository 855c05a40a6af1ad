"""The SJ-KVaRN journal over an engine's paged KV blocks (vLLM's, or any block-table engine).

A block of ``BLOCK`` tokens is sealed into one record per KV head when its last row arrives;
open blocks and sinks stay exact (fp16), sliding-window layers keep fp16 rows in their pages.
The state and rules live in the crate (``sjkvarn::backend::paged``): this module hands it torch
tensors, and :func:`make_step` builds the read plan every layer of one engine step shares.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from sjkvarn import _core
from sjkvarn.errors import InvalidInputError

BLOCK: int = _core.GROUP
"""Tokens per engine block: one sealed body group."""

WINDOW_MIN_BLOCK: int = 16
"""Fewest tokens per sliding-window page (vLLM's CPU scheduler works in multiples of 16)."""


@dataclass(frozen=True)
class PagedSettings:
    """How a paged cache codes its blocks (values checked by the crate): ``k_bits``/``v_bits``/
    ``body`` the record coding (scalar 2..4 bits, or trellis 3/3, 3/2, 2/2); ``lossless`` rows in
    the model's dtype instead; ``sink`` the first block exact; ``max_sink_blocks`` exact sinks kept
    per layer (least recently used ones beyond it are read from their records)."""

    k_bits: int = 4
    v_bits: int = 4
    body: str = "scalar"
    sink: bool = True
    lossless: bool = False
    max_sink_blocks: int = 256

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> PagedSettings:
        """Settings from a JSON-like mapping (``--additional-config '{"sjkvarn": {...}}'``);
        unknown keys and bad values raise :class:`sjkvarn.InvalidInputError` naming them."""
        values, known = dict(values or {}), {f.name for f in fields(cls)}
        if unknown := sorted(set(values) - known):
            raise InvalidInputError(f"unknown sjkvarn setting(s) {unknown}; known: {sorted(known)}")
        for name, value in values.items():
            want = bool if name in ("sink", "lossless") else str if name == "body" else int
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise InvalidInputError(
                    f"sjkvarn setting {name!r} must be {want.__name__}, got {value!r}"
                )
        settings = cls(**values)
        settings.check()
        return settings

    def _args(self) -> tuple[int, int, str, bool, bool, int]:
        return self.k_bits, self.v_bits, self.body, self.sink, self.lossless, self.max_sink_blocks

    def check(self) -> None:
        _core.paged_check(*self._args())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def page_state_bytes(settings: PagedSettings, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one KV head's share of a block page: a record, or (lossless) K and V rows."""
    return _core.paged_sizes(*settings._args(), head_dim, str(dtype))[0]


def window_row_bytes(head_dim: int) -> int:
    """Bytes of one token's exact K and V rows (fp16) for one KV head in a window page."""
    return 2 * head_dim * 2


def window_block_tokens(settings: PagedSettings, head_dim: int) -> int:
    """Tokens per sliding-window page: as many exact rows as fit in a record page (vLLM's)."""
    return _core.paged_sizes(*settings._args(), head_dim, "float16")[1]


def make_step(query_start: Any, seq_lens: Any, block_table: Any, block_size: int):
    """One engine step's read plan (``_core.PagedStep``, pages of ``block_size`` tokens): request
    ``r``'s queries are rows ``query_start[r]:query_start[r+1]``, the last of ``seq_lens[r]``
    positions, in blocks ``block_table[r]``."""
    ints = [torch.as_tensor(x, dtype=torch.int64) for x in (query_start, seq_lens, block_table)]
    return _core.PagedStep(*ints, block_size)


def masked_attention(q, k, v, pos_q, key_pos, window: int | None, scale: float) -> torch.Tensor:
    """Causal (and windowed) attention of queries ``[n, q_heads, d]`` at ``pos_q`` over keys and
    values ``[kv_heads, T, d]`` at ``key_pos``. Returns ``[n, q_heads, d]`` float32."""
    (n, qh, d), kvh = q.shape, k.shape[0]
    mask = key_pos[None, :] <= pos_q[:, None]
    if window is not None:
        mask &= key_pos[None, :] > pos_q[:, None] - window
    qg = q.permute(1, 0, 2).reshape(kvh, qh // kvh, n, d)
    scores = torch.matmul(qg, k[:, None].transpose(-1, -2)) * scale
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    res = torch.matmul(weights, v[:, None])  # [kvh, group, n, d]
    return res.reshape(qh, n, d).permute(1, 0, 2)


class _Layer:
    """Both layer kinds: writes go to the crate, reads follow one step's plan."""

    _parts = "query_blocks"  # the plan's units one dense read serves

    def step_block_size(self, pages: torch.Tensor) -> int:
        return BLOCK

    def write(self, pages, key, value, slots) -> None:
        """Stores rows ``[tokens, kv_heads, head_dim]`` at slots (negative: padding), in place."""
        self._inner.write(pages, key, value, slots)

    def attend(self, pages, query, query_start, seq_lens, block_table, scale, *, step=None):
        """Causal attention of the queries ``[tokens, q_heads, d]`` (request ``r``'s are rows
        ``query_start[r]:query_start[r+1]``, the last of ``seq_lens[r]`` positions, in blocks
        ``block_table[r]``; or as a shared ``step`` plans). Returns float32, ``query``'s shape."""
        if step is None:
            step = make_step(query_start, seq_lens, block_table, self.step_block_size(pages))
        if getattr(self._inner, "reads_in_place", False):
            out = torch.empty(query.shape, dtype=torch.float32)
            self._inner.attend(pages, step, query, out, scale)
            return out
        # Lossless pages and windows: torch attention over the keys the plan selects, per query
        # block (per request for window layers, whose pages hold every row exact).
        out = torch.zeros(query.shape, dtype=torch.float32)
        for i, (start, end, position) in enumerate(getattr(step, self._parts)):
            k, v, tokens, base = self._inner.dense(pages, step, i)
            k = torch.frombuffer(k, dtype=torch.float32).view(-1, tokens, query.shape[2])
            v = torch.frombuffer(v, dtype=torch.float32).view(k.shape)
            pos_q = torch.arange(position, position + end - start)
            key_pos = torch.arange(base, base + tokens)
            q = query[start:end].to(torch.float32)
            out[start:end] = masked_attention(q, k, v, pos_q, key_pos, self.window, scale)
        return out


class PagedJournal(_Layer):
    """One layer's journal over pages ``[blocks, kv_heads, 1, state_bytes]`` (any dtype): call
    :meth:`write`, :meth:`attend`, then :meth:`forget`; overlapping calls are refused."""

    def __init__(
        self,
        settings: PagedSettings,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        sliding_window: int | None = None,
    ) -> None:
        self.settings, self.dtype = settings, dtype
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.window = sliding_window if sliding_window and sliding_window > 0 else None
        args = (*settings._args(), kv_heads, head_dim, str(dtype), self.window)
        self._inner = _core.PagedJournal(*args)
        self.state_bytes = self._inner.state_bytes

    @property
    def _open(self) -> list[int]:  # the open blocks, for inspection
        return self._inner.open_blocks()

    def forget(self, live_sinks) -> None:
        """Drops full blocks' exact rows, but keeps ``live_sinks`` (up to ``max_sink_blocks``)."""
        self._inner.forget(sorted(live_sinks))


class WindowJournal(_Layer):
    """One sliding-window layer over pages ``[blocks, kv_heads, block_tokens, *]`` (any dtype,
    blocks may be padded): rows exact in fp16, attention over the last ``window`` positions."""

    _parts = "requests"

    def __init__(self, kv_heads: int, head_dim: int, window: int) -> None:
        self._inner = _core.WindowJournal(kv_heads, head_dim, window)
        self.kv_heads, self.head_dim, self.window = kv_heads, head_dim, window

    def step_block_size(self, pages: torch.Tensor) -> int:
        return pages.shape[2] if pages.dim() == 4 else 1

    def forget(self, live_sinks) -> None:
        """Nothing to drop: every row lives in the pages."""


def sequences_per_gib(
    settings: PagedSettings,
    tokens: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    window_layers: int = 0,
    window: int = 0,
) -> float:
    """Sequences of ``tokens`` per GiB of KV memory (pages and the exact blocks beside them;
    ``window_layers`` of the ``layers`` keep the blocks of their last ``window`` positions)."""
    geometry = (tokens, layers, kv_heads, head_dim, str(dtype), window_layers, window)
    return _core.paged_sequences_per_gib(*settings._args(), *geometry)
