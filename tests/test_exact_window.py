"""The exact window (``Config(exact_recent=W)``) through the Python API: decoding and chunked
prefill read the same, states and snapshots carry the copies, memory counts them, bad values are
refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import small_config

from sjkvarn import Cache, memory
from sjkvarn.errors import InvalidInputError, SjkvarnError, UnsupportedTypeError


def rows(n: int, seed: int, offset: float = 0.0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, 2, 64)).astype(np.float32)
    return x + np.float32(offset)


def test_prefill_in_chunks_reads_what_decoding_reads() -> None:
    cfg = small_config(max_tokens=2048, min_tail=1024, max_tail=1024, exact_recent=40)
    k, v = rows(600, 1, offset=2.0), rows(600, 2)
    q = np.random.default_rng(3).standard_normal((600, 4, 64)).astype(np.float32)
    out = {}
    for chunk in (1, 50):
        cache = Cache(cfg)
        got = []
        for at in range(0, 600, chunk):
            for layer in (0, 1):
                cache.append(layer, k[at : at + chunk], v[at : at + chunk])
            got.append(cache.attend(0, q[at : at + chunk]))
        out[chunk] = np.concatenate(got)
    # Past the sink (a chunk that completes it centres keys its earlier queries score).
    np.testing.assert_array_equal(out[1][200:], out[50][200:])


def test_the_window_cuts_the_error_of_the_newest_positions() -> None:
    """Queries close to the key at their own position put much weight on the newest rows: the
    window brings an 8-bit ring's output closer to an fp16 ring's, and over an fp16 ring it
    reads the same rows (up to the order of the sums)."""
    k, v = rows(500, 4, offset=1.0), rows(500, 5)
    q = 2.0 * np.repeat(k, 2, axis=1)[-64:]
    outs = {}
    for name, kw in {
        "f16": dict(staging="f16"),
        "f16+window": dict(staging="f16", exact_recent=64),
        "q8": dict(staging="q8_0"),
        "q8+window": dict(staging="q8_0", exact_recent=64),
    }.items():
        cache = Cache(small_config(min_tail=1024, max_tail=1024, **kw))
        cache.append(0, k[:-64], v[:-64])
        cache.append(0, k[-64:], v[-64:])
        outs[name] = cache.attend(0, q)
    err = {n: np.abs(outs[n] - outs["f16"]).mean() for n in outs}
    assert err["f16+window"] < 1e-5, err
    assert err["q8+window"] < 0.25 * err["q8"], err


def test_states_snapshots_and_forks_keep_the_copies(tmp_path: Path) -> None:
    cfg = small_config(exact_recent=32)
    cache = Cache(cfg)
    for at in range(0, 700, 100):
        for layer in (0, 1):
            cache.append(layer, rows(100, at), rows(100, at + 1))
    assert cache.config.exact_recent == 32
    q = np.random.default_rng(9).standard_normal((1, 4, 64)).astype(np.float32)
    want = cache.attend(1, q)
    back = Cache.from_state(cfg, cache.state())
    np.testing.assert_array_equal(back.attend(1, q), want)
    cache.save(tmp_path / "w.sjkv")
    loaded = Cache.load(tmp_path / "w.sjkv")
    assert loaded.config.exact_recent == 32
    np.testing.assert_array_equal(loaded.attend(1, q), want)
    np.testing.assert_array_equal(cache.fork().attend(1, q), want)
    # A state without its window section, or read by a cache without a window, is refused.
    with pytest.raises(SjkvarnError, match="exact-window"):
        Cache.from_state(cfg, cache.state()[:-100])
    with pytest.raises(SjkvarnError, match="after the end"):
        Cache.from_state(small_config(exact_recent=0), cache.state())


def test_memory_counts_the_copies() -> None:
    with_window = Cache(small_config(exact_recent=64))
    without = Cache(small_config(exact_recent=0))
    for cache in (with_window, without):
        cache.append(0, rows(300, 1), rows(300, 2))
    extra = with_window.memory()["in_use_bytes"] - without.memory()["in_use_bytes"]
    assert extra == 64 * 2 * 64 * 2 * 2
    geo = memory.Geometry(layers=2, kv_heads=2, head_dim=64)
    planned = memory.sjkvarn_bytes(4, 4, geo, 4096, memory.Journal(exact_recent=64))
    assert planned - memory.sjkvarn_bytes(4, 4, geo, 4096) == 2 * 64 * 2 * 64 * 2 * 2


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, InvalidInputError), (2.5, UnsupportedTypeError), (5000, InvalidInputError)],
)
def test_bad_windows_are_refused_by_name(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="exact_recent"):
        Cache(small_config(exact_recent=value))
    with pytest.raises(SjkvarnError):
        Cache(small_config(exact_recent=value))


def test_eval_gives_the_window_to_the_sj_arms_only() -> None:
    from sjkvarn.eval.evaluation import EvalSettings

    arms = {a.name: a for a in EvalSettings(sj_exact_recent=64).select_arms()}
    windowed = {n for n, a in arms.items() if a.journal and a.journal.get("exact_recent")}
    assert {"SJ-KVaRN 4/4", "SJ-KVaRN 4/4 keys as appended", "SJ-KVaRN 3/2t"} <= windowed
    assert not any(n.startswith("KVarN") for n in windowed)
    assert "SJ-KVaRN 4/4 q8 ring" not in windowed  # an ablation names its own staging
    assert all(arms[n].journal["exact_recent"] == 64 for n in windowed)
    plain = EvalSettings().select_arms()
    assert not any(a.journal and a.journal.get("exact_recent") for a in plain)
    as_appended = {a.name: a for a in EvalSettings(sj_centre_keys=False).select_arms()}
    assert as_appended["SJ-KVaRN 3/2t"].journal["centre_keys"] is False
    assert "centre_keys" not in as_appended["SJ-KVaRN 4/4 q8 ring"].journal
    assert as_appended["KVarN 4/4 tail 0"].journal["centre_keys"] is False
