"""The Walsh-Hadamard rotation is orthonormal, self-inverse and equals the dense matrix."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.linalg import hadamard

from sjkvarn import codec


@pytest.mark.parametrize("n", [64, 128, 256])
def test_equals_dense_hadamard(n: int, rng: np.random.Generator) -> None:
    x = rng.standard_normal((32, n)).astype(np.float32)
    dense = x.astype(np.float64) @ (hadamard(n) / np.sqrt(n)).T
    np.testing.assert_allclose(codec.rotate(x), dense, rtol=0, atol=2e-5)


@pytest.mark.parametrize("n", [64, 128, 256, 512])
def test_orthonormal_and_self_inverse(n: int, rng: np.random.Generator) -> None:
    eye = np.eye(n, dtype=np.float32)
    h = codec.rotate(eye)  # rows are the rotated basis vectors
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-5)
    x = rng.standard_normal((8, n)).astype(np.float32)
    np.testing.assert_allclose(codec.rotate(codec.rotate(x)), x, atol=1e-5)
    np.testing.assert_allclose(
        np.linalg.norm(codec.rotate(x), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5
    )


def test_512_is_one_512_point_transform(rng: np.random.Generator) -> None:
    # The reference rotates every head whole, 512-wide heads included.
    scipy_linalg = pytest.importorskip("scipy.linalg")
    x = rng.standard_normal((4, 512)).astype(np.float32)
    h = scipy_linalg.hadamard(512) / np.sqrt(512)
    np.testing.assert_allclose(codec.rotate(x), x.astype(np.float64) @ h.T, atol=1e-5)


@pytest.mark.parametrize("n", [32, 96, 1024])
def test_other_sizes_are_refused(n: int) -> None:
    from sjkvarn import CodecError

    with pytest.raises(CodecError, match="head_dim"):
        codec.rotate(np.zeros((2, n), dtype=np.float32))
