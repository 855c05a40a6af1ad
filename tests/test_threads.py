"""Caches shared by Python threads: calls on one cache are serialised (no "Already borrowed"),
forks on one record pool run side by side, and every result equals a serial run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sjkvarn import Cache, Config

THREADS = 4


def config() -> Config:
    # Small tails so records seal (the shared pool is really used), 3/2 trellis body.
    return Config(
        layers=4,
        kv_heads=2,
        q_heads=4,
        head_dim=128,
        k_bits=3,
        v_bits=2,
        body="trellis",
        min_tail=128,
        max_tail=256,
        max_chunk=128,
        max_tokens=2048,
        pool_sequences=THREADS + 1,
    )


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 2, 128)).astype(np.float32)


def queries(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 10_000).standard_normal((n, 4, 128)).astype(np.float32)


def script(cache: Cache, worker: int) -> list[np.ndarray]:
    """One request's life on its own fork: prefill, decode steps, a rollback and a re-append."""
    out = []
    for layer in range(4):
        for start in range(0, 640, 128):
            seed = worker * 1000 + layer * 100 + start
            cache.append(layer, rows(128, seed), rows(128, seed + 1))
    for step in range(6):
        for layer in range(4):
            seed = worker * 1000 + layer * 100 + 50 + step
            cache.append(layer, rows(1, seed), rows(1, seed + 2))
            out.append(cache.attend(layer, queries(1, seed)))
    back = cache.truncate(cache.length(0) - 200)
    for layer in range(4):
        n = cache.length(layer)
        assert n == back
        cache.append(layer, rows(3, worker + layer), rows(3, worker + layer + 5))
        out.append(cache.attend(layer, queries(2, worker + layer)))
    out.append(np.array([cache.memory()["tokens"], cache.memory()["sealed_tokens"]], np.float64))
    return out


def with_prefix() -> Cache:
    root = Cache(config())
    for layer in range(4):
        root.append(layer, rows(128, layer), rows(128, layer + 50))
        root.append(layer, rows(100, layer + 1), rows(100, layer + 51))
    return root


def run_forks(parallel: bool) -> list[list[np.ndarray]]:
    root = with_prefix()
    forks = [root.fork() for _ in range(THREADS)]
    if not parallel:
        return [script(f, i) for i, f in enumerate(forks)]
    start = threading.Barrier(THREADS)

    def job(i: int) -> list[np.ndarray]:
        start.wait()
        return script(forks[i], i)

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(job, range(THREADS)))


def test_forks_on_one_pool_in_threads_equal_a_serial_run() -> None:
    serial = run_forks(parallel=False)
    threaded = run_forks(parallel=True)
    for a, b in zip(serial, threaded, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_one_cache_shared_by_threads_serialises_its_calls() -> None:
    """Four threads hammer one cache: appends to their own layer, attention, memory and length
    reads, forks. Nothing fails and every layer ends as a serial run leaves it."""

    def fill(cache: Cache, layer: int, spawn: Callable[[], None]) -> list[np.ndarray]:
        got = []
        for step in range(10):
            cache.append(layer, rows(64, layer * 100 + step), rows(64, layer * 100 + step + 1))
            got.append(cache.attend(layer, queries(2, layer * 100 + step)))
            cache.memory()
            cache.length(layer)
            spawn()
        return got

    serial_cache = Cache(config())
    serial = [fill(serial_cache, layer, lambda: None) for layer in range(4)]

    shared = Cache(config())
    forks: list[Cache] = []
    errors: list[BaseException] = []
    gate = threading.Barrier(4)

    def job(layer: int) -> list[np.ndarray]:
        gate.wait()
        try:
            return fill(shared, layer, lambda: forks.append(shared.fork()))
        except BaseException as e:  # noqa: BLE001 - collected and re-raised below
            errors.append(e)
            raise

    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(job, range(4)))
    assert not errors
    for a, b in zip(serial, threaded, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    assert shared.snapshot() == serial_cache.snapshot()
    assert len(forks) == 40
    for f in forks[:3]:
        f.truncate(0)  # forks stay independent of the shared parent
    assert shared.length(0) == 640


def test_attend_thread_limit_gives_the_same_result_and_checks_its_value() -> None:
    cache = Cache(config())
    for start in range(0, 1024, 128):
        cache.append(0, rows(128, start), rows(128, start + 1))
    for n in (1, 5):
        q = queries(n, 7)
        want = cache.attend(0, q)
        for threads in (1, 2, 64):
            np.testing.assert_array_equal(cache.attend(0, q, threads=threads), want)
    length = cache.length(0)
    for bad, kind in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(kind, match="threads"):
            cache.attend(0, queries(1, 7), threads=bad)  # type: ignore[arg-type]
    assert cache.length(0) == length
