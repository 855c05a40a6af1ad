"""Keys and values staged in different types, and ``staging="auto"``: each layer measures every
type on its own first rows and keeps the smallest within the budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sjkvarn import Cache, Config, InvalidInputError

HEADS, DIM = 2, 128


def rows(n: int, seed: int, outliers: bool = False) -> np.ndarray:
    """``[n][heads][dim]`` Gaussian rows, plus (``outliers``) three channels with large offsets
    every position shares, as real models' keys have."""
    x = np.random.default_rng(seed).standard_normal((n, HEADS, DIM)).astype(np.float32)
    if outliers:
        for channel, offset in ((3, 40.0), (17, -25.0), (40, 30.0)):
            x[:, :, channel] += offset
    return x


def auto_cache(**kw: object) -> Cache:
    base = dict(layers=2, kv_heads=HEADS, head_dim=DIM, staging="auto", max_tokens=4096)
    base.update(kw)
    return Cache(Config(**base))  # type: ignore[arg-type]


def test_auto_picks_eight_bit_keys_for_outlier_channels_and_six_bit_for_gaussian() -> None:
    cache = auto_cache()
    assert cache.staging_report() == [None, None]  # nothing measured before the first append
    cache.append(0, rows(300, 1), rows(300, 2))
    cache.append(1, rows(300, 3, outliers=True), rows(300, 4))
    gaussian, outlier = cache.staging_report()
    assert gaussian is not None and outlier is not None
    assert (gaussian["k"], gaussian["v"]) == ("tq6_0", "tq6_0"), gaussian["explanation"]
    assert (outlier["k"], outlier["v"]) == ("q8_0", "tq6_0"), outlier["explanation"]
    # Why: 6-bit keys exceed the budget only where the channels carry offsets.
    assert gaussian["k_scores"][0] <= gaussian["budget"] < outlier["k_scores"][0]
    assert outlier["k_scores"][1] <= outlier["budget"]
    assert outlier["candidates"] == ["tq6_0", "q8_0", "f16"]
    assert "keys q8_0" in outlier["explanation"]
    # The ring holds what was picked: 8.5-bit keys cost more than 6.125-bit ones.
    mem = cache.memory()
    fixed = Cache(Config(layers=2, kv_heads=HEADS, head_dim=DIM, max_tokens=4096, staging="tq6_0"))
    assert mem["ring_bytes"] > fixed.memory()["ring_bytes"]


def test_a_tighter_budget_picks_wider_types() -> None:
    cache = auto_cache(layers=1, staging_budget=0.01)
    cache.append(0, rows(200, 5), rows(200, 6))
    (report,) = cache.staging_report()
    assert report is not None and (report["k"], report["v"]) == ("q8_0", "q8_0")


def test_keys_and_values_in_different_types_attend_within_their_staging_error() -> None:
    k, v = rows(600, 7), rows(600, 8)
    q = np.random.default_rng(9).standard_normal((1, HEADS, DIM)).astype(np.float32)

    def out(staging: str) -> np.ndarray:
        cache = Cache(Config(layers=1, kv_heads=HEADS, head_dim=DIM, staging=staging))
        cache.append(0, k, v)
        return np.asarray(cache.attend(0, q))

    exact, mixed, six = out("f16"), out("q8_0/tq6_0"), out("tq6_0")
    err = lambda x: float(np.linalg.norm(x - exact) / np.linalg.norm(exact))  # noqa: E731
    assert err(mixed) < err(six)  # 8-bit keys are closer than 6-bit ones
    assert err(mixed) < 0.05
    cache = Cache(Config(layers=1, kv_heads=HEADS, head_dim=DIM, staging="q8_0/tq6_0"))
    assert cache.config.staging == "q8_0/tq6_0" and not cache.reference_format


def test_auto_layers_save_and_load_with_their_picks(tmp_path: Path) -> None:
    cache = auto_cache(min_tail=256, max_tail=512)
    cache.append(0, rows(900, 10, outliers=True), rows(900, 11))
    cache.append(1, rows(900, 12), rows(900, 13))
    cache.save(tmp_path / "auto.sjkv")
    loaded = Cache.load(tmp_path / "auto.sjkv")
    assert loaded.config.staging == "auto"
    picks = [(r["k"], r["v"], r["restored"]) for r in loaded.staging_report()]
    assert picks == [("q8_0", "tq6_0", True), ("tq6_0", "tq6_0", True)]
    q = np.random.default_rng(14).standard_normal((3, HEADS, DIM)).astype(np.float32)
    for layer in range(2):
        np.testing.assert_array_equal(cache.attend(layer, q), loaded.attend(layer, q))
    # A layer nothing was appended to stays undecided through a save.
    empty = auto_cache()
    empty.append(0, rows(64, 15), rows(64, 16))
    empty.save(tmp_path / "half.sjkv")
    again = Cache.load(tmp_path / "half.sjkv")
    assert again.staging_report()[1] is None
    again.append(1, rows(64, 17, outliers=True), rows(64, 18))
    assert again.staging_report()[1]["k"] == "q8_0"


def test_a_refused_first_append_leaves_the_layer_undecided() -> None:
    cache = auto_cache(layers=1)
    bad = rows(100, 19)
    bad[50, 0, 7] = np.nan
    with pytest.raises(InvalidInputError):
        cache.append(0, bad, rows(100, 20))
    assert cache.staging_report() == [None] and cache.length() == 0
    assert cache.memory()["ring_bytes"] == 0
    cache.append(0, rows(100, 21), rows(100, 22))
    assert cache.staging_report()[0]["k"] == "tq6_0"


def test_a_short_first_append_takes_the_safe_choice_and_says_so() -> None:
    cache = auto_cache(layers=1)
    cache.append(0, rows(1, 23), rows(1, 24))  # decoding from an empty cache
    (report,) = cache.staging_report()
    assert (report["k"], report["v"]) == ("q8_0", "q8_0")
    assert "only 0 positions" in report["explanation"]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(staging="q8_0", staging_budget=0.1), "only applies to staging 'auto'"),
        (dict(staging="auto", staging_budget=1.5), "budget must be in (0, 1)"),
        (dict(staging="q8_0/q3"), "staging must be"),
        (dict(staging="auto", sink_type="inherit"), "inherited sink"),
    ],
)
def test_bad_staging_settings_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Cache(Config(layers=1, kv_heads=HEADS, head_dim=DIM, **kw))  # type: ignore[arg-type]
