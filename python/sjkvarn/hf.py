"""`transformers` integration: a `Cache` whose full-attention layers live in an sjkvarn journal,
and an attention function that reads the compressed cache directly.

```python
cache = sjkvarn.hf.SJKVCache(model, sjkvarn.hf.config_for(model, k_bits=3, v_bits=2,
                                                          body="trellis"))
out = model.generate(ids, past_key_values=cache, max_new_tokens=64)
```

Constructing an `SJKVCache` switches the model to the ``"sjkvarn"`` attention implementation
(registered with ``AttentionInterface``, with a mask function that builds no mask: causality
is handled inside the cache). Layers whose key tensors did not come from an `SJKVCache` (another
cache, sliding-window or hybrid layers) fall back to PyTorch SDPA with a causal mask, so the
model keeps working with other caches. Tested with transformers 5.x (``transformers>=5,<6``).
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from sjkvarn.cache import Cache, CacheError, Config

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache as HFCache
    from transformers.cache_utils import CacheLayerMixin, DynamicLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("sjkvarn.hf needs transformers 5.x: pip install 'transformers>=5,<6'") from e

IMPLEMENTATION = "sjkvarn"

# The (cache, layer, key tensor) of the most recent SJKVCache update in this context: the
# attention function uses it to recognise keys that belong to an SJKVCache.
_LAST_UPDATE: contextvars.ContextVar[tuple[Cache, int, torch.Tensor] | None] = (
    contextvars.ContextVar("sjkvarn_last_update", default=None)
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
    """Attention over the sjkvarn journal of ``module.layer_idx`` (one sequence, batch 1)."""
    last = _LAST_UPDATE.get()
    if last is None or last[2] is not key or last[1] != getattr(module, "layer_idx", None):
        return _fallback(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    cache, layer, _ = last
    if query.shape[0] != 1:
        raise CacheError("SJKVCache holds one sequence: batch size must be 1")
    q = query[0].transpose(0, 1)  # [tokens, q_heads, head_dim]
    out = cache.attend(layer, q.float().contiguous(), scale=scaling)
    return out.to(query.dtype)[None], None  # [1, tokens, q_heads, head_dim]


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The cache applies causality itself, so no mask tensor is built."""
    return None


AttentionInterface.register(IMPLEMENTATION, sjkvarn_attention)
AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)


class SJKVLayer(CacheLayerMixin):
    """One full-attention layer stored in the shared sjkvarn journal."""

    is_sliding = False

    def __init__(self, cache: Cache, layer: int, max_tokens: int) -> None:
        super().__init__()
        self.cache, self.layer, self.max_tokens = cache, layer, max_tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise CacheError("SJKVCache holds one sequence: batch size must be 1")
        k = key_states[0].transpose(0, 1).float().contiguous()  # [tokens, kv_heads, head_dim]
        v = value_states[0].transpose(0, 1).float().contiguous()
        self.cache.append(self.layer, k, v)
        _LAST_UPDATE.set((self.cache, self.layer, key_states))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.length(self.layer)

    def get_max_length(self) -> int:
        return self.max_tokens


def config_for(model: Any, **overrides: Any) -> Config:
    """A `Config` with the model's geometry; keyword arguments override any field."""
    c = model.config
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


class SJKVCache(HFCache):
    """A transformers `Cache` backed by one sjkvarn sequence (batch size 1)."""

    def __init__(self, model: Any, config: Config | None = None) -> None:
        config = config or config_for(model)
        self.sjkv = Cache(config)
        types = getattr(model.config, "layer_types", None) or ["full_attention"] * config.layers
        layers: list[Any] = []
        for i, kind in enumerate(types):
            if kind == "full_attention":
                layers.append(SJKVLayer(self.sjkv, i, config.max_tokens))
            else:  # sliding-window and other layers keep transformers' own storage
                layers.append(DynamicLayer())
        super().__init__(layers=layers)
        model.set_attn_implementation(IMPLEMENTATION)

    def truncate(self, n: int) -> int:
        """Keeps the first ``n`` tokens; returns the position to re-run the model from."""
        return self.sjkv.truncate(n)

    def rewind(self, model: Any, input_ids: torch.Tensor, n: int) -> None:
        """Truncates to ``n`` tokens of ``input_ids`` and re-runs the model on whatever the
        journal could not keep, so the cache again holds exactly ``input_ids[:, :n]``."""
        start = self.truncate(n)
        if start < n:
            with torch.no_grad():
                model(input_ids[:, start:n], past_key_values=self, use_cache=True)
