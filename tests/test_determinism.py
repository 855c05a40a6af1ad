"""Same input twice, and 1 vs 2 threads, give identical bytes for every format and the body."""

from __future__ import annotations

import numpy as np
import pytest

from sjkvarn import codec


@pytest.mark.parametrize("fmt", list(codec.FORMATS))
def test_flat_formats(fmt: str, rng: np.random.Generator) -> None:
    x = rng.standard_t(3, (512, 256)).astype(np.float32)
    first = codec.encode(fmt, x, threads=1)
    assert codec.encode(fmt, x, threads=1) == first
    assert codec.encode(fmt, x, threads=2) == first
    assert codec.encode(fmt, x) == first


@pytest.mark.parametrize("mode,passes", [("final", 16), ("best", 8)])
@pytest.mark.parametrize("stat", ["std", "rms"])
def test_body_records(mode: str, passes: int, stat: str, rng: np.random.Generator) -> None:
    k = rng.standard_normal((6, 128, 128)).astype(np.float32)
    k[..., 5] *= 20.0
    v = rng.standard_t(3, (6, 128, 128)).astype(np.float32)
    kw = dict(k_bits=3, v_bits=2, passes=passes, mode=mode, stat=stat)
    first = codec.encode_body(k, v, threads=1, **kw)
    assert codec.encode_body(k, v, threads=1, **kw) == first
    assert codec.encode_body(k, v, threads=2, **kw) == first
    # one tile at a time gives the same bytes as the batch
    one_by_one = b"".join(codec.encode_body(k[i], v[i], **kw) for i in range(len(k)))
    assert one_by_one == first
