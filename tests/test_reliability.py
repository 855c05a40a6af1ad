"""Files and arguments: concurrent saves never lose or mix data, attention never returns a
silent NaN, non-integers are refused rather than coerced, trailing bytes are refused, and every
refusal of user input is an ``SjkvarnError`` subclass that also subclasses the matching builtin
and names the argument at fault."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import small_config

import sjkvarn
from sjkvarn import (
    Cache,
    Config,
    CorruptDataError,
    InvalidInputError,
    LayerIndexError,
    MissingFileError,
    SjkvarnError,
    StorageError,
    UnsupportedTypeError,
)

TEMP_SUFFIX = ".sjkvarn-tmp"


def config(**kw: object) -> Config:
    return small_config(**{"max_tokens": 2048, **kw})


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 2, 64)).astype(np.float32)


def filled(tokens: int, seed: int = 0) -> Cache:
    cache = Cache(config())
    for layer in range(2):
        for start in range(0, tokens, 128):
            n = min(128, tokens - start)
            cache.append(layer, rows(n, seed + start + layer), rows(n, seed + start + layer + 9))
    return cache


def temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(TEMP_SUFFIX)]


def test_concurrent_saves_of_paths_sharing_a_stem_each_hold_their_own_cache(
    tmp_path: Path,
) -> None:
    # The failure this guards against: temporaries named from the path's stem, shared by
    # `s.a` and `s.b`, so one save renamed the other's bytes into place and reported success.
    caches = [filled(300 + 100 * i, seed=10 * i) for i in range(4)]
    want = [c.snapshot() for c in caches]
    errors: list[BaseException] = []
    for trial in range(20):
        folder = tmp_path / f"trial{trial}"
        folder.mkdir()
        barrier = threading.Barrier(len(caches))

        def save(i: int, folder: Path = folder, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                caches[i].save(folder / f"s.{'abcd'[i]}")
            except BaseException as e:  # noqa: BLE001 - collected and reported below
                errors.append(e)

        threads = [threading.Thread(target=save, args=(i,)) for i in range(len(caches))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for i in range(len(caches)):
            path = folder / f"s.{'abcd'[i]}"
            assert path.read_bytes() == want[i], f"trial {trial}: {path.name} holds another cache"
            assert Cache.load(path).snapshot() == want[i]
        assert temporaries(folder) == []


def test_concurrent_saves_of_one_path_all_succeed_and_leave_one_whole_snapshot(
    tmp_path: Path,
) -> None:
    caches = [filled(200 + 150 * i, seed=i) for i in range(3)]
    want = [c.snapshot() for c in caches]
    path = tmp_path / "one.sjkv"
    errors: list[BaseException] = []

    def save(i: int) -> None:
        try:
            for _ in range(10):
                caches[i].save(path)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert path.read_bytes() in want
    assert temporaries(tmp_path) == []


def test_a_save_removes_temporaries_of_dead_processes_only(tmp_path: Path) -> None:
    path = tmp_path / "seq.sjkv"
    # pid 0 is never a user process; our own pid is alive.
    dead = tmp_path / f".seq.sjkv.0-3-4{TEMP_SUFFIX}"
    alive = tmp_path / f".seq.sjkv.{os.getpid()}-99-1{TEMP_SUFFIX}"
    dead.write_bytes(b"x" * 1000)
    alive.write_bytes(b"y")
    filled(200).save(path)
    assert alive.exists()
    if os.path.isdir("/proc/self"):
        assert not dead.exists(), "an orphaned temporary of a dead process was kept"


def test_save_errors_are_library_errors_and_change_nothing(tmp_path: Path) -> None:
    cache = filled(200)
    with pytest.raises(MissingFileError) as info:
        cache.save(tmp_path / "no-such-folder" / "x.sjkv")
    assert isinstance(info.value, FileNotFoundError) and info.value.errno == 2
    assert info.value.filename.endswith("x.sjkv")
    with pytest.raises(StorageError):
        cache.save(tmp_path / "..")
    with pytest.raises(MissingFileError):
        Cache.load(tmp_path / "absent.sjkv")
    assert list(tmp_path.iterdir()) == []


def test_huge_queries_raise_instead_of_returning_nan() -> None:
    cache = filled(400)
    q = np.random.default_rng(5).standard_normal((1, 4, 64)).astype(np.float32)
    assert np.isfinite(cache.attend(0, q * 1e30)).all()
    with pytest.raises(InvalidInputError, match="overflow"):
        cache.attend(0, q * 3e37)
    with pytest.raises(InvalidInputError, match="overflow"):
        cache.attend(0, q, scale=1e38)
    with pytest.raises(InvalidInputError, match="scale"):
        cache.attend(0, q, scale=float("nan"))


def test_big_endian_arrays_are_read_as_their_values() -> None:
    a, b = filled(200), filled(200)
    k, v = rows(3, 1), rows(3, 2)
    a.append(0, k, v)
    b.append(0, k.astype(">f4"), v.astype(">f4"))
    assert a.snapshot() == b.snapshot()
    q = np.random.default_rng(1).standard_normal((1, 4, 64))
    assert np.array_equal(a.attend(0, q.astype(np.float32)), b.attend(0, q.astype(">f4")))


def test_trailing_bytes_are_refused_by_from_state_and_load(tmp_path: Path) -> None:
    cache = filled(300)
    with pytest.raises(CorruptDataError, match="after the end"):
        Cache.from_state(config(), cache.state() + b"\x01")
    path = tmp_path / "seq.sjkv"
    path.write_bytes(cache.snapshot() + b"\x01")
    with pytest.raises(CorruptDataError):
        Cache.load(path)
    assert Cache.from_state(config(), cache.state()).state() == cache.state()


def test_zero_heads_are_refused_alike() -> None:
    for name in ("q_heads", "kv_heads"):
        with pytest.raises(InvalidInputError, match=name):
            Cache(config(**{name: 0}))
    # An unset q_heads takes kv_heads: the error still names the field that was set.
    with pytest.raises(InvalidInputError, match="kv_heads must be"):
        Config(layers=2, kv_heads=0, head_dim=64)
    assert Cache(config(q_heads=None)).config.q_heads == 2


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("passes", -1, InvalidInputError),
        ("min_tail", -5, InvalidInputError),
        ("flush_chunk", -1, InvalidInputError),
        ("k_bits", 2.5, UnsupportedTypeError),
        ("staging", "q4", InvalidInputError),
        ("device", "tpu", InvalidInputError),
    ],
)
def test_a_bad_setting_is_refused_where_the_config_is_written(
    field: str, value: object, expected: type[SjkvarnError]
) -> None:
    with pytest.raises(expected, match=field):
        Config(layers=2, kv_heads=2, head_dim=64, **{field: value})
    # A field reassigned after construction is still checked by the cache.
    cfg = Config(layers=2, kv_heads=2, head_dim=64)
    setattr(cfg, field, value)
    with pytest.raises(expected, match=field):
        Cache(cfg)


def _c() -> Cache:
    return filled(300)


def _q() -> np.ndarray:
    return np.zeros((1, 4, 64), np.float32)


BIG = 10**20

# (call, expected class, builtin it must also be, word the message must contain)
REFUSALS: list[tuple[str, Callable[[], object], type[SjkvarnError], type[Exception], str]] = [
    ("truncate(2.9)", lambda: _c().truncate(2.9), UnsupportedTypeError, TypeError, "n"),
    (
        "append(1.7)",
        lambda: _c().append(1.7, rows(1), rows(1)),
        UnsupportedTypeError,
        TypeError,
        "layer",
    ),
    (
        'append("0")',
        lambda: _c().append("0", rows(1), rows(1)),
        UnsupportedTypeError,
        TypeError,
        "layer",
    ),
    (
        "append(None)",
        lambda: _c().append(None, rows(1), rows(1)),
        UnsupportedTypeError,
        TypeError,
        "layer",
    ),
    (
        "append(True)",
        lambda: _c().append(True, rows(1), rows(1)),
        UnsupportedTypeError,
        TypeError,
        "layer",
    ),
    ("attend(0.0)", lambda: _c().attend(0.0, _q()), UnsupportedTypeError, TypeError, "layer"),
    ("length(1.0)", lambda: _c().length(1.0), UnsupportedTypeError, TypeError, "layer"),
    ("truncate(10**20)", lambda: _c().truncate(BIG), InvalidInputError, ValueError, "n"),
    (
        "seal_idle(10**20)",
        lambda: _c().seal_idle(BIG),
        InvalidInputError,
        ValueError,
        "keep_recent",
    ),
    (
        "append(10**20)",
        lambda: _c().append(BIG, rows(1), rows(1)),
        LayerIndexError,
        IndexError,
        "layer",
    ),
    (
        "Config(passes=-1)",
        lambda: Cache(config(passes=-1)),
        InvalidInputError,
        ValueError,
        "passes",
    ),
    (
        "Config(min_tail=-5)",
        lambda: Cache(config(min_tail=-5)),
        InvalidInputError,
        ValueError,
        "min_tail",
    ),
    (
        "Config(flush_chunk=-1)",
        lambda: Cache(config(flush_chunk=-1)),
        InvalidInputError,
        ValueError,
        "flush_chunk",
    ),
    (
        "Config(max_tokens=10**20)",
        lambda: Cache(config(max_tokens=BIG)),
        InvalidInputError,
        ValueError,
        "max_tokens",
    ),
    (
        "Config(k_bits=2.5)",
        lambda: Cache(config(k_bits=2.5)),
        UnsupportedTypeError,
        TypeError,
        "k_bits",
    ),
    (
        "Config(v_bits='4')",
        lambda: Cache(config(v_bits="4")),
        UnsupportedTypeError,
        TypeError,
        "v_bits",
    ),
    (
        "Config(layers=2.0)",
        lambda: Cache(config(layers=2.0)),
        UnsupportedTypeError,
        TypeError,
        "layers",
    ),
    (
        "Config(staging=8)",
        lambda: Cache(config(staging=8)),
        UnsupportedTypeError,
        TypeError,
        "staging",
    ),
    (
        "Config(staging_budget=nan)",
        lambda: Cache(config(staging="auto", staging_budget=float("nan"))),
        InvalidInputError,
        ValueError,
        "staging_budget",
    ),
    ("Cache(dict)", lambda: Cache({"layers": 1}), UnsupportedTypeError, TypeError, "config"),
    (
        "from_state(str)",
        lambda: Cache.from_state(config(), "abc"),
        UnsupportedTypeError,
        TypeError,
        "data",
    ),
    (
        "threads=True",
        lambda: _c().attend(0, _q(), threads=True),
        UnsupportedTypeError,
        TypeError,
        "threads",
    ),
    (
        "threads=1.0",
        lambda: _c().attend(0, _q(), threads=1.0),
        UnsupportedTypeError,
        TypeError,
        "threads",
    ),
    (
        "threads=0",
        lambda: _c().attend(0, _q(), threads=0),
        InvalidInputError,
        ValueError,
        "threads",
    ),
    (
        "scale='1'",
        lambda: _c().attend(0, _q(), scale="1"),
        UnsupportedTypeError,
        TypeError,
        "scale",
    ),
    (
        "object array",
        lambda: _c().append(0, rows(1).astype(object), rows(1)),
        UnsupportedTypeError,
        TypeError,
        "k",
    ),
    ("save(3.5)", lambda: _c().save(3.5), UnsupportedTypeError, TypeError, "save"),
    (
        "load(pool_sequences=0)",
        lambda: Cache.load("x", pool_sequences=0),
        InvalidInputError,
        ValueError,
        "pool_sequences",
    ),
    ("to(device=1)", lambda: _c().to(1), UnsupportedTypeError, TypeError, "device"),
]


@pytest.mark.parametrize(
    "call,expected,builtin,names", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_every_refusal_is_a_library_error_naming_its_argument(
    call: Callable[[], object],
    expected: type[SjkvarnError],
    builtin: type[Exception],
    names: str,
) -> None:
    with pytest.raises(SjkvarnError) as info:
        call()
    assert type(info.value) is expected, f"{type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, builtin)
    assert names in str(info.value), str(info.value)


def test_a_refused_call_with_a_bad_argument_leaves_the_cache_as_it_was() -> None:
    cache = filled(300)
    before = cache.snapshot()
    for bad in (
        lambda: cache.truncate(2.9),
        lambda: cache.append(1.7, rows(1), rows(1)),
        lambda: cache.seal_idle(BIG),
        lambda: cache.attend(0, _q() + 3e37),
    ):
        with pytest.raises(SjkvarnError):
            bad()
    assert cache.snapshot() == before


def test_numpy_integers_are_integers() -> None:
    cache = filled(300)
    cache.append(np.int64(1), rows(1), rows(1))
    assert cache.length(np.int32(1)) == 301
    assert cache.truncate(np.uint16(200)) <= 200
    assert sjkvarn.Cache(config(layers=np.int64(2))).config.layers == 2
