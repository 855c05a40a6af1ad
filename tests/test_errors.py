"""One error vocabulary: every row of the table in docs/errors.md, on every entry point and (where
a GPU is present) on both backends, raises the class the table names, and leaves the cache as
it was."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import small_config

import sjkvarn
from sjkvarn import (
    Cache,
    CorruptDataError,
    CudaUnavailableError,
    InvalidInputError,
    LayerIndexError,
    MissingFileError,
    PoolExhaustedError,
    SjkvarnError,
    UnsupportedTypeError,
    codec,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
CUDA = sjkvarn.cuda_available()


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 2, 64)).astype(np.float32)


def tensor(x: np.ndarray, device: str) -> object:
    if device == "cpu":
        return x
    torch = pytest.importorskip("torch")
    return torch.from_numpy(x).to(device)


def filled(device: str, n: int = 300, **kw: object) -> Cache:
    cache = Cache(small_config(device=device, **kw))
    for layer in range(cache.config.layers):
        for start in range(0, n, 100):
            k, v = rows(100, start + layer), rows(100, start + layer + 1)
            cache.append(layer, tensor(k, device), tensor(v, device))
    return cache


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not CUDA, reason=f"no CUDA device here: {CUDA.reason}"),
    ),
]


def nan_rows() -> np.ndarray:
    x = rows(4)
    x[2, 1, 7] = np.nan
    return x


# (table row id, entry point, call taking the device, expected class). Every row id in the table
# of docs/errors.md must appear here at least once, and every id here must be in the table.
CASES: list[tuple[str, str, Callable[[str], object], type[BaseException]]] = [
    ("non-finite", "codec.encode", lambda d: codec.encode("q8_0", nan_rows()), InvalidInputError),
    (
        "non-finite",
        "codec.encode_body",
        lambda d: codec.encode_body(
            np.full((128, 64), np.inf, np.float32), np.zeros((128, 64), np.float32)
        ),
        InvalidInputError,
    ),
    (
        "non-finite",
        "Cache.append",
        lambda d: filled(d).append(0, tensor(nan_rows(), d), tensor(rows(4), d)),
        InvalidInputError,
    ),
    (
        "non-finite",
        "Cache.attend",
        lambda d: filled(d).attend(0, tensor(np.full((1, 4, 64), np.nan, np.float32), d)),
        InvalidInputError,
    ),
    (
        "shape",
        "codec.encode",
        lambda d: codec.encode("q8_0", np.zeros((2, 48), np.float32)),
        InvalidInputError,
    ),
    (
        "shape",
        "codec.decode",
        lambda d: codec.decode("q8_0", b"\0" * 33, (1, 64)),
        InvalidInputError,
    ),
    (
        "shape",
        "codec.encode_body",
        lambda d: codec.encode_body(np.zeros((64, 64), np.float32), np.zeros((64, 64), np.float32)),
        InvalidInputError,
    ),
    (
        "shape",
        "Cache.append",
        lambda d: filled(d).append(0, tensor(rows(4)[:, :1], d), tensor(rows(4)[:, :1], d)),
        InvalidInputError,
    ),
    (
        "shape",
        "Cache.attend",
        lambda d: filled(d).attend(0, tensor(np.zeros((1, 3, 64), np.float32), d)),
        InvalidInputError,
    ),
    (
        "unknown-name",
        "codec.encode",
        lambda d: codec.encode("lattice", np.zeros((1, 64), np.float32)),
        InvalidInputError,
    ),
    (
        "unknown-name",
        "Config(body=)",
        lambda d: Cache(small_config(device=d, body="lattice")),
        InvalidInputError,
    ),
    (
        "unknown-name",
        "Config(mode=)",
        lambda d: Cache(small_config(device=d, mode="median")),
        InvalidInputError,
    ),
    (
        "unknown-name",
        "Config(stat=)",
        lambda d: Cache(small_config(device=d, stat="mad")),
        InvalidInputError,
    ),
    (
        "unknown-name",
        "Config(staging=)",
        lambda d: Cache(small_config(device=d, staging="q3")),
        InvalidInputError,
    ),
    (
        "unknown-name",
        "Config(device=)",
        lambda d: Cache(small_config(device="tpu")),
        InvalidInputError,
    ),
    (
        "setting",
        "codec.encode_body",
        lambda d: codec.encode_body(
            np.zeros((128, 64), np.float32), np.zeros((128, 64), np.float32), k_bits=7
        ),
        InvalidInputError,
    ),
    (
        "setting",
        "Config(k_bits=)",
        lambda d: Cache(small_config(device=d, k_bits=1)),
        InvalidInputError,
    ),
    (
        "setting",
        "Config(head_dim=)",
        lambda d: Cache(small_config(device=d, head_dim=96)),
        InvalidInputError,
    ),
    (
        "setting",
        "Config(layers=)",
        lambda d: Cache(small_config(device=d, layers=0)),
        InvalidInputError,
    ),
    ("type", "codec.encode", lambda d: codec.encode("q8_0", [[1.0] * 32]), UnsupportedTypeError),
    (
        "type",
        "codec.encode",
        lambda d: codec.encode("q8_0", np.zeros((1, 32), np.int32)),
        UnsupportedTypeError,
    ),
    ("type", "codec.decode", lambda d: codec.decode("q8_0", "text", (1, 32)), UnsupportedTypeError),
    ("type", "Cache.append", lambda d: filled(d).append(0, "k", "v"), UnsupportedTypeError),
    (
        "layer",
        "Cache.append",
        lambda d: filled(d).append(2, tensor(rows(1), d), tensor(rows(1), d)),
        LayerIndexError,
    ),
    (
        "layer",
        "Cache.append",
        lambda d: filled(d).append(-1, tensor(rows(1), d), tensor(rows(1), d)),
        LayerIndexError,
    ),
    (
        "layer",
        "Cache.attend",
        lambda d: filled(d).attend(5, tensor(np.zeros((1, 4, 64), np.float32), d)),
        LayerIndexError,
    ),
    ("layer", "Cache.length", lambda d: filled(d).length(2), LayerIndexError),
    ("position", "Cache.truncate", lambda d: filled(d).truncate(-1), InvalidInputError),
    ("position", "Cache.seal_idle", lambda d: filled(d).seal_idle(-5), InvalidInputError),
    (
        "position",
        "Cache.attend",
        lambda d: filled(d, 100).attend(0, tensor(np.zeros((101, 4, 64), np.float32), d)),
        InvalidInputError,
    ),
    (
        "position",
        "Cache.append",
        lambda d: filled(d, 1000).append(0, tensor(rows(25), d), tensor(rows(25), d)),
        InvalidInputError,
    ),
    (
        "corrupt",
        "Cache.from_snapshot",
        lambda d: Cache.load(_damaged_snapshot(d)),
        CorruptDataError,
    ),
    (
        "corrupt",
        "Cache.from_state",
        lambda d: Cache.from_state(small_config(), filled(d).state()[:-9]),
        CorruptDataError,
    ),
    (
        "corrupt",
        "Cache.from_state",
        lambda d: Cache.from_state(small_config(k_bits=3), filled(d).state()),
        CorruptDataError,
    ),
    ("pool", "Cache.append", lambda d: _exhaust_pool(d), PoolExhaustedError),
    ("file", "Cache.load", lambda d: Cache.load("/nonexistent/seq.sjkv"), MissingFileError),
    ("file", "Cache.save", lambda d: filled(d).save("/nonexistent/seq.sjkv"), MissingFileError),
    ("non-integer", "Cache.truncate", lambda d: filled(d).truncate(2.9), UnsupportedTypeError),
    (
        "non-integer",
        "Cache.append",
        lambda d: filled(d).append("0", tensor(rows(1), d), tensor(rows(1), d)),
        UnsupportedTypeError,
    ),
    (
        "non-integer",
        "Config(k_bits=)",
        lambda d: Cache(small_config(k_bits=2.5)),
        UnsupportedTypeError,
    ),
    (
        "non-integer",
        "Cache.from_state",
        lambda d: Cache.from_state(small_config(), "state"),
        UnsupportedTypeError,
    ),
    (
        "non-boolean",
        "Config(centre_keys=)",
        lambda d: Cache(small_config(centre_keys="yes")),
        UnsupportedTypeError,
    ),
    ("range", "Cache.truncate", lambda d: filled(d).truncate(10**20), InvalidInputError),
    ("range", "Config(q_heads=)", lambda d: Cache(small_config(q_heads=0)), InvalidInputError),
    ("range", "Config(passes=)", lambda d: Cache(small_config(passes=-1)), InvalidInputError),
    (
        "overflow",
        "Cache.attend",
        lambda d: filled(d).attend(0, tensor(np.full((1, 4, 64), 3e37, np.float32), d)),
        InvalidInputError,
    ),
    (
        "cuda-unavailable",
        "Cache(device='cuda')",
        lambda d: Cache(small_config(device="cuda")),
        CudaUnavailableError,
    ),
]


def _damaged_snapshot(device: str) -> str:
    import tempfile

    data = bytearray(filled(device).snapshot())
    data[len(data) // 2] ^= 0x40
    path = Path(tempfile.mkdtemp()) / "damaged.sjkv"
    path.write_bytes(bytes(data))
    return str(path)


def _exhaust_pool(device: str) -> None:
    # A pool sized for one sequence, shared by eight that each fill up to max_tokens.
    root = Cache(small_config(device=device, layers=1, max_tokens=512))
    children = [root.fork() for _ in range(7)]
    for c in [root, *children]:
        for start in range(0, 512, 64):
            c.append(0, tensor(rows(64, start), device), tensor(rows(64, start + 7), device))


def doc_table() -> dict[str, str]:
    """Row id -> exception class name, from the table in docs/errors.md."""
    found = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*`([a-z-]+)`\s*\|.*\|\s*`(\w+)`\s*\|\s*$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def test_the_table_and_the_cases_agree() -> None:
    table = doc_table()
    assert table, "no table rows found in docs/errors.md"
    tested = {row: cls.__name__ for row, _, _, cls in CASES}
    assert set(tested) == set(table)
    for row, name in tested.items():
        assert table[row] == name, (row, name, table[row])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row,entry,call,expected", CASES, ids=[f"{r}-{e}" for r, e, _, _ in CASES])
def test_each_kind_raises_its_class(
    row: str,
    entry: str,
    call: Callable[[str], object],
    expected: type[BaseException],
    device: str,
) -> None:
    if row == "cuda-unavailable" and (device != "cpu" or CUDA):
        pytest.skip("this machine has CUDA: the unavailable path cannot be reached")
    with pytest.raises(expected) as info:
        call(device)
    assert type(info.value) is expected, f"{type(info.value).__name__} is not {expected.__name__}"
    assert isinstance(info.value, SjkvarnError)
    assert str(info.value), "every error says what went wrong"


def test_builtin_bases_for_callers_that_catch_them() -> None:
    assert issubclass(InvalidInputError, ValueError)
    assert issubclass(UnsupportedTypeError, TypeError)
    assert issubclass(UnsupportedTypeError, InvalidInputError)
    assert issubclass(LayerIndexError, IndexError)
    assert issubclass(CorruptDataError, ValueError)
    assert issubclass(PoolExhaustedError, RuntimeError)
    assert issubclass(CudaUnavailableError, RuntimeError)
    assert issubclass(MissingFileError, FileNotFoundError)
    assert issubclass(sjkvarn.StorageError, OSError)
    assert sjkvarn.CodecError is InvalidInputError and sjkvarn.CacheError is InvalidInputError
    assert sjkvarn.SnapshotError is CorruptDataError
    assert InvalidInputError.__module__ == "sjkvarn"


@pytest.mark.parametrize("device", DEVICES)
def test_a_refused_call_leaves_the_cache_as_it_was(device: str) -> None:
    cache = filled(device)
    before = cache.snapshot()
    q = tensor(rows(1)[:, :1].repeat(4, axis=1), device)
    out_before = cache.attend(0, q)
    for bad in (
        lambda: cache.append(0, tensor(nan_rows(), device), tensor(rows(4), device)),
        lambda: cache.append(0, tensor(rows(4), device), tensor(rows(5), device)),
        lambda: cache.append(3, tensor(rows(4), device), tensor(rows(4), device)),
        lambda: cache.truncate(-1),
    ):
        with pytest.raises(SjkvarnError):
            bad()
    assert cache.snapshot() == before
    out_after = cache.attend(0, q)
    assert np.array_equal(np.asarray(_host(out_before)), np.asarray(_host(out_after)))


def _host(x: object) -> object:
    return x.cpu().numpy() if hasattr(x, "cpu") else x  # type: ignore[attr-defined]


def test_truncate_past_the_end_returns_the_length() -> None:
    cache = filled("cpu", 300)
    assert cache.truncate(10**6) == 300
    assert cache.length(0) == 300
