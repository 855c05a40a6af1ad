"""The CUDA backend from Python. Without a usable GPU only the probing and the refusal are
tested; with one (the GPU check in benches/gpu/ runs this file) the device cache is checked
against the CPU reference: snapshot bytes equal, attention within 1e-3 relative."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sjkvarn
from sjkvarn import Cache, CacheError, Config

STATUS = sjkvarn.cuda_available()
needs_gpu = pytest.mark.skipif(not STATUS, reason=f"no CUDA: {STATUS.reason}")


def test_probe_says_why() -> None:
    status = sjkvarn.cuda_available()
    assert isinstance(status.reason, str) and status.reason
    if not status:
        assert "not available" in status.reason or "no CUDA device" in status.reason


def test_cuda_cache_without_cuda_is_a_clear_error() -> None:
    if STATUS:
        pytest.skip("CUDA is available here")
    with pytest.raises(sjkvarn.CudaUnavailableError, match="not available"):
        Cache(Config(layers=1, kv_heads=2, head_dim=64, device="cuda"))
    with pytest.raises(CacheError, match="device must be"):
        Cache(Config(layers=1, kv_heads=2, head_dim=64, device="cuda:x"))


def test_kernels_compile_with_nvrtc_and_are_cached(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The runtime's own NVRTC path (no GPU needed) where the nvidia-cuda-nvrtc wheel is."""
    from sjkvarn import _core
    from sjkvarn.cache import load_nvrtc

    if load_nvrtc() is None:
        pytest.skip("nvidia-cuda-nvrtc is not installed")
    monkeypatch.setenv("SJKVARN_KERNEL_CACHE", str(tmp_path))
    ptx = _core.compile_kernels("compute_90")
    for name in ("sj_append_stage", "sj_seal", "sj_attend_gs3", "sj_attend_merge"):
        assert f".entry {name}(" in ptx
    cached = list(tmp_path.glob("sjkvarn-compute_90-*.ptx"))
    assert len(cached) == 1 and cached[0].read_text() == ptx
    assert _core.compile_kernels("compute_90") == ptx
    with pytest.raises(ValueError, match="unknown architecture"):
        _core.compile_kernels("sm_90")


def test_to_cpu_copies_bytes() -> None:
    gen = torch.Generator().manual_seed(1)
    cfg = Config(
        layers=1,
        kv_heads=2,
        q_heads=4,
        head_dim=64,
        min_tail=256,
        max_tail=512,
        max_chunk=128,
        max_tokens=2048,
    )
    cache = Cache(cfg)
    cache.append(0, torch.randn(700, 2, 64, generator=gen), torch.randn(700, 2, 64, generator=gen))
    copy = cache.to("cpu")
    assert copy.snapshot() == cache.snapshot()
    copy.append(0, torch.randn(3, 2, 64), torch.randn(3, 2, 64))
    assert copy.length() == 703 and cache.length() == 700


def _pair(
    body: str, kv: tuple[int, int] = (4, 4), head_dim: int = 64, q_heads: int = 6
) -> tuple[Cache, Cache]:
    cfg = dict(
        layers=2,
        kv_heads=2,
        q_heads=q_heads,
        head_dim=head_dim,
        k_bits=kv[0],
        v_bits=kv[1],
        body=body,
        min_tail=256,
        max_tail=512,
        max_chunk=128,
        max_tokens=4096,
        staging="tq6_0",  # the device ring's type (the CPU default keeps keys in q8_0)
    )
    return Cache(Config(**cfg)), Cache(Config(**cfg, device="cuda"))


def _kv(gen: torch.Generator, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(n, 2, d, generator=gen)
    k[:, :, 5] *= 12.0
    return k, torch.randn(n, 2, d, generator=gen)


@needs_gpu
@pytest.mark.parametrize(
    "body,kv,head_dim",
    [
        ("scalar", (4, 4), 64),
        ("scalar", (3, 2), 128),
        ("scalar", (4, 2), 256),
        ("trellis", (3, 3), 64),
        ("trellis", (2, 2), 128),
        ("scalar", (4, 4), 512),
    ],
)
def test_device_matches_cpu(body: str, kv: tuple[int, int], head_dim: int) -> None:
    cpu, gpu = _pair(body, kv, head_dim)
    gen = torch.Generator().manual_seed(head_dim + kv[0])
    for n in (100, 28, 1, 300, 77, 512, 5, 200):
        for layer in range(2):
            k, v = _kv(gen, n, head_dim)
            cpu.append(layer, k, v)
            gpu.append(layer, k.cuda(), v.cuda())
        assert gpu.regions(0) == cpu.regions(0)
        for rows in (1, 4):
            q = torch.randn(rows, 6, head_dim, generator=gen)
            want = cpu.attend(1, q)
            got = gpu.attend(1, q.cuda()).cpu()
            err = (got - want).abs().max() / want.abs().max()
            assert err < 1e-3, f"{body} {kv} d{head_dim}: {err}"
    assert gpu.snapshot() == cpu.snapshot(), "device records and ring must equal the CPU's"


@needs_gpu
def test_device_bad_input_leaves_cache_unchanged() -> None:
    _, gpu = _pair("scalar")
    gen = torch.Generator().manual_seed(3)
    k, v = _kv(gen, 300, 64)
    gpu.append(0, k.cuda(), v.cuda())
    before = gpu.snapshot()
    bad = k[:10].clone()
    bad[3, 1, 7] = float("nan")
    with pytest.raises(CacheError, match="NaN"):
        gpu.append(0, bad.cuda(), v[:10].cuda())
    with pytest.raises(ValueError, match="cuda"):
        gpu.append(0, k[:10], v[:10])  # CPU tensors
    with pytest.raises(TypeError):
        gpu.append(0, np.zeros((1, 2, 64), np.float32), np.zeros((1, 2, 64), np.float32))
    with pytest.raises(CacheError, match="expected shape"):
        gpu.append(0, k[:10, :1].cuda(), v[:10, :1].cuda())
    with pytest.raises(IndexError):
        gpu.append(5, k[:10].cuda(), v[:10].cuda())
    with pytest.raises(CacheError):
        gpu.attend(0, torch.randn(301, 6, 64, device="cuda"))
    assert gpu.snapshot() == before


@needs_gpu
def test_device_truncate_fork_and_snapshot_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cpu, gpu = _pair("scalar", (3, 2))
    gen = torch.Generator().manual_seed(9)
    for n in (600, 400):
        for layer in range(2):
            k, v = _kv(gen, n, 64)
            cpu.append(layer, k, v)
            gpu.append(layer, k.cuda(), v.cuda())
    assert gpu.truncate(700) == cpu.truncate(700)
    assert gpu.snapshot() == cpu.snapshot()
    child = gpu.fork()
    k, v = _kv(gen, 50, 64)
    child.append(0, k.cuda(), v.cuda())
    assert gpu.length(0) < child.length(0)
    path = tmp_path / "gpu.sjkv"
    gpu.save(path)
    back = Cache.load(path, device="cuda")
    assert back.snapshot() == gpu.snapshot()
    assert Cache.load(path).snapshot() == cpu.snapshot()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_seal_failing_part_way_changes_nothing(device: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An append whose seals fail after 0..7 records, and a seal_idle failing in its second
    layer, leave the cache byte-identical and the pool's slots as they were (the injected fault
    is the core's; the device path has the same injection point)."""
    from sjkvarn import _core

    cfg = Config(
        layers=2,
        kv_heads=2,
        q_heads=4,
        head_dim=64,
        k_bits=3,
        v_bits=2,
        min_tail=256,
        max_tail=512,
        max_chunk=128,
        max_tokens=8192,
        device=device,
    )
    cache = Cache(cfg)
    gen = torch.Generator().manual_seed(11)

    def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = torch.randn(n, 2, 64, generator=gen), torch.randn(n, 2, 64, generator=gen)
        return k.to(device), v.to(device)

    for layer in range(2):
        cache.append(layer, *kv(600))
    k, v = kv(700)  # several chunks of 128 against a 512-token tail: several seals
    before = cache.snapshot()
    used = cache.memory()["pool_used_slots"]
    try:
        for after in range(8):
            _core._inject_seal_failure(after)
            with pytest.raises(CacheError, match="injected"):
                cache.append(0, k, v)
            _core._inject_seal_failure(None)
            assert cache.snapshot() == before, f"failure after {after} records changed it"
            assert cache.memory()["pool_used_slots"] == used
        _core._inject_seal_failure(2)  # layer 0's two records pass, layer 1's fail
        with pytest.raises(CacheError, match="injected"):
            cache.seal_idle()
    finally:
        _core._inject_seal_failure(None)
    assert cache.snapshot() == before
    assert cache.memory()["pool_used_slots"] == used
    # Disarmed, the same append gives the bytes of a cache that never failed.
    (tmp_path / "before.sjkv").write_bytes(before)
    twin = Cache.load(tmp_path / "before.sjkv")
    cache.append(0, k, v)
    twin.append(0, k.cpu(), v.cpu())
    assert cache.snapshot() == twin.snapshot()
