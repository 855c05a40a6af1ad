"""Property tests of the public Python API (hypothesis): random shapes, dtypes, strides, devices,
NaN/Inf, layers and positions. Every call either works or raises one of the documented
exceptions, and a call that raises leaves the cache byte-identical; afterwards the cache still
answers exactly like a twin that only ever saw the calls that worked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sjkvarn
from sjkvarn import Cache, CacheError, Config

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DOCUMENTED = (CacheError, sjkvarn.CodecError, IndexError, TypeError, ValueError, MemoryError)
KV, Q, D = 2, 4, 64


def _config() -> Config:
    return Config(
        layers=2,
        kv_heads=KV,
        q_heads=Q,
        head_dim=D,
        k_bits=3,
        v_bits=2,
        min_tail=128,
        max_tail=256,
        max_chunk=64,
        max_tokens=1024,
    )


@st.composite
def tensors(draw: st.DrawFn, heads: int) -> object:
    """Mostly well-formed [n, heads, D] inputs, sometimes wrong in one way."""
    n = draw(st.integers(0, 90))
    shape = [n, heads, D]
    flaw = draw(
        st.sampled_from(
            ["none"] * 6
            + ["shape", "dtype", "nan", "inf", "huge", "strides", "numpy", "list", "int", "rank"]
        )
    )
    if flaw == "shape":
        i = draw(st.integers(1, 2))
        shape[i] = draw(st.integers(1, 130).filter(lambda x: x != shape[i]))
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if flaw == "dtype":
        x = x.to(
            draw(
                st.sampled_from(
                    [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.complex64]
                )
            )
        )
    if flaw in ("nan", "inf", "huge") and x.numel():
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = {
            "nan": float("nan"),
            "inf": float("inf"),
            "huge": 1e30,
        }[flaw]
    if flaw == "strides":
        x = torch.randn(shape[2], shape[1], shape[0]).permute(2, 1, 0)
    if flaw == "numpy":
        return x.numpy()
    if flaw == "list":
        return x.tolist()
    if flaw == "int":
        return 7
    if flaw == "rank":
        return x.reshape(-1)
    return x


operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(-1, 3), tensors(KV), tensors(KV)),
        st.tuples(st.just("attend"), st.integers(-1, 3), tensors(Q), st.none()),
        st.tuples(st.just("truncate"), st.integers(-5, 1200), st.none(), st.none()),
        st.tuples(st.just("seal_idle"), st.none(), st.none(), st.none()),
        st.tuples(st.just("fork"), st.none(), st.none(), st.none()),
    ),
    min_size=1,
    max_size=12,
)


def _apply(cache: Cache, op: tuple) -> object:
    name, a, x, y = op
    if name == "append":
        return cache.append(a, x, y)
    if name == "attend":
        return cache.attend(a, x)
    if name == "truncate":
        return cache.truncate(a)
    if name == "seal_idle":
        return cache.seal_idle()
    return cache.fork()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations)
def test_every_call_works_or_raises_a_documented_error(ops: list) -> None:
    cache, twin = Cache(_config()), Cache(_config())
    for op in ops:
        before = cache.snapshot()
        try:
            result = _apply(cache, op)
        except DOCUMENTED:
            assert cache.snapshot() == before, f"{op[0]} raised but changed the cache"
            continue
        # It worked: the twin gets the same call and must agree.
        twin_result = _apply(twin, op)
        if op[0] == "attend":
            assert torch.equal(torch.as_tensor(result), torch.as_tensor(twin_result))
        assert cache.snapshot() == twin.snapshot()
    # Still answers correctly afterwards: same attention as the twin, finite.
    if cache.length(0) > 0:
        q = torch.randn(1, Q, D)
        a, b = cache.attend(0, q), twin.attend(0, q)
        assert torch.isfinite(a).all() and torch.equal(a, b)


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(-2, 5000),
    kv=st.integers(-1, 9),
    q_mult=st.integers(0, 3),
    head_dim=st.sampled_from([0, 32, 64, 96, 128, 512, 1024]),
    k_bits=st.integers(0, 9),
    body=st.sampled_from(["scalar", "trellis", "trellis-channel", "lattice"]),
    tails=st.tuples(st.integers(-1, 10**7), st.integers(-1, 10**7)),
    staging=st.sampled_from(["tq6_0", "q8_0", "f16", "q4_0"]),
    device=st.sampled_from(["cpu", "cpu", "tpu", "cuda:x"]),
)
def test_configurations_are_accepted_or_refused_cleanly(
    layers: int,
    kv: int,
    q_mult: int,
    head_dim: int,
    k_bits: int,
    body: str,
    tails: tuple[int, int],
    staging: str,
    device: str,
) -> None:
    try:
        cache = Cache(
            Config(
                layers=layers,
                kv_heads=kv,
                q_heads=kv * q_mult,
                head_dim=head_dim,
                k_bits=k_bits,
                body=body,
                min_tail=tails[0],
                max_tail=tails[1],
                staging=staging,
                device=device,
                max_tokens=4096,
            )
        )
    except sjkvarn.SjkvarnError:
        return
    x = torch.randn(3, kv, head_dim)
    cache.append(0, x, x)
    assert cache.length(0) == 3


@settings(max_examples=30, deadline=None)
@given(data=st.binary(min_size=0, max_size=400), flips=st.lists(st.integers(0, 10**6), max_size=5))
def test_snapshot_bytes_are_refused_or_round_trip(data: bytes, flips: list[int]) -> None:
    base = Cache(_config())
    base.append(0, torch.randn(300, KV, D), torch.randn(300, KV, D))
    blob = bytearray(base.snapshot())
    for f in flips:
        blob[f % len(blob)] ^= 1 << (f % 8)
    for candidate in (bytes(blob), data, bytes(blob[: len(data)])):
        try:
            restored = Cache(_config(), _core_cache=sjkvarn._core.Cache.from_snapshot(candidate))
        except sjkvarn.SnapshotError:
            continue
        assert restored.snapshot() == candidate
        assert np.isfinite(restored.attend(0, np.ones((1, Q, D), np.float32))).all()
