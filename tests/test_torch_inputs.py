"""CPU torch tensors in every supported dtype and layout encode like the equivalent numpy array."""

from __future__ import annotations

import numpy as np
import pytest

from sjkvarn import codec

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_torch_dtypes_match_numpy(dtype: str) -> None:
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(4, 256, generator=gen).to(getattr(torch, dtype))
    reference = t.to(torch.float32).numpy()
    for fmt in ("q8_0", "q5_1", "tq6_0"):
        assert codec.encode(fmt, t) == codec.encode(fmt, reference)


def test_strided_and_autograd_tensors() -> None:
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(128, 256, generator=gen, requires_grad=True)
    view = base.t()[:, :128]  # non-contiguous, needs grad
    assert not view.is_contiguous()
    assert codec.encode("q4_0", view) == codec.encode("q4_0", view.detach().contiguous().numpy())


def test_body_from_torch_and_decode_into_torch() -> None:
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(2, 128, 64, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(2, 128, 64, generator=gen, dtype=torch.float16)
    blob = codec.encode_body(k, v, k_bits=4, v_bits=3)
    assert blob == codec.encode_body(k.float().numpy(), v.float().numpy(), k_bits=4, v_bits=3)
    x = torch.randn(2, 64, generator=gen)
    out = torch.empty(2, 64)
    result = codec.decode("q8_0", codec.encode("q8_0", x), (2, 64), out=out)
    assert result is out
    np.testing.assert_array_equal(
        out.numpy(), codec.decode("q8_0", codec.encode("q8_0", x), (2, 64))
    )


def test_non_cpu_device_is_refused() -> None:
    meta = torch.empty(1, 32, device="meta")
    with pytest.raises((ValueError, BufferError)):
        codec.encode("q8_0", meta)
