"""The SJ-KVaRN journal over an engine's paged KV blocks (vLLM's, or any block-table engine).

One engine block of ``BLOCK`` (128) tokens is one sealed body group: its page holds one body
record per KV head (K and V of 128 tokens, ``codec.body_layout``), written once, when the
block's last row arrives. Until then the block's rows are held exact (fp16) beside the pages;
the first block of a sequence (the *sink*) stays exact for as long as room allows.

Each query reads, at its own position ``p``: its own block (positions ``128*(p//128)..p``) and
the sink exact, every other full block from its record. What a position sees therefore depends
only on the tokens before it, never on how the engine chunked the prefill or which request
computed a shared block first: prefix caching, chunked prefill and preemption-with-recompute
give the same outputs as one uninterrupted run.

Sliding-window layers keep their rows exact instead (:class:`WindowJournal`): a window holds
a few blocks per sequence, so coding it would save little memory and cost most of the quality.
Their pages are as large as a record page and hold ``window_block_tokens`` fp16 rows each.

This module needs torch and nothing from vLLM; ``sjkvarn.vllm.backend`` plugs it into vLLM.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from sjkvarn import _core
from sjkvarn.codec import body_layout, decode_body, encode_body
from sjkvarn.errors import InvalidInputError

BLOCK: int = _core.GROUP
"""Tokens per engine block: one sealed body group."""

WINDOW_MIN_BLOCK: int = 16
"""Fewest tokens per sliding-window page (vLLM's CPU scheduler works in multiples of 16)."""

_BODIES = ("scalar", "trellis")
_TRELLIS_BITS = ((3, 3), (3, 2), (2, 2))


@dataclass(frozen=True)
class PagedSettings:
    """How a paged cache codes its blocks.

    ``k_bits``/``v_bits``/``body``: the record coding (scalar 2..4 bits, or the reference
    trellis at 3/3, 3/2, 2/2). ``lossless=True`` stores every row in the model's dtype instead
    (the engine's own layout; for checking the plumbing against the engine's cache).
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
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
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

    def check(self) -> None:
        if self.body not in _BODIES:
            raise InvalidInputError(f"body must be one of {_BODIES}, got {self.body!r}")
        if self.body == "trellis" and (self.k_bits, self.v_bits) not in _TRELLIS_BITS:
            raise InvalidInputError(
                f"trellis bodies code k_bits/v_bits {_TRELLIS_BITS}, got "
                f"{self.k_bits}/{self.v_bits}"
            )
        if self.body == "scalar" and not (2 <= self.k_bits <= 4 and 2 <= self.v_bits <= 4):
            raise InvalidInputError(
                f"k_bits and v_bits must be 2..4, got {self.k_bits}/{self.v_bits}"
            )
        if self.max_sink_blocks < 0:
            raise InvalidInputError(
                f"max_sink_blocks must be at least 0, got {self.max_sink_blocks}"
            )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def page_state_bytes(settings: PagedSettings, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one KV head's share of a block page: one record, or (lossless) the block's K
    and V rows in ``dtype``. Raises InvalidInputError for head sizes the codec lacks."""
    if settings.lossless:
        return BLOCK * 2 * head_dim * torch.empty((), dtype=dtype).element_size()
    return body_layout(head_dim, settings.k_bits, settings.v_bits).record_bytes


def window_row_bytes(head_dim: int) -> int:
    """Bytes of one token's exact K and V rows (fp16) for one KV head in a window page."""
    return 2 * head_dim * 2


def window_block_tokens(settings: PagedSettings, head_dim: int) -> int:
    """Tokens per sliding-window page: the most (a power of two, at least 16) whose exact rows
    fit in one record page, so that both kinds of layer share vLLM's page size."""
    record = page_state_bytes(settings, head_dim, torch.float16)
    tokens = BLOCK
    while tokens > WINDOW_MIN_BLOCK and tokens * window_row_bytes(head_dim) > record:
        tokens //= 2
    return tokens


class PagedJournal:
    """One layer's journal over block pages ``[blocks, kv_heads, 1, state_bytes]`` (any dtype;
    read as bytes). Call :meth:`write` with the step's new rows, then :meth:`attend`.

    Not thread-safe: an engine runs one layer's steps in order."""

    def __init__(
        self,
        settings: PagedSettings,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        sliding_window: int | None = None,
    ) -> None:
        settings.check()
        self.settings = settings
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.window = sliding_window if sliding_window and sliding_window > 0 else None
        self.state_bytes = page_state_bytes(settings, head_dim, dtype)
        # Exact rows of open blocks and sinks: block id -> [2, BLOCK, kv_heads, head_dim] fp16.
        self._open: dict[int, torch.Tensor] = {}
        self._sealed: set[int] = set()  # blocks of `_open` whose page holds their record
        self._sinks: OrderedDict[int, torch.Tensor] = OrderedDict()
        # The record coding, as `sjkvarn.codec`'s body functions take it.
        self._coding = dict(
            k_bits=settings.k_bits,
            v_bits=settings.v_bits,
            k_body=settings.body,
            v_body=settings.body,
        )

    # -- writing ---------------------------------------------------------------------------

    def _page_bytes(self, pages: torch.Tensor) -> torch.Tensor:
        """``pages`` as ``[blocks, kv_heads, state_bytes]`` uint8."""
        blocks = pages.shape[0]
        flat = pages.view(torch.uint8).reshape(blocks, -1)
        if flat.shape[1] != self.kv_heads * self.state_bytes:
            raise InvalidInputError(
                f"KV page of {flat.shape[1]} bytes; this layer needs "
                f"{self.kv_heads} heads x {self.state_bytes} bytes"
            )
        return flat.view(blocks, self.kv_heads, self.state_bytes)

    def write(
        self, pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Stores rows ``key``/``value`` (``[tokens, kv_heads, head_dim]``) at engine slots
        ``block * BLOCK + offset`` (negative slots are padding). A block whose last row arrives
        is sealed into its page. A write at offset 0 starts the block afresh (the engine reused
        it); a write into a sealed block (the engine recomputing a cached block's last token)
        reads the block back from its record and leaves the record as it is."""
        if not torch.isfinite(key).all() or not torch.isfinite(value).all():
            raise InvalidInputError("key/value rows hold NaN or Inf")
        page = self._page_bytes(pages)
        slots = slots.to(torch.int64)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() == 0:
            return
        blocks = torch.div(slots, BLOCK, rounding_mode="floor")
        offsets = slots - blocks * BLOCK
        if self.settings.lossless:
            rows = page.view(page.shape[0], self.kv_heads, 2, BLOCK, -1).view(self.dtype)
            rows = rows.view(page.shape[0], self.kv_heads, 2, BLOCK, self.head_dim)
            rows[blocks, :, 0, offsets] = key.to(self.dtype)
            rows[blocks, :, 1, offsets] = value.to(self.dtype)
            return
        for block in torch.unique(blocks).tolist():
            mine = blocks == block
            offs = offsets[mine]
            if int(offs.min()) == 0:
                self._sinks.pop(block, None)
                self._sealed.discard(block)
                self._open[block] = torch.zeros(
                    2, BLOCK, self.kv_heads, self.head_dim, dtype=torch.float16
                )
            elif block not in self._open:
                self._open[block] = self._reopened(page, block)
                self._sealed.add(block)
            rows = self._open[block]
            rows[0, offs] = key[mine].to(torch.float16)
            rows[1, offs] = value[mine].to(torch.float16)
            if int(offs.max()) == BLOCK - 1 and block not in self._sealed:
                self._seal(page, block, rows)
                self._sealed.add(block)

    def _reopened(self, page: torch.Tensor, block: int) -> torch.Tensor:
        """Exact rows of a sealed block: its sink copy, else decoded from its record."""
        sink = self._sinks.get(block)
        if sink is not None:
            return sink.clone()
        k, v = self._decoded(page, [block])
        return torch.stack([k[0], v[0]]).permute(0, 2, 1, 3).to(torch.float16).contiguous()

    def _seal(self, page: torch.Tensor, block: int, rows: torch.Tensor) -> None:
        tiles = rows.to(torch.float32).permute(0, 2, 1, 3).contiguous()  # [2, kvh, BLOCK, d]
        record = encode_body(tiles[0], tiles[1], **self._coding)
        page[block].copy_(
            torch.frombuffer(bytearray(record), dtype=torch.uint8).view(self.kv_heads, -1)
        )

    def forget(self, live_sinks: set[int]) -> None:
        """Drops the exact rows of full blocks that are no sink; keeps ``live_sinks`` (the
        first blocks of this step's sequences) exact, up to ``max_sink_blocks``."""
        for block in [b for b in self._open if b in self._sealed]:
            rows = self._open.pop(block)
            self._sealed.discard(block)
            if self.settings.sink and self.window is None and block in live_sinks:
                self._sinks[block] = rows
        for block in live_sinks:
            if block in self._sinks:
                self._sinks.move_to_end(block)
        while len(self._sinks) > self.settings.max_sink_blocks:
            self._sinks.popitem(last=False)

    # -- reading ---------------------------------------------------------------------------

    def _decoded(self, page: torch.Tensor, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of sealed ``blocks``, ``[len(blocks), kv_heads, BLOCK, d]`` float32."""
        n = len(blocks)
        if n == 0:
            empty = torch.empty(0, self.kv_heads, BLOCK, self.head_dim)
            return empty, empty.clone()
        data = page[torch.tensor(blocks, dtype=torch.int64)].contiguous().numpy().tobytes()
        k, v = decode_body(data, head_dim=self.head_dim, **self._coding)
        shape = (n, self.kv_heads, BLOCK, self.head_dim)
        return torch.from_numpy(k).view(shape), torch.from_numpy(v).view(shape)

    def _exact(self, block: int) -> torch.Tensor | None:
        rows = self._open.get(block)
        return rows if rows is not None else self._sinks.get(block)

    def attend(
        self,
        pages: torch.Tensor,
        query: torch.Tensor,
        query_start: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of each request's new queries (``query[query_start[r]:
        query_start[r+1]]``, ``[tokens, q_heads, d]``, the last ones of a sequence of
        ``seq_lens[r]``) over its blocks (``block_table[r]``). Returns ``[tokens, q_heads, d]``
        float32."""
        page = self._page_bytes(pages)
        out = torch.empty(query.shape, dtype=torch.float32)
        table = block_table.tolist()
        for r in range(len(seq_lens)):
            start, end = query_start[r], query_start[r + 1]
            if end > start:
                out[start:end] = self._attend_one(
                    page, query[start:end].to(torch.float32), seq_lens[r], table[r], scale
                )
        return out

    def _rows_of(self, page: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Lossless pages: K and V rows of one block, ``[kv_heads, BLOCK, d]`` float32."""
        rows = page[block].view(self.dtype).view(self.kv_heads, 2, BLOCK, self.head_dim)
        return rows[:, 0].to(torch.float32), rows[:, 1].to(torch.float32)

    def _attend_one(
        self, page: torch.Tensor, q: torch.Tensor, length: int, table: list[int], scale: float
    ) -> torch.Tensor:
        n, qh, d = q.shape
        first_pos = length - n
        positions = torch.arange(first_pos, length)
        out = torch.empty(n, qh, d, dtype=torch.float32)
        in_place = not self.settings.lossless and self.window is None and page.is_contiguous()
        decoded = None if in_place else self._coded_blocks(page, first_pos, length, table)
        for qb in range(first_pos // BLOCK, (length - 1) // BLOCK + 1):
            lo = max(qb * BLOCK, first_pos) - first_pos
            hi = min((qb + 1) * BLOCK, length) - first_pos
            if in_place:
                out[lo:hi] = self._attend_in_place(page, q[lo:hi], first_pos + lo, qb, table, scale)
            else:
                out[lo:hi] = self._attend_decoded(
                    decoded, q[lo:hi], positions[lo:hi], qb, table, scale
                )
        return out

    def _own_rows(self, block: int, qb: int) -> torch.Tensor:
        own = self._exact(block)
        if own is None:
            raise InvalidInputError(
                f"block {block} (position {qb * BLOCK}) has no rows: it was never written"
            )
        return own

    def _attend_in_place(
        self,
        page: torch.Tensor,
        q: torch.Tensor,
        position: int,
        qb: int,
        table: list[int],
        scale: float,
    ) -> torch.Tensor:
        """Queries of block ``qb`` through the core's kernels: records read in place from the
        pages, the sink and the own block from their exact rows."""
        exact = []
        blocks = []
        sink = self._exact(table[0]) if self.settings.sink and qb > 0 else None
        for j in range(qb):
            if j == 0 and sink is not None:
                blocks.append(-1 - len(exact))
                exact.append(sink)
            else:
                blocks.append(table[j])
        blocks.append(-1 - len(exact))
        exact.append(self._own_rows(table[qb], qb))
        rows = torch.stack(exact).to(torch.float32)  # [m, 2, BLOCK, kvh, d]
        out = torch.empty(q.shape, dtype=torch.float32)
        _core.attend_paged(
            page,
            blocks,
            rows[:, 0].contiguous(),
            rows[:, 1].contiguous(),
            q.contiguous(),
            out,
            0,
            position,
            scale,
            q.shape[1],
            self.kv_heads,
            self.settings.k_bits,
            self.settings.v_bits,
            self.settings.body,
        )
        return out

    def _coded_blocks(
        self, page: torch.Tensor, first_pos: int, length: int, table: list[int]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """K and V (``[kv_heads, BLOCK, d]`` float32) of every full block the queries may read
        as the journal shows it to later blocks: records decoded, the sink exact."""
        lowest = 0 if self.window is None else max(0, first_pos - self.window + 1)
        first_block, last_block = lowest // BLOCK, (length - 1) // BLOCK
        coded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.settings.lossless:
            for j in range(first_block, last_block + 1):
                coded[j] = self._rows_of(page, table[j])
            return coded
        full = list(range(first_block, last_block))
        sink = self._exact(table[0]) if (self.settings.sink and self.window is None) else None
        need = [j for j in full if not (j == 0 and sink is not None)]
        k_dec, v_dec = self._decoded(page, [table[j] for j in need])
        for i, j in enumerate(need):
            coded[j] = (k_dec[i], v_dec[i])
        if sink is not None and 0 in full:
            coded[0] = (
                sink[0].permute(1, 0, 2).to(torch.float32),
                sink[1].permute(1, 0, 2).to(torch.float32),
            )
        return coded

    def _attend_decoded(
        self,
        coded: dict[int, tuple[torch.Tensor, torch.Tensor]],
        q: torch.Tensor,
        pos_q: torch.Tensor,
        qb: int,
        table: list[int],
        scale: float,
    ) -> torch.Tensor:
        """Queries of block ``qb`` over decoded blocks (lossless pages, sliding windows)."""
        lo = 0 if self.window is None else max(0, int(pos_q.min()) - self.window + 1)
        ks = [coded[j][0] for j in range(lo // BLOCK, qb)]
        vs = [coded[j][1] for j in range(lo // BLOCK, qb)]
        if self.settings.lossless:
            own_k, own_v = coded[qb]
        else:
            own = self._own_rows(table[qb], qb)
            own_k = own[0].permute(1, 0, 2).to(torch.float32)
            own_v = own[1].permute(1, 0, 2).to(torch.float32)
        k = torch.cat([*ks, own_k], dim=1)  # [kvh, T, d]
        v = torch.cat([*vs, own_v], dim=1)
        base = (lo // BLOCK) * BLOCK
        key_pos = torch.arange(base, base + k.shape[1])
        return masked_attention(q, k, v, pos_q, key_pos, self.window, scale)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos_q: torch.Tensor,
    key_pos: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
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


class WindowJournal:
    """One sliding-window layer over pages ``[blocks, kv_heads, block_tokens, *]`` (any dtype,
    read as bytes; blocks may be strided, vLLM pads them to the record page): every row exact
    in fp16, attention over the last ``window`` positions. Same calls as :class:`PagedJournal`.
    """

    def __init__(self, kv_heads: int, head_dim: int, window: int) -> None:
        if window <= 0:
            raise InvalidInputError(f"sliding window must be positive, got {window}")
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.window = window

    def _rows(self, pages: torch.Tensor) -> torch.Tensor:
        """``pages`` as ``[blocks, kv_heads, block_tokens, 2, head_dim]`` fp16, in place."""
        raw = pages.view(torch.uint8)
        row = window_row_bytes(self.head_dim)
        if raw.dim() != 4 or raw.shape[1] != self.kv_heads or raw.shape[3] != row:
            raise InvalidInputError(
                f"sliding-window page of shape {tuple(raw.shape)} bytes; this layer needs "
                f"[blocks, {self.kv_heads}, tokens, {row}]"
            )
        return raw.view(torch.float16).unflatten(3, (2, self.head_dim))

    def write(
        self, pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Stores rows ``key``/``value`` (``[tokens, kv_heads, head_dim]``) at engine slots
        ``block * block_tokens + offset`` (negative slots are padding)."""
        if not torch.isfinite(key).all() or not torch.isfinite(value).all():
            raise InvalidInputError("key/value rows hold NaN or Inf")
        rows = self._rows(pages)
        size = rows.shape[2]
        slots = slots.to(torch.int64)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() == 0:
            return
        big = float(torch.maximum(key.abs().amax(), value.abs().amax()))
        if big > torch.finfo(torch.float16).max:
            raise InvalidInputError(
                f"key/value rows reach {big:.3g}, beyond float16's range: sliding-window "
                "layers keep fp16 rows"
            )
        blocks = torch.div(slots, size, rounding_mode="floor")
        offsets = slots - blocks * size
        if int(blocks.max()) >= rows.shape[0]:
            raise InvalidInputError(f"slot {int(slots.max())} is past the last page")
        rows.select(3, 0)[blocks, :, offsets] = key.to(torch.float16)
        rows.select(3, 1)[blocks, :, offsets] = value.to(torch.float16)

    def forget(self, live_sinks: set[int]) -> None:
        """Nothing to drop: every row lives in the pages."""

    def attend(
        self,
        pages: torch.Tensor,
        query: torch.Tensor,
        query_start: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """As :meth:`PagedJournal.attend`, each query over the last ``window`` positions."""
        rows = self._rows(pages)
        size = rows.shape[2]
        out = torch.empty(query.shape, dtype=torch.float32)
        table = block_table.tolist()
        for r, length in enumerate(seq_lens):
            start, end = query_start[r], query_start[r + 1]
            if end <= start:
                continue
            q = query[start:end].to(torch.float32)
            n, _, d = q.shape
            pos_q = torch.arange(length - n, length)
            lo = max(0, length - n - self.window + 1)
            first, last = lo // size, (length - 1) // size
            ids = torch.tensor(table[r][first : last + 1], dtype=torch.int64)
            kv = rows[ids].to(torch.float32)  # [blocks, kvh, size, 2, d]
            kv = kv.permute(1, 0, 2, 3, 4).reshape(self.kv_heads, -1, 2, d)
            key_pos = torch.arange(first * size, first * size + kv.shape[1])
            out[start:end] = masked_attention(
                q, kv[:, :, 0], kv[:, :, 1], pos_q, key_pos, self.window, scale
            )
        return out


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
