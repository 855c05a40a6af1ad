"""`transformers` integration: a `Cache` whose full-attention layers live in sjkvarn journals (one
sjkvarn sequence per batch row, all on one record pool), and an attention function that reads
the compressed cache directly.

```python
cache = sjkvarn.hf.SJKVCache(model, sjkvarn.hf.config_for(model, k_bits=3, v_bits=2,
                                                          body="trellis"))
tok.padding_side = "left"                      # batches: left padding only
batch = tok(prompts, return_tensors="pt", padding=True)
out = model.generate(**batch, cache=cache, max_new_tokens=64)
```

Constructing an `SJKVCache` switches the model to the ``"sjkvarn"`` attention implementation,
registered with ``AttentionInterface`` and with a mask function (``AttentionMaskInterface``) that
builds the mask PyTorch SDPA would and records the 2-D padding mask it is handed. Full-attention
layers append, per row, only the tokens that mask marks real (a suffix of every chunk under left
padding; a mask with padding after real tokens raises `CacheError`) and attend per row over the
row's own sequence, ignoring the 4-D mask: the sjkvarn cache is causal over exactly what was
appended. Query positions that are padding get zeros. Sliding-window and other layers keep
transformers' own storage (``DynamicSlidingWindowLayer`` for ``"sliding_attention"``: a bounded
window) and attend with SDPA and the full mask, padding included; so do layers whose keys did not
come from an `SJKVCache` (another cache), so the model keeps working with other caches.

Generation works with greedy search, sampling, ``num_return_sequences`` and beam search
(``reorder_cache``: new row ``i`` is a fork of old row ``beam_idx[i]``; forks share sealed records
copy-on-write). Pass the cache as ``cache=`` (transformers 5.24 deprecates ``past_key_values=``,
which keeps working until transformers removes it). ``get_seq_length`` is the padded length
transformers expects; `SJKVCache.rows` holds each row's sequence of real tokens. Tested with
transformers 5.24 (``transformers>=5,<6``).
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass, fields, replace
from typing import Any

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "sjkvarn.hf needs torch and transformers 5.x: pip install 'sjkvarn[hf]'"
    ) from e

from sjkvarn import _arguments as args
from sjkvarn.cache import Cache, CacheError, Config
from sjkvarn.errors import UnsupportedTypeError

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache as HFCache
    from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("sjkvarn.hf needs transformers 5.x: pip install 'sjkvarn[hf]'") from e

try:
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs
except ImportError:  # pragma: no cover - transformers releases before the per-layer mapping
    DYNAMIC_LAYER_TYPE_MAPPING = None
    get_layer_types_and_kwargs = None

__all__ = [
    "IMPLEMENTATION",
    "SJKVCache",
    "SJKVLayer",
    "config_for",
    "sjkvarn_attention",
    "sjkvarn_mask",
]

IMPLEMENTATION = "sjkvarn"


@dataclass
class _Update:
    """The most recent SJKVCache layer update in this context: the attention function uses it to
    recognise keys that belong to an SJKVCache, and to know each row's real tokens."""

    owner: SJKVCache
    layer: int
    key: torch.Tensor
    counts: list[int]  # real (appended) tokens of each row in this chunk: a suffix of the chunk


@dataclass
class _Padding:
    """The 2-D padding mask a mask function was handed (``None``: no padding), until the first
    SJKVCache layer of the forward pass consumes it."""

    mask: torch.Tensor | None
    fresh: bool = True


_LAST_UPDATE: contextvars.ContextVar[_Update | None] = contextvars.ContextVar(
    "sjkvarn_last_update", default=None
)
_PADDING: contextvars.ContextVar[_Padding | None] = contextvars.ContextVar(
    "sjkvarn_padding", default=None
)


def _fallback(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if attention_mask is None and q_len > 1:
        rows = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        attention_mask = torch.arange(kv_len, device=query.device)[None, :] <= rows
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, is_causal=False, **kwargs
    )


def sjkvarn_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of ``module.layer_idx``: per row over that row's sjkvarn sequence when the keys
    came from an `SJKVCache` (the mask is not needed: padding was never appended), else SDPA."""
    last = _LAST_UPDATE.get()
    if last is None or last.key is not key or last.layer != getattr(module, "layer_idx", None):
        return _fallback(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise CacheError(f"sjkvarn attention does not support {name!r} (logit softcap, sinks)")
    batch, heads, tokens, head_dim = query.shape
    rows = last.owner.rows
    if batch != len(rows) or batch != len(last.counts):
        raise CacheError(f"query batch {batch} does not match the cache's {len(rows)} rows")
    q = query.transpose(1, 2)  # [batch, tokens, q_heads, head_dim]
    if all(n == tokens for n in last.counts):
        outs = [
            row.attend(last.layer, q[b].float().contiguous(), scale=scaling)
            for b, row in enumerate(rows)
        ]
        return torch.stack(outs).to(query.dtype), None
    out = query.new_zeros((batch, tokens, heads, head_dim), dtype=torch.float32)
    for b, (row, n) in enumerate(zip(rows, last.counts, strict=True)):
        if n:  # padding positions (the chunk's prefix) keep zeros
            out[b, tokens - n :] = row.attend(
                last.layer, q[b, tokens - n :].float().contiguous(), scale=scaling
            )
    return out.to(query.dtype), None


_SDPA_MASK_SIGNATURE = inspect.signature(sdpa_mask)


def sjkvarn_mask(*args: Any, **kwargs: Any) -> Any:
    """The mask function of the ``"sjkvarn"`` implementation: records the 2-D padding mask for
    the SJKVCache layers of this forward pass and returns what `sdpa_mask` returns, for the layers
    that attend with SDPA (sliding-window layers, other caches)."""
    mask = _SDPA_MASK_SIGNATURE.bind_partial(*args, **kwargs).arguments.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        _PADDING.set(_Padding(mask.to(torch.bool)))
    else:
        _PADDING.set(_Padding(None))
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(IMPLEMENTATION, sjkvarn_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sjkvarn_mask)


class SJKVLayer(CacheLayerMixin):
    """One full-attention layer: layer ``layer`` of every row's sjkvarn sequence. ``padded`` is
    the length transformers sees (padding included); the rows hold only real tokens."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: SJKVCache, layer: int, max_tokens: int) -> None:
        super().__init__()
        self.owner, self.layer, self.max_tokens = owner, layer, max_tokens
        self.padded = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        counts = self.owner._chunk_counts(self, key_states.shape[0], key_states.shape[-2])
        rows = self.owner.rows
        tokens = key_states.shape[-2]
        for b, (row, n) in enumerate(zip(rows, counts, strict=True)):
            if n:
                # [tokens, kv_heads, head_dim], the chunk's last n (real) tokens
                k = key_states[b, :, tokens - n :].transpose(0, 1).float().contiguous()
                v = value_states[b, :, tokens - n :].transpose(0, 1).float().contiguous()
                row.append(self.layer, k, v)
        self.padded += tokens
        _LAST_UPDATE.set(_Update(self.owner, self.layer, key_states, counts))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.padded + query_length, 0

    def get_seq_length(self) -> int:
        return self.padded

    def get_max_length(self) -> int:
        return self.max_tokens

    def reset(self) -> None:
        self.padded = 0

    def offload(self) -> None:  # the journal lives in sjkvarn's own memory
        pass

    def prefetch(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # SJKVCache reorders its rows
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        pass


def config_for(model: Any, **overrides: Any) -> Config:
    """A `Config` with the model's geometry; keyword arguments override any field."""
    unknown = sorted(set(overrides) - {f.name for f in fields(Config)})
    if unknown:
        raise UnsupportedTypeError(f"config_for: {unknown} are not Config fields")
    if not hasattr(model, "config"):
        raise UnsupportedTypeError(
            f"model must be a transformers model (with a .config), got {type(model).__name__}"
        )
    c = model.config
    c = c.get_text_config(decoder=True) if hasattr(c, "get_text_config") else c
    heads = c.num_attention_heads
    geometry = dict(
        layers=c.num_hidden_layers,
        q_heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        max_tokens=getattr(c, "max_position_embeddings", 32768),
    )
    geometry.update(overrides)
    return Config(**geometry)


def _other_layers(model: Any, layers: int) -> list[tuple[str, Any]]:
    """``(layer type, transformers' own layer or None)`` per layer: ``None`` for the
    full-attention layers sjkvarn stores, the layer `DynamicCache` would use for the others."""
    config = model.config
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if get_layer_types_and_kwargs is not None and DYNAMIC_LAYER_TYPE_MAPPING is not None:
        types, per_layer = get_layer_types_and_kwargs(config)
    else:  # pragma: no cover - older transformers 5.x
        types = getattr(config, "layer_types", None) or ["full_attention"] * layers
        window = getattr(config, "sliding_window", None)
        per_layer = [{"sliding_window": window} if t == "sliding_attention" else {} for t in types]
    if len(types) != layers:
        raise CacheError(f"the model has {len(types)} layers; the sjkvarn config has {layers}")
    out: list[tuple[str, Any]] = []
    for kind, kw in zip(types, per_layer, strict=True):
        if kind == "full_attention":
            out.append((kind, None))
        elif DYNAMIC_LAYER_TYPE_MAPPING is not None and kind in DYNAMIC_LAYER_TYPE_MAPPING:
            out.append((kind, DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw)))
        elif kind in ("sliding_attention", "chunked_attention") and kw.get("sliding_window"):
            out.append((kind, DynamicSlidingWindowLayer(sliding_window=kw["sliding_window"])))
        else:
            out.append((kind, DynamicLayer()))
    return out


class SJKVCache(HFCache):
    """A transformers `Cache` backed by one sjkvarn sequence per batch row.

    The rows share one record pool, created when the first update reveals the batch size (or by
    the first use of `sjkv`, for batch 1) with ``pool_sequences = max(config.pool_sequences,
    batch)``; size ``config.pool_sequences`` up front to grow the batch later
    (``batch_repeat_interleave``). Beam search keeps within the pool: forks share records.
    """

    def __init__(self, model: Any, config: Config | None = None) -> None:
        config = config or config_for(model)
        self.config = config
        self._rows: list[Cache] | None = None
        self._last_layer = -1  # the SJKV layer updated last: a smaller one starts a forward pass
        self._counts: list[int] | None = None  # real tokens per row of the current chunk
        self._chunk_tokens = 0
        layers: list[Any] = []
        for i, (_, other) in enumerate(_other_layers(model, config.layers)):
            layers.append(SJKVLayer(self, i, config.max_tokens) if other is None else other)
        super().__init__(layers=layers)
        model.set_attn_implementation(IMPLEMENTATION)

    # -- rows -------------------------------------------------------------------------------

    def _sj_layers(self) -> list[SJKVLayer]:
        return [layer for layer in self.layers if isinstance(layer, SJKVLayer)]

    def _make_rows(self, batch: int) -> list[Cache]:
        pool = max(int(self.config.pool_sequences), batch)
        first = Cache(replace(self.config, pool_sequences=pool))
        return [first] + [first.fork() for _ in range(batch - 1)]

    def _is_empty(self) -> bool:
        return all(layer.padded == 0 for layer in self._sj_layers()) and all(
            row.length(layer.layer) == 0 for row in self._rows or [] for layer in self._sj_layers()
        )

    def _ensure_rows(self, batch: int) -> list[Cache]:
        if self._rows is None or (len(self._rows) != batch and self._is_empty()):
            self._rows = self._make_rows(batch)
        elif len(self._rows) != batch:
            raise CacheError(
                f"this SJKVCache holds {len(self._rows)} rows; the input has batch size {batch}"
            )
        return self._rows

    @property
    def rows(self) -> list[Cache]:
        """Each batch row's sjkvarn sequence (real tokens only); empty before the first update."""
        return list(self._rows or [])

    @property
    def sjkv(self) -> Cache:
        """The sjkvarn sequence of a batch-1 cache (created on first use)."""
        if self._rows is None:
            self._rows = self._make_rows(1)
        if len(self._rows) != 1:
            raise CacheError(
                f"this SJKVCache holds {len(self._rows)} rows: use .rows[i] for one row's sequence"
            )
        return self._rows[0]

    def _chunk_counts(self, layer: SJKVLayer, batch: int, tokens: int) -> list[int]:
        """Real tokens of each row in this chunk: from the padding mask of this forward pass,
        computed (and checked) once, at its first SJKV layer."""
        padding = _PADDING.get()
        fresh = padding is not None and padding.fresh
        same_pass = (
            not fresh
            and layer.layer > self._last_layer
            and self._counts is not None
            and len(self._counts) == batch
            and self._chunk_tokens == tokens
        )
        if not same_pass:
            mask = None
            if fresh:
                assert padding is not None
                padding.fresh = False
                mask = padding.mask
            self._counts = self._counts_from(mask, layer, batch, tokens)
            self._chunk_tokens = tokens
        self._last_layer = layer.layer
        assert self._counts is not None
        return self._counts

    def _counts_from(
        self, mask: torch.Tensor | None, layer: SJKVLayer, batch: int, tokens: int
    ) -> list[int]:
        if mask is None:
            self._ensure_rows(batch)
            return [tokens] * batch
        past = layer.padded
        if mask.shape[0] != batch:
            raise CacheError(f"attention_mask has {mask.shape[0]} rows for a batch of {batch}")
        if mask.shape[1] != past + tokens:
            raise CacheError(
                f"attention_mask covers {mask.shape[1]} positions, but the cache holds {past} and "
                f"the input has {tokens}: pass a mask over all {past + tokens} positions"
            )
        m = mask.to(torch.int8)
        holes = (m[:, 1:] < m[:, :-1]).any(dim=1).nonzero()
        if holes.numel():
            b = int(holes[0, 0])
            raise CacheError(
                f"attention_mask row {b} has padding after real tokens (right padding or a "
                "hole); SJKVCache takes left-padded batches only (tokenizer.padding_side = 'left')"
            )
        counts = [int(n) for n in m[:, past:].sum(dim=1).tolist()]
        before = [int(n) for n in m[:, :past].sum(dim=1).tolist()]
        rows = self._ensure_rows(batch)
        for b, row in enumerate(rows):
            if row.length(layer.layer) != before[b]:
                raise CacheError(
                    f"row {b} holds {row.length(layer.layer)} tokens but attention_mask marks "
                    f"{before[b]} real positions before this input"
                )
        return counts

    def _select(self, index: list[int]) -> None:
        """New row ``i`` is old row ``index[i]``: moved on its first use, forked after that."""
        if self._rows is None:
            return
        n = len(self._rows)
        bad = [i for i in index if not 0 <= i < n]
        if bad:
            raise CacheError(f"row index {bad[0]} is out of range for {n} rows")
        used: set[int] = set()
        rows: list[Cache] = []
        for i in index:
            rows.append(self._rows[i] if i not in used else self._rows[i].fork())
            used.add(i)
        self._rows = rows
        self._last_layer, self._counts = -1, None

    # -- transformers' Cache API ------------------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: new row ``i`` is (a copy-on-write fork of) old row ``beam_idx[i]``."""
        self._select([int(i) for i in beam_idx.tolist()])
        for layer in self.layers:
            if not isinstance(layer, SJKVLayer):
                layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._rows is not None:
            self._select([i for i in range(len(self._rows)) for _ in range(repeats)])
        for layer in self.layers:
            if not isinstance(layer, SJKVLayer):
                layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        index = indices.nonzero().flatten() if indices.dtype == torch.bool else indices.flatten()
        self._select([int(i) for i in index.tolist()])
        for layer in self.layers:
            if not isinstance(layer, SJKVLayer):
                layer.batch_select_indices(indices)

    def reset(self) -> None:
        """Empties every row and layer (the pool is created again on the next update)."""
        self._rows, self._counts, self._last_layer = None, None, -1
        for layer in self.layers:
            layer.reset()

    def crop(self, max_length: int) -> None:
        """transformers' convention (batch 1): keeps the first ``max_length`` tokens, or with a
        negative ``max_length`` removes the last ``-max_length``; a cache no longer than
        ``max_length`` is left as it is. Raises CacheError where the cut falls in sealed
        records: use `rewind`."""
        max_length = args.integer("max_length", max_length, minimum=-args.MAX_COUNT)
        row = self.sjkv
        length = row.length(self._first_layer())
        n = length + max_length if max_length < 0 else max_length
        if n < 0:
            raise CacheError(f"cannot remove {-max_length} tokens from {length}")
        if n >= length:
            return
        if self._cut(row.fork(), n) < n:
            raise CacheError(
                f"the cut at {n} falls in sealed records: use rewind(model, input_ids, {n})"
            )
        self.truncate(n)

    # -- sjkvarn ----------------------------------------------------------------------------

    def _first_layer(self) -> int:
        layers = self._sj_layers()
        if not layers:
            raise CacheError("this model has no full-attention layer for sjkvarn to store")
        return layers[0].layer

    def _cut(self, row: Cache, n: int) -> int:
        """Truncates ``row`` to ``n`` tokens; returns where its layers now end. Each layer keeps up
        to its own resume point (the same in every layer: one schedule); the core's return value
        would also count the layers sjkvarn does not store (length 0)."""
        row.truncate(n)
        return min(row.length(layer.layer) for layer in self._sj_layers())

    def truncate(self, n: int) -> int:
        """Keeps the first ``n`` real tokens (batch 1); returns the position to re-run the model
        from. Transformers' own layers (sliding windows) are cut to the same position."""
        if n < 0:
            raise CacheError(f"cannot truncate to {n} tokens")
        row = self.sjkv
        first = self._first_layer()
        length = row.length(first)
        pads = self._sj_layers()[0].padded - length
        if n < length:
            for layer in self.layers:
                if isinstance(layer, DynamicSlidingWindowLayer) and (
                    layer.get_seq_length() >= layer.sliding_window
                ):
                    raise CacheError(
                        "cannot truncate: a sliding-window layer has already dropped positions "
                        "before its window"
                    )
        start = self._cut(row, n)
        new_padded = pads + start
        for layer in self.layers:
            if isinstance(layer, SJKVLayer):
                layer.padded = pads + row.length(layer.layer)
            else:
                cut = layer.get_seq_length() - new_padded
                if cut > 0:
                    layer.crop(-cut)
        self._last_layer, self._counts = -1, None
        return start

    def rewind(self, model: Any, input_ids: torch.Tensor, n: int) -> None:
        """Truncates to ``n`` tokens of ``input_ids`` and re-runs the model on whatever the
        journal could not keep, so the cache again holds exactly ``input_ids[:, :n]``."""
        start = self.truncate(n)
        if start < n:
            with torch.no_grad():
                model(input_ids[:, start:n], use_cache=True, **_cache_kwarg(model, self))


def _cache_kwarg(model: Any, cache: HFCache) -> dict[str, Any]:
    """``cache=`` where the model's forward takes it (transformers 5.24 on), else the older
    ``past_key_values=``."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}
