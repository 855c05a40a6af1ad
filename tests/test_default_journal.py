"""The journal a cache gets unless told otherwise, and the reference codec's journal kept
reachable: both stated once in the core (``DEFAULT_JOURNAL``, ``REFERENCE_JOURNAL``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sjkvarn import Cache, Config, memory
from sjkvarn.cache import DEFAULT_JOURNAL, REFERENCE_JOURNAL


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 2, 128)).astype(np.float32)


def test_the_presets_are_the_documented_ones() -> None:
    assert DEFAULT_JOURNAL == {"min_tail": 2048, "max_tail": 3072, "staging": "q8_0/tq6_0"}
    assert REFERENCE_JOURNAL == {"min_tail": 4096, "max_tail": 8192, "staging": "tq6_0"}
    journal = memory.Journal()
    assert (journal.min_tail, journal.max_tail, journal.staging) == tuple(
        DEFAULT_JOURNAL.values()
    )
    assert memory.Journal.reference().staging == "tq6_0"


def test_a_cpu_cache_resolves_unset_fields_to_the_default_journal() -> None:
    cfg = Config(layers=1, kv_heads=2, head_dim=128)
    assert (cfg.min_tail, cfg.max_tail, cfg.staging) == (None, None, None)
    cache = Cache(cfg)
    got = {k: getattr(cache.config, k) for k in DEFAULT_JOURNAL}
    assert got == DEFAULT_JOURNAL
    assert not cache.reference_format  # q8_0 keys are an extension
    # What is set stays set.
    mine = Cache(Config(layers=1, kv_heads=2, head_dim=128, staging="f16", min_tail=256))
    assert (mine.config.staging, mine.config.min_tail) == ("f16", 256)
    assert mine.config.max_tail == DEFAULT_JOURNAL["max_tail"]


def test_the_reference_preset_writes_the_reference_format() -> None:
    cache = Cache(Config.reference(layers=1, kv_heads=2, head_dim=128))
    assert {k: getattr(cache.config, k) for k in REFERENCE_JOURNAL} == REFERENCE_JOURNAL
    assert cache.reference_format
    assert Config.reference(layers=1, kv_heads=2, head_dim=128, min_tail=128).min_tail == 128


def test_default_caches_restore_from_their_state_and_snapshot(tmp_path: Path) -> None:
    cfg = Config(layers=1, kv_heads=2, head_dim=128, min_tail=256, max_tail=384, max_chunk=128)
    cache = Cache(cfg)
    for start in range(0, 1200, 128):
        cache.append(0, rows(128, start), rows(128, start + 1))
    assert cache.regions(0)["body"][1] > cache.regions(0)["body"][0]
    q = np.random.default_rng(3).standard_normal((2, 2, 128)).astype(np.float32)
    back = Cache.from_state(cfg, cache.state())
    assert back.state() == cache.state()
    np.testing.assert_array_equal(back.attend(0, q), cache.attend(0, q))
    cache.save(tmp_path / "default.sjkv")
    loaded = Cache.load(tmp_path / "default.sjkv")
    assert loaded.config == cache.config and loaded.snapshot() == cache.snapshot()
