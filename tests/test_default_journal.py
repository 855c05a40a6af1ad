"""The journal a cache gets unless told otherwise, and the reference codec's journal kept
reachable: both stated once in the core (``DEFAULT_JOURNAL``, ``REFERENCE_JOURNAL``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sjkvarn import Cache, Config, memory
from sjkvarn.cache import DEFAULT_JOURNAL, REFERENCE_JOURNAL
from sjkvarn.errors import InvalidInputError, UnsupportedTypeError


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 2, 128)).astype(np.float32)


def test_the_presets_are_the_documented_ones() -> None:
    assert DEFAULT_JOURNAL == {
        "min_tail": 2048,
        "max_tail": 3072,
        "staging": "q8_0",
        "centre_keys": True,
        "exact_recent": 0,
    }
    assert REFERENCE_JOURNAL == {
        "min_tail": 4096,
        "max_tail": 8192,
        "staging": "tq6_0",
        "centre_keys": False,
        "exact_recent": 0,
    }
    journal = memory.Journal()
    assert (journal.min_tail, journal.max_tail, journal.staging) == (2048, 3072, "q8_0")
    assert memory.Journal.reference().staging == "tq6_0"


def test_a_cpu_cache_resolves_unset_fields_to_the_default_journal() -> None:
    cfg = Config(layers=1, kv_heads=2, head_dim=128)
    assert (cfg.min_tail, cfg.max_tail, cfg.staging, cfg.centre_keys, cfg.exact_recent) == (
        None,
    ) * 5
    cache = Cache(cfg)
    got = {k: getattr(cache.config, k) for k in DEFAULT_JOURNAL}
    assert got == DEFAULT_JOURNAL
    assert not cache.reference_format  # q8_0 rows and centred keys are extensions
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


def test_centred_keys_keep_attention_and_are_refused_where_unsupported() -> None:
    """Keys with a shared offset, fp16 ring: centring changes only where fp16 rounds; a wrong
    type is refused by name; a cache restored from a centred state centres again."""
    rng = np.random.default_rng(5)
    k = rows(700, 7) + 5.0 * rng.standard_normal((1, 2, 128)).astype(np.float32)
    v = rows(700, 8)
    q = rng.standard_normal((3, 2, 128)).astype(np.float32)
    out = {}
    for centre in (False, True):
        cache = Cache(Config(layers=1, kv_heads=2, head_dim=128, staging="f16", centre_keys=centre))
        for start in range(0, 700, 100):
            cache.append(0, k[start : start + 100], v[start : start + 100])
        out[centre] = cache.attend(0, q)
    np.testing.assert_allclose(out[True], out[False], rtol=0, atol=2e-3)
    with pytest.raises(UnsupportedTypeError, match="centre_keys"):
        Cache(Config(layers=1, kv_heads=2, head_dim=128, centre_keys="yes"))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="fp16 sink"):
        Cache(
            Config(
                layers=1,
                kv_heads=2,
                head_dim=128,
                staging="f16",
                sink_type="inherit",
                centre_keys=True,
            )
        )
