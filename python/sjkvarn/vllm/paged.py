"""The SJ-KVaRN journal over an engine's paged KV blocks (vLLM's, or any block-table engine).

One engine block of ``BLOCK`` (128) tokens is one sealed body group: its page holds one body
record per KV head, written when the block's last row arrives; until then its rows are held
exact (fp16) beside the pages, and the first block of a sequence (the *sink*) stays exact while
room allows. A query at position ``p`` reads its own block and the sink exact, every other full
block from its record, so outputs do not depend on chunking, prefix sharing or recomputation.
Sliding-window layers keep exact fp16 rows in their pages instead (:class:`WindowJournal`).

The journal's state and rules live in the crate (``sjkvarn::backend::paged``); this module
hands it torch tensors. :func:`make_step` builds one step's read plan, which every layer of
that step shares. Needs torch and nothing from vLLM (``sjkvarn.vllm.backend`` plugs it in).
"""

from __future__ import annotations

import math
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
    """How a paged cache codes its blocks (checked by the crate).

    ``k_bits``/``v_bits``/``body``: the record coding (scalar 2..4 bits, or the reference
    trellis at 3/3, 3/2, 2/2). ``lossless=True`` stores every row in the model's dtype instead.
    ``sink``: keep the first block exact. ``max_sink_blocks``: exact sink blocks kept per layer
    (least recently used ones beyond it are read from their records).
    """

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
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
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
    """Bytes of one KV head's share of a block page: one record, or (lossless) the block's K
    and V rows in ``dtype``. Raises InvalidInputError for head sizes the codec lacks."""
    return _core.paged_sizes(*settings._args(), head_dim, str(dtype))[0]


def window_row_bytes(head_dim: int) -> int:
    """Bytes of one token's exact K and V rows (fp16) for one KV head in a window page."""
    return 2 * head_dim * 2


def window_block_tokens(settings: PagedSettings, head_dim: int) -> int:
    """Tokens per sliding-window page: the most (a power of two, at least 16) whose exact rows
    fit in one record page, so that both kinds of layer share vLLM's page size."""
    return _core.paged_sizes(*settings._args(), head_dim, "float16")[1]


def make_step(query_start: Any, seq_lens: Any, block_table: Any, block_size: int):
    """The read plan of one engine step (``_core.PagedStep``) for pages of ``block_size``
    tokens: request ``r``'s queries are rows ``query_start[r]:query_start[r+1]``, the last of
    ``seq_lens[r]`` positions held in blocks ``block_table[r]``."""

    def ints(x: Any) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.int64) if not torch.is_tensor(x) else x

    return _core.PagedStep(ints(query_start), ints(seq_lens), ints(block_table), block_size)


def masked_attention(q, k, v, pos_q, key_pos, window: int | None, scale: float) -> torch.Tensor:
    """Causal (and, with ``window``, windowed) attention of queries ``[n, q_heads, d]`` at
    positions ``pos_q`` over dense keys and values ``[kv_heads, T, d]`` at ``key_pos``, each KV
    head serving its group of query heads. Returns ``[n, q_heads, d]`` float32."""
    n, qh, d = q.shape
    kvh = k.shape[0]
    mask = key_pos[None, :] <= pos_q[:, None]
    if window is not None:
        mask &= key_pos[None, :] > pos_q[:, None] - window
    qg = q.permute(1, 0, 2).reshape(kvh, qh // kvh, n, d)
    scores = torch.matmul(qg, k[:, None].transpose(-1, -2)) * scale
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    res = torch.matmul(weights, v[:, None])  # [kvh, group, n, d]
    return res.reshape(qh, n, d).permute(1, 0, 2)


class _Layer:
    """What both layer kinds share: the plan-driven read and the old per-call interface."""

    _inner: Any
    kv_heads: int
    head_dim: int
    window: int | None

    def step_block_size(self, pages: torch.Tensor) -> int:
        return BLOCK

    def write(self, pages, key, value, slots) -> None:
        """Stores rows ``key``/``value`` (``[tokens, kv_heads, head_dim]``) at engine slots
        ``block * block_tokens + offset`` (negative slots are padding), in place in ``pages``."""
        self._inner.write(pages, key, value, slots)

    def _dense(self, pages, query, step, parts, scale: float) -> torch.Tensor:
        out = torch.zeros(query.shape, dtype=torch.float32)
        for i, (start, end, position) in enumerate(parts):
            k, v, tokens, base = self._inner.dense(pages, step, i)
            shape = (self.kv_heads, tokens, self.head_dim)
            k = torch.frombuffer(k, dtype=torch.float32).view(shape)
            v = torch.frombuffer(v, dtype=torch.float32).view(shape)
            pos_q = torch.arange(position, position + end - start)
            key_pos = torch.arange(base, base + tokens)
            q = query[start:end].to(torch.float32)
            out[start:end] = masked_attention(q, k, v, pos_q, key_pos, self.window, scale)
        return out

    def attend(self, pages, query, query_start, seq_lens, block_table, scale, *, step=None):
        """Causal attention of each request's new queries (``query[query_start[r]:
        query_start[r+1]]``, ``[tokens, q_heads, d]``, the last of ``seq_lens[r]`` positions)
        over its blocks (``block_table[r]``); ``step`` (:func:`make_step`) replaces the three
        when the caller shares one plan across layers. Returns ``[tokens, q_heads, d]`` float32."""
        if step is None:
            step = make_step(query_start, seq_lens, block_table, self.step_block_size(pages))
        return self._attend(pages, query, step, scale)


class PagedJournal(_Layer):
    """One layer's journal over block pages ``[blocks, kv_heads, 1, state_bytes]`` (any dtype;
    read as bytes). Call :meth:`write` with the step's new rows, then :meth:`attend`, then
    :meth:`forget`. Overlapping calls from two threads are refused."""

    def __init__(
        self,
        settings: PagedSettings,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        sliding_window: int | None = None,
    ) -> None:
        self.settings = settings
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.window = sliding_window if sliding_window and sliding_window > 0 else None
        self._inner = _core.PagedJournal(
            *settings._args(), kv_heads, head_dim, str(dtype), self.window
        )
        self.state_bytes = self._inner.state_bytes

    @property
    def _open(self) -> list[int]:
        """Blocks whose exact rows are held open (for inspection)."""
        return self._inner.open_blocks()

    def _attend(self, pages, query, step, scale: float) -> torch.Tensor:
        if not self._inner.reads_in_place:
            return self._dense(pages, query, step, step.query_blocks, scale)
        out = torch.empty(query.shape, dtype=torch.float32)
        self._inner.attend(pages, step, query, out, scale)
        return out

    def forget(self, live_sinks) -> None:
        """Drops the exact rows of full blocks that are no sink; keeps ``live_sinks`` (the
        first blocks of this step's sequences) exact, up to ``max_sink_blocks``."""
        self._inner.forget(sorted(live_sinks))


class WindowJournal(_Layer):
    """One sliding-window layer over pages ``[blocks, kv_heads, block_tokens, *]`` (any dtype,
    read as bytes; blocks may be padded): every row exact in fp16, attention over the last
    ``window`` positions. Same calls as :class:`PagedJournal`."""

    def __init__(self, kv_heads: int, head_dim: int, window: int) -> None:
        self._inner = _core.WindowJournal(kv_heads, head_dim, window)
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.window = window

    def step_block_size(self, pages: torch.Tensor) -> int:
        return pages.shape[2] if pages.dim() == 4 else 1

    def _attend(self, pages, query, step, scale: float) -> torch.Tensor:
        return self._dense(pages, query, step, step.requests, scale)

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
    """Sequences of ``tokens`` that fit in one GiB of KV memory.

    Full-attention layers: pages plus, unless lossless, the two exact blocks (sink and open
    block, fp16) each sequence holds beside them. ``window_layers`` of the ``layers`` attend
    over the last ``window`` positions and hold the blocks vLLM keeps for a decoding sequence
    (``ceil(window / block) + 1``): exact pages of ``window_block_tokens`` rows for sjkvarn,
    pages of the plain layout when lossless (vLLM's own cache)."""
    blocks = math.ceil(tokens / BLOCK)
    full = layers - window_layers
    page = kv_heads * page_state_bytes(settings, head_dim, dtype)
    side = 0 if settings.lossless else 2 * full * 2 * BLOCK * kv_heads * head_dim * 2
    per_window = BLOCK if settings.lossless else window_block_tokens(settings, head_dim)
    kept = math.ceil(min(window, tokens) / per_window) + 1 if window_layers else 0
    return 2**30 / (full * blocks * page + side + window_layers * kept * page)
