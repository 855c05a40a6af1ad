"""Trellis-coded body: distortion bars on N(0,1), random access, records, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from sjkvarn import CodecError, codec
from sjkvarn.report import nmse

# Reference points (per value, runs of 128): scalar Lloyd-Max 0.1175 / 0.0345, a published
# 64-state coder with a free start state (6 side bits per run) ~0.080 / 0.022, and the
# rate-distortion bound 0.0625 / 0.0156.
BARS = {2: 0.0800, 3: 0.0210}


@pytest.mark.parametrize("bits", [2, 3])
def test_iid_gaussian_distortion_bars(bits: int) -> None:
    rng = np.random.default_rng(1234)  # independent of the training seed and generator
    x = rng.standard_normal((1024, 128)).astype(np.float32)
    y = codec.decode_trellis(codec.encode_trellis(x, bits=bits), x.shape, bits=bits)
    mse = float(((x.astype(np.float64) - y) ** 2).mean())
    print(f"\n{bits}-bit trellis on 1024 N(0,1) runs of 128: MSE {mse:.5f} (bar {BARS[bits]})")
    assert mse <= BARS[bits]


def test_four_bit_trellis_beats_scalar_lloyd_max() -> None:
    rng = np.random.default_rng(99)
    x = rng.standard_normal((256, 128)).astype(np.float32)
    y = codec.decode_trellis(codec.encode_trellis(x, bits=4), x.shape, bits=4)
    mse = float(((x - y) ** 2).mean())
    print(f"\n4-bit trellis MSE {mse:.5f} (scalar Lloyd-Max 0.009497)")
    assert mse < 0.0095


def test_random_access_value_is_the_codebook_entry_of_the_last_bits() -> None:
    """Decode by hand from the bit stream: index at step t = last 6+b bits, tail-biting."""
    rng = np.random.default_rng(5)
    for bits in (2, 3, 4):
        x = rng.standard_normal((3, 64)).astype(np.float32)
        blob = codec.encode_trellis(x, bits=bits)
        y = codec.decode_trellis(blob, x.shape, bits=bits)
        table = codec.trellis_codebook(bits)
        stream = np.unpackbits(np.frombuffer(blob, np.uint8), bitorder="little")
        for r in range(3):
            run_bits = stream[r * 64 * bits : (r + 1) * 64 * bits]
            codes = run_bits.reshape(64, bits) @ (1 << np.arange(bits))
            for t in range(64):
                idx = 0
                for j in range(-(-(6 + bits) // bits)):
                    idx |= int(codes[(t - j) % 64]) << (j * bits)
                idx &= (1 << (6 + bits)) - 1
                assert table[idx] == y[r, t]


def test_thread_count_and_repeat_give_the_same_bytes() -> None:
    x = np.random.default_rng(8).standard_normal((300, 128)).astype(np.float32)
    one = codec.encode_trellis(x, bits=3, threads=1)
    assert codec.encode_trellis(x, bits=3, threads=2) == one
    assert codec.encode_trellis(x, bits=3) == one


def test_bad_trellis_input() -> None:
    x = np.zeros((2, 128), dtype=np.float32)
    with pytest.raises(CodecError, match="bit width"):
        codec.encode_trellis(x, bits=5)
    with pytest.raises(CodecError, match="whole number of bytes"):
        codec.encode_trellis(np.zeros((2, 12), dtype=np.float32), bits=3)
    x[1, 3] = np.nan
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode_trellis(x, bits=2)
    with pytest.raises(CodecError, match="expected"):
        codec.decode_trellis(b"\0" * 10, (2, 128), bits=2)
    t = np.zeros((128, 64), dtype=np.float32)
    with pytest.raises(CodecError, match="bit width"):
        codec.encode_body(t, t, k_bits=5, v_bits=4, k_body="trellis")
    with pytest.raises(CodecError, match="body must be"):
        codec.encode_body(t, t, k_body="lattice")


@pytest.mark.parametrize(
    "k_body,v_body",
    [("trellis", "trellis"), ("trellis-channel", "scalar"), ("scalar", "trellis-channel")],
)
@pytest.mark.parametrize("head_dim", [64, 256, 512])
def test_trellis_records_same_size_lower_error(k_body: str, v_body: str, head_dim: int) -> None:
    if k_body != v_body and head_dim == 512:
        pytest.skip("the channel-axis extension splits 512-wide heads into two sub-records")
    rng = np.random.default_rng(head_dim)
    k = rng.standard_normal((2, 128, head_dim)).astype(np.float32)
    v = rng.standard_t(5, (2, 128, head_dim)).astype(np.float32)
    for bits in (2, 3):
        kw = dict(k_bits=bits, v_bits=bits)
        scalar = codec.encode_body(k, v, **kw)
        coded = codec.encode_body(k, v, k_body=k_body, v_body=v_body, **kw)
        assert len(coded) == len(scalar)
        ks, vs = codec.decode_body(scalar, head_dim=head_dim, **kw)
        kt, vt = codec.decode_body(coded, head_dim=head_dim, k_body=k_body, v_body=v_body, **kw)
        if k_body != "scalar":
            assert nmse(k, kt) < 0.8 * nmse(k, ks)
        if v_body != "scalar":
            assert nmse(v, vt) < 0.8 * nmse(v, vs)


def test_trellis_record_determinism() -> None:
    rng = np.random.default_rng(3)
    k = rng.standard_normal((4, 128, 128)).astype(np.float32)
    v = rng.standard_normal((4, 128, 128)).astype(np.float32)
    kw = dict(k_bits=3, v_bits=2, k_body="trellis", v_body="trellis")
    one = codec.encode_body(k, v, threads=1, **kw)
    assert codec.encode_body(k, v, threads=2, **kw) == one
    assert b"".join(codec.encode_body(k[i], v[i], **kw) for i in range(4)) == one
