"""Shared by the tests: a small cache configuration that seals records after a few hundred
tokens."""

from __future__ import annotations

from sjkvarn import Config


def small_config(max_tokens: int = 1024, **kw: object) -> Config:
    """Two layers, 4 query heads over 2 KV heads of 64, a 128..256-token ring."""
    base: dict[str, object] = dict(
        layers=2,
        kv_heads=2,
        q_heads=4,
        head_dim=64,
        min_tail=128,
        max_tail=256,
        max_chunk=128,
        max_tokens=max_tokens,
    )
    base.update(kw)
    return Config(**base)  # type: ignore[arg-type]
