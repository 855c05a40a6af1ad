"""Bad input raises clear Python exceptions; nothing panics across the FFI boundary."""

from __future__ import annotations

import numpy as np
import pytest

from sjkvarn import CodecError, codec


@pytest.mark.parametrize("fmt", list(codec.FORMATS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values(fmt: str, bad: float) -> None:
    x = np.ones((2, 128), dtype=np.float32)
    x[1, 77] = bad
    with pytest.raises(CodecError, match="non-finite.*205"):
        codec.encode(fmt, x)


def test_non_finite_body() -> None:
    k = np.ones((128, 64), dtype=np.float32)
    v = k.copy()
    v[3, 4] = np.nan
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode_body(k, v)


@pytest.mark.parametrize("fmt,cols", [("q8_0", 48), ("turbo4", 96), ("tq6_0", 200), ("q4_1", 33)])
def test_lengths_not_whole_blocks(fmt: str, cols: int) -> None:
    with pytest.raises(CodecError, match="block size"):
        codec.encode(fmt, np.zeros((3, cols), dtype=np.float32))


def test_scalar_input_is_refused() -> None:
    with pytest.raises(CodecError):
        codec.encode("q8_0", np.array(1.0, dtype=np.float32))


def test_decode_with_wrong_blob_length() -> None:
    blob = codec.encode("q4_0", np.zeros((1, 64), dtype=np.float32))
    with pytest.raises(CodecError, match="expected 36"):
        codec.decode("q4_0", blob[:-1], (1, 64))
    with pytest.raises(CodecError):
        codec.decode("q4_0", blob, (1, 60))


@pytest.mark.parametrize("k_bits,v_bits", [(1, 4), (4, 7), (9, 9), (0, 2)])
def test_unsupported_bit_widths(k_bits: int, v_bits: int) -> None:
    t = np.zeros((128, 64), dtype=np.float32)
    with pytest.raises(CodecError, match="bit width"):
        codec.encode_body(t, t, k_bits=k_bits, v_bits=v_bits)
    with pytest.raises(CodecError, match="bit width"):
        codec.body_layout(64, k_bits, v_bits)


@pytest.mark.parametrize("head_dim", [32, 96, 192, 1024])
def test_unsupported_head_sizes(head_dim: int) -> None:
    t = np.zeros((128, head_dim), dtype=np.float32)
    with pytest.raises(CodecError, match="head_dim"):
        codec.encode_body(t, t)


def test_body_shapes() -> None:
    good = np.zeros((2, 128, 64), dtype=np.float32)
    with pytest.raises(CodecError, match="128, head_dim"):
        codec.encode_body(
            np.zeros((64, 64), dtype=np.float32), np.zeros((64, 64), dtype=np.float32)
        )
    with pytest.raises(CodecError, match="differ"):
        codec.encode_body(good, good[:1])
    blob = codec.encode_body(good, good)
    with pytest.raises(CodecError, match="whole number"):
        codec.decode_body(blob[:-3], head_dim=64)
    with pytest.raises(CodecError, match="whole number"):
        codec.decode_body(blob, head_dim=128)


def test_bad_settings() -> None:
    t = np.zeros((128, 64), dtype=np.float32)
    with pytest.raises(CodecError, match="mode"):
        codec.encode_body(t, t, mode="median")
    with pytest.raises(CodecError, match="stat"):
        codec.encode_body(t, t, stat="mad")
    with pytest.raises(CodecError, match="threads"):
        codec.encode("q8_0", np.zeros((1, 32), dtype=np.float32), threads=0)
    with pytest.raises(OverflowError):
        codec.encode("q8_0", np.zeros((1, 32), dtype=np.float32), threads=-1)
    with pytest.raises(CodecError, match="unknown format"):
        codec.encode("q3_k", np.zeros((1, 32), dtype=np.float32))


def test_values_too_large_for_fp16_scales() -> None:
    with pytest.raises(CodecError, match="fp16"):
        codec.encode("tq6_0", np.full((1, 128), 60000.0, dtype=np.float32))
    with pytest.raises(CodecError, match="fp16"):
        codec.encode("f16", np.full((1, 1), 1e6, dtype=np.float32))


def test_wrong_types_and_dtypes() -> None:
    with pytest.raises(TypeError, match="__dlpack__"):
        codec.encode("q8_0", [0.0] * 32)
    with pytest.raises(TypeError, match="int32"):
        codec.encode("q8_0", np.zeros((1, 32), dtype=np.int32))
    with pytest.raises(TypeError, match="bytes"):
        codec.decode("q8_0", "not bytes", (1, 32))  # type: ignore[arg-type]
    out = np.zeros((1, 32), dtype=np.float64)
    with pytest.raises(TypeError, match="float32"):
        codec.decode("q8_0", bytes(34), (1, 32), out=out)


def test_failed_decode_leaves_out_untouched() -> None:
    out = np.full((1, 64), 5.0, dtype=np.float32)
    with pytest.raises(CodecError):
        codec.decode("q8_0", bytes(67), (1, 64), out=out)
    assert (out == 5.0).all()


def test_rotated_formats_on_64_wide_rows() -> None:
    x = np.random.default_rng(0).standard_normal((5, 3, 64)).astype(np.float32)
    blob = codec.encode("tq6_0", x)
    assert len(blob) == 15 * 50  # one 64-value block (48 code bytes + fp16 norm) per row
    y = codec.decode("tq6_0", blob, x.shape)
    assert float(((x - y) ** 2).sum() / (x**2).sum()) < 2e-3
