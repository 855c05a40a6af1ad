"""The Python Cache: exactness against SDPA, dtypes, errors that leave the cache unchanged,
snapshots, forks and truncation."""

from __future__ import annotations

import numpy as np
import pytest

import sjkvarn
from sjkvarn import Cache, CacheError, Config, PoolExhaustedError, SnapshotError

torch = pytest.importorskip("torch")
F = torch.nn.functional


def exact_config(**kw: object) -> Config:
    base = dict(layers=2, kv_heads=2, q_heads=6, head_dim=64, staging="f16", max_tokens=700)
    # Keys as appended: the fp16 regions then hold exactly the rounded rows SDPA is given
    # (centred keys round differently; tests/test_default_journal.py covers them).
    base["centre_keys"] = False
    base.update(kw)
    base.setdefault("max_tail", 4096)  # never seals: sink + fp16 ring only
    base.setdefault("min_tail", 128)
    return Config(**base)  # type: ignore[arg-type]


def sdpa(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Causal SDPA for the newest q rows over all of k/v, GQA by repeating KV heads."""
    n, qh, _ = q.shape
    length, kvh, _ = k.shape
    rep = qh // kvh
    kk = k.permute(1, 0, 2).repeat_interleave(rep, 0).double()
    vv = v.permute(1, 0, 2).repeat_interleave(rep, 0).double()
    qq = q.permute(1, 0, 2).double()
    pos = torch.arange(length - n, length)[:, None]
    mask = torch.arange(length)[None, :] <= pos
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)
    return out.permute(1, 0, 2).float()


def fp16_values(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).half().float()


def stored(x: torch.Tensor) -> torch.Tensor:
    """What an fp16-staged cache holds of ``x``: the rows rotated, rounded to fp16 and (for the
    comparison in the model frame) rotated back."""
    r = torch.from_numpy(sjkvarn.codec.rotate(x.float().numpy()))
    return torch.from_numpy(sjkvarn.codec.rotate(r.half().float().numpy()))


@pytest.mark.parametrize("n_query", [1, 9, 250])
def test_exact_regions_equal_sdpa(n_query: int) -> None:
    gen = torch.Generator().manual_seed(n_query)
    cache = Cache(exact_config())
    k, v = fp16_values(gen, 450, 2, 64), fp16_values(gen, 450, 2, 64)
    cache.append(1, k[:300], v[:300])
    cache.append(1, k[300:], v[300:])
    q = torch.randn(n_query, 6, 64, generator=gen)
    got = cache.attend(1, q)
    want = sdpa(stored(k), stored(v), q)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_tensor_dtypes(dtype: str) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = Cache(exact_config())
    t = getattr(torch, dtype)
    k = fp16_values(gen, 40, 2, 64).to(t)
    v = fp16_values(gen, 40, 2, 64).to(t)
    cache.append(0, k, v)
    q = torch.randn(2, 6, 64, generator=gen).to(t)
    out = cache.attend(0, q)
    assert out.dtype == t and out.shape == q.shape
    want = sdpa(stored(k.float()), stored(v.float()), q.float())
    tol = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    np_out = cache.attend(0, q.float().numpy())
    assert isinstance(np_out, np.ndarray)


def test_compressed_cache_tracks_attention() -> None:
    gen = torch.Generator().manual_seed(2)
    cfg = Config(
        layers=1,
        kv_heads=2,
        q_heads=4,
        head_dim=64,
        k_bits=4,
        v_bits=4,
        min_tail=128,
        max_tail=384,
        max_tokens=1500,
    )
    cache = Cache(cfg)
    k, v = torch.randn(1200, 2, 64, generator=gen), torch.randn(1200, 2, 64, generator=gen)
    cache.append(0, k, v)
    regions = cache.regions(0)
    assert regions["body"][1] > regions["body"][0], regions
    q = torch.randn(1, 4, 64, generator=gen) * 3
    got, want = cache.attend(0, q), sdpa(k, v, q)
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.15, rel
    mem = cache.memory()
    assert mem["sink_tokens"] + mem["sealed_tokens"] + mem["ring_tokens"] == 1200
    assert 4.0 < mem["effective_bits"] < 7.0


def test_bad_input_raises_and_leaves_the_cache_unchanged() -> None:
    gen = torch.Generator().manual_seed(3)
    cache = Cache(exact_config())
    cache.append(0, torch.randn(10, 2, 64, generator=gen), torch.randn(10, 2, 64, generator=gen))
    before = cache.snapshot()
    good = torch.randn(3, 2, 64, generator=gen)
    nan = good.clone()
    nan[1, 1, 1] = float("nan")
    with pytest.raises(sjkvarn.CodecError, match="non-finite"):
        cache.append(0, nan, good)
    with pytest.raises(CacheError, match="expected shape"):
        cache.append(0, torch.randn(3, 3, 64), torch.randn(3, 3, 64))
    with pytest.raises(CacheError, match="differ"):
        cache.append(0, good, good[:2])
    with pytest.raises(CacheError, match="expected shape"):
        cache.append(0, torch.randn(0, 2, 64), torch.randn(0, 2, 64))
    with pytest.raises(IndexError, match="layer 7"):
        cache.append(7, good, good)
    with pytest.raises(TypeError, match="int64"):
        cache.append(0, torch.ones(3, 2, 64, dtype=torch.int64), good)
    with pytest.raises(TypeError, match="__dlpack__"):
        cache.append(0, [[0.0]], good)
    with pytest.raises(CacheError, match="max_tokens"):
        cache.append(0, torch.randn(700, 2, 64), torch.randn(700, 2, 64))
    with pytest.raises(CacheError):
        cache.attend(0, torch.randn(11, 6, 64))  # more queries than tokens
    with pytest.raises(CacheError, match="expected shape"):
        cache.attend(0, torch.randn(1, 2, 64))
    with pytest.raises(CacheError):
        cache.truncate(-1)
    if hasattr(torch, "empty") and torch.device("meta"):
        with pytest.raises((ValueError, BufferError)):
            cache.append(0, torch.empty(3, 2, 64, device="meta"), good)
    assert cache.snapshot() == before
    with pytest.raises(CacheError, match="multiple"):
        Cache(Config(layers=1, kv_heads=2, q_heads=3, head_dim=64))
    with pytest.raises(CacheError, match="head_dim"):
        Cache(Config(layers=1, kv_heads=2, head_dim=96))
    with pytest.raises(CacheError, match="exceeds the supported maximum"):
        Cache(Config(layers=1, kv_heads=2, head_dim=64, max_tokens=10**12))
    with pytest.raises(CacheError, match="device must be"):
        Cache(Config(layers=1, kv_heads=2, head_dim=64, device="tpu"))
    with pytest.raises(sjkvarn.CodecError, match="body must be"):
        Cache(Config(layers=1, kv_heads=2, head_dim=64, body="lattice"))


def test_snapshot_round_trip_and_damage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(4)
    cfg = Config(
        layers=2,
        kv_heads=2,
        q_heads=4,
        head_dim=64,
        k_bits=3,
        v_bits=2,
        body="trellis",
        min_tail=128,
        max_tail=384,
        max_tokens=1200,
    )
    cache = Cache(cfg)
    for layer in range(2):
        cache.append(
            layer, torch.randn(900, 2, 64, generator=gen), torch.randn(900, 2, 64, generator=gen)
        )
    path = tmp_path / "seq.sjkv"
    cache.save(path)
    loaded = Cache.load(path)
    assert loaded.snapshot() == cache.snapshot() == path.read_bytes()
    q = torch.randn(2, 4, 64, generator=gen)
    assert torch.equal(loaded.attend(1, q), cache.attend(1, q))
    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 1
    (tmp_path / "bad.sjkv").write_bytes(bytes(flipped))
    with pytest.raises(SnapshotError, match="checksum"):
        Cache.load(tmp_path / "bad.sjkv")
    (tmp_path / "cut.sjkv").write_bytes(data[: len(data) - 100])
    with pytest.raises(SnapshotError):
        Cache.load(tmp_path / "cut.sjkv")
    with pytest.raises(OSError):
        Cache.load(tmp_path / "missing.sjkv")


def test_fork_truncate_and_pool_exhaustion() -> None:
    gen = torch.Generator().manual_seed(5)
    cfg = Config(
        layers=1, kv_heads=2, q_heads=2, head_dim=64, min_tail=128, max_tail=384, max_tokens=1200
    )
    parent = Cache(cfg)
    parent.append(0, torch.randn(700, 2, 64, generator=gen), torch.randn(700, 2, 64, generator=gen))
    child = parent.fork()
    used = parent.memory()["pool_used_slots"]
    assert child.memory()["pool_used_slots"] == used  # shared, not copied
    q = torch.randn(1, 2, 64, generator=gen)
    assert torch.equal(parent.attend(0, q), child.attend(0, q))
    assert child.truncate(695) == 695  # rejected speculative tokens: free
    assert child.length(0) == 695 and parent.length(0) == 700
    back = child.truncate(300)
    assert back <= 300 and child.length(0) == back
    # the pool (sized for one sequence) runs out when both grow; nothing is lost
    with pytest.raises(PoolExhaustedError):
        for _ in range(40):
            for seq in (child, parent):
                if seq.length(0) + 50 <= cfg.max_tokens:
                    before = seq.snapshot()
                    try:
                        seq.append(
                            0,
                            torch.randn(50, 2, 64, generator=gen),
                            torch.randn(50, 2, 64, generator=gen),
                        )
                    except PoolExhaustedError:
                        assert seq.snapshot() == before
                        raise
    for seq in (child, parent):
        length = seq.length(0)
        out = seq.attend(0, torch.randn(length, 2, 64, generator=gen))
        assert torch.isfinite(out).all()


def test_too_large_for_this_machine_is_memory_error_not_abort() -> None:
    big = Config(
        layers=4096,
        kv_heads=1024,
        q_heads=1024,
        head_dim=512,
        min_tail=4096,
        max_tail=4_000_000,
        max_chunk=65536,
        max_tokens=16_000_000,
    )
    with pytest.raises(MemoryError, match="cannot allocate"):
        Cache(big)


def test_saved_config_survives_load_fork_and_moves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = Config(
        layers=2,
        kv_heads=2,
        q_heads=4,
        head_dim=128,
        k_bits=3,
        v_bits=2,
        body="trellis",
        min_tail=256,
        max_tail=512,
        max_chunk=64,
        flush_chunk=128,
        max_tokens=9999,
        passes=8,
        staging="q8_0",
        centre_keys=True,
        exact_recent=16,
        sink=192,
    )
    cache = Cache(cfg)
    gen = torch.Generator().manual_seed(3)
    for layer in range(2):
        cache.append(
            layer, torch.randn(40, 2, 128, generator=gen), torch.randn(40, 2, 128, generator=gen)
        )
    cache.save(tmp_path / "seq.sjkv")
    loaded = Cache.load(tmp_path / "seq.sjkv")
    assert loaded.config == cfg
    assert loaded.fork().config == cfg
    assert loaded.to("cpu").config == cfg
    assert loaded.to("cpu").fork().snapshot() == cache.snapshot()
    tiered = Config(
        layers=2, kv_heads=2, head_dim=64, layer_bits=[(4, 4, "scalar"), (3, 2, "trellis")]
    )
    tiered_cache = Cache(tiered)
    tiered_cache.save(tmp_path / "tiered.sjkv")
    assert Cache.load(tmp_path / "tiered.sjkv").config == tiered_cache.config
    assert tiered_cache.config.q_heads == 2
