"""`sjkvarn memory` reproduces seed 000's Qwen3.8-27B rows and matches real cache allocations."""

from __future__ import annotations

import pytest
import torch

import sjkvarn
from sjkvarn import memory


def test_seed_rows_for_qwen() -> None:
    geo = memory.geometry("qwen3.8-27b")
    seed = memory.Journal.reference()
    gb = {r["format"]: r["gb"] for r in memory.table(geo, 110_592, None, seed)}
    assert gb["f16"] == pytest.approx(6.75, rel=0.02)
    assert gb["q8_0"] == pytest.approx(3.59, rel=0.02)
    assert gb["SJ-KVaRN 4/4"] == pytest.approx(1.99, rel=0.02)
    at_200k = {r["format"]: r["gb"] for r in memory.table(geo, 204_800, None, seed)}
    assert at_200k["SJ-KVaRN 3/2t"] == pytest.approx(2.36, rel=0.02)


def allocation(name: str, geo: memory.Geometry, tokens: int) -> float:
    bits = {"SJ-KVaRN 4/4": (4, 4), "SJ-KVaRN 3/3t": (3, 3), "SJ-KVaRN 3/2t": (3, 2)}
    if name in bits:
        return memory.sjkvarn_bytes(*bits[name], geo, tokens)
    return memory.flat_bytes(name, geo, tokens)


def test_budget_search_is_the_largest_fitting_context() -> None:
    geo = memory.geometry("qwen3.8-27b")
    for row in memory.table(geo, 1000, 11.0):
        n = row["max_tokens"]
        assert isinstance(n, int)
        name = str(row["format"])
        assert allocation(name, geo, n) <= 11 * memory.GIB < allocation(name, geo, n + 1)


def test_rule_matches_a_real_cache() -> None:
    """The formula equals what sjkvarn.Cache allocates just after a seal (small geometry)."""
    for staging in ("q8_0/tq6_0", "tq6_0", "f16"):
        check_rule(staging)


def small_cache(**fields: object) -> sjkvarn.Cache:
    """Two layers of two 64-wide KV heads, a 128..384-token ring: seals after 512 tokens."""
    return sjkvarn.Cache(
        sjkvarn.Config(
            layers=2,
            kv_heads=2,
            head_dim=64,
            min_tail=128,
            max_tail=384,
            max_chunk=64,
            max_tokens=4096,
            **fields,
        )
    )


def check_rule(staging: str) -> None:
    journal = memory.Journal(min_tail=128, max_tail=384, max_chunk=64, staging=staging)
    cache = small_cache(staging=staging)
    gen = torch.Generator().manual_seed(0)
    n = 128 + 384 + 1  # the token that triggers the first seal
    for layer in range(2):
        cache.append(
            layer, torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen)
        )
    m = cache.memory()
    geo = memory.Geometry(2, 2, 64)
    expected = memory.sjkvarn_bytes(4, 4, geo, n - 1, journal)  # body = n - 1 - 128 - min_tail
    assert m["sink_bytes"] + m["ring_bytes"] + m["body_bytes"] == pytest.approx(expected, rel=1e-9)


def test_in_use_bytes_count_only_layers_that_hold_tokens() -> None:
    """A hybrid model appends to some layers only: `in_use_bytes` is what those layers hold
    allocated (sink, ring, records), the other layers' up-front sink and ring left out."""
    cache = small_cache()
    gen = torch.Generator().manual_seed(1)
    n = 700
    k, v = torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen)
    cache.append(0, k, v)
    m = cache.memory()
    assert m["body_bytes"] > 0 and m["in_use_layers"] == 1
    per_layer = (m["sink_bytes"] + m["ring_bytes"]) // 2
    assert m["in_use_bytes"] == per_layer + m["body_bytes"]
    cache.append(1, k, v)
    m = cache.memory()
    assert m["in_use_layers"] == 2 and m["in_use_bytes"] == m["allocated_bytes"]


def test_layers_of_fewer_bits_occupy_less() -> None:
    """With per-layer bits each layer's sealed records count at their own size: a 4/4 layer
    beside a 3/2t layer holds what each holds in a cache of its own coding."""
    gen = torch.Generator().manual_seed(2)
    n = 900
    k, v = torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen)

    def body_bytes(**coding: object) -> int:
        cache = small_cache(**coding)
        for layer in range(2):
            cache.append(layer, k, v)
        return int(cache.memory()["body_bytes"])

    four = body_bytes(k_bits=4, v_bits=4)
    trellis = body_bytes(k_bits=3, v_bits=2, body="trellis")
    mixed = body_bytes(layer_bits=[(4, 4, "scalar"), (3, 2, "trellis")])
    assert trellis < four
    assert mixed == four // 2 + trellis // 2


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        memory.geometry("llama-9000")
