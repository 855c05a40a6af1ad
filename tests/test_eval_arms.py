"""The small preset's arms build valid caches at the tails the preset scales them to."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import sjkvarn  # noqa: E402
from sjkvarn.cli import scaled_tails  # noqa: E402
from sjkvarn.eval import evaluation  # noqa: E402

LAYERS = 30  # SmolLM2-135M: every layer cached, 9 query and 3 KV heads of 64


@pytest.mark.parametrize("tokens", [1024, 7936])
def test_every_small_preset_arm_builds_its_cache(tokens: int) -> None:
    sj_tail, kvarn_tail = scaled_tails(tokens)
    arms = evaluation.default_arms(sj_tail, kvarn_tail)
    assert len({a.name for a in arms}) == len(arms)
    for arm in (a for a in arms if a.journal is not None):
        fields = evaluation.layer_bits_of(arm.journal, LAYERS)
        cfg = sjkvarn.Config(layers=LAYERS, q_heads=9, kv_heads=3, head_dim=64, **fields)
        cache = sjkvarn.Cache(cfg)
        assert cache.config.min_tail == fields["min_tail"], arm.name
        assert cache.config.max_tail == fields["max_tail"], arm.name


def test_f16_key_ring_arm_keeps_fp16_keys_in_a_shorter_ring() -> None:
    sj_tail, kvarn_tail = scaled_tails(7936)
    arm = next(a for a in evaluation.default_arms(sj_tail, kvarn_tail) if "f16-key" in a.name)
    assert arm.journal is not None
    assert (arm.journal["min_tail"], arm.journal["max_tail"]) == (640, 1280)
    cfg = sjkvarn.Config(layers=1, q_heads=9, kv_heads=3, head_dim=64, **arm.journal)
    assert sjkvarn.Cache(cfg).config.staging == "f16/q8_0"
