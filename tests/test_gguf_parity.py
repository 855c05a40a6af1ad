"""q8_0, q4_0, q4_1, q5_0, q5_1: bytes equal gguf.quants.quantize, decode equals dequantize."""

from __future__ import annotations

import numpy as np
import pytest

from sjkvarn import codec

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

GGML = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1}


def cases(rng: np.random.Generator) -> dict[str, np.ndarray]:
    denormal = np.float32(1e-40)
    mixed = rng.standard_normal((8, 256)).astype(np.float32)
    mixed[0, :32] = 0.0
    mixed[1, :32] = 3.25
    mixed[2, 32:64] = -65504.0
    mixed[3, 64:96] = np.linspace(-65504, 65504, 32, dtype=np.float32)
    mixed[4, :32] = denormal * rng.standard_normal(32).astype(np.float32)
    mixed[5, 96:128] = np.float32(6e-5) * rng.standard_normal(32).astype(np.float32)
    return {
        "gaussian": rng.standard_normal((64, 256)).astype(np.float32),
        "student_t": rng.standard_t(3, (32, 512)).astype(np.float32),
        "wide": (rng.standard_normal((16, 128)) * 1000).astype(np.float32),
        "zeros": np.zeros((4, 64), dtype=np.float32),
        "constant_pos": np.full((2, 64), 7.5, dtype=np.float32),
        "constant_neg": np.full((2, 64), -0.125, dtype=np.float32),
        "max_pos": np.full((1, 32), 65504.0, dtype=np.float32),
        "max_neg": np.full((1, 32), -65504.0, dtype=np.float32),
        "plus_minus_max": np.tile(np.array([65504.0, -65504.0], dtype=np.float32), (2, 16)),
        "denormals": (rng.standard_normal((4, 64)) * 1e-40).astype(np.float32),
        "denormal_const": np.full((1, 32), denormal, dtype=np.float32),
        "ties": (np.arange(-64, 64, dtype=np.float32) / 4).reshape(2, 64),
        "mixed": mixed,
    }


@pytest.mark.parametrize("fmt", list(GGML))
def test_bytes_equal_gguf(fmt: str, rng: np.random.Generator) -> None:
    with np.errstate(all="ignore"):  # gguf divides by zero on denormal blocks
        for name, x in cases(rng).items():
            ours = codec.encode(fmt, x)
            theirs = quants.quantize(x, GGML[fmt]).tobytes()
            assert ours == theirs, f"{fmt} differs from gguf on {name}"
            back = codec.decode(fmt, ours, x.shape)
            ref = quants.dequantize(
                np.frombuffer(theirs, dtype=np.uint8).reshape(x.shape[0], -1), GGML[fmt]
            )
            np.testing.assert_array_equal(
                back, ref.reshape(x.shape), err_msg=f"{fmt} decode on {name}"
            )


def test_float16_and_bfloat16_inputs_match_their_float32_values(rng: np.random.Generator) -> None:
    x16 = rng.standard_normal((4, 64)).astype(np.float16)
    assert codec.encode("q4_1", x16) == quants.quantize(x16.astype(np.float32), T.Q4_1).tobytes()
