"""The journal over engine block pages (sjkvarn.vllm.paged): vLLM's block mapping without vLLM.

A reference computes each query's view from first principles (sink and own block exact in fp16,
every other block through codec.encode_body/decode_body) and plain softmax attention; the paged
journal must match it whatever the chunking, block ids, sharing or head split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sjkvarn import InvalidInputError, codec
from sjkvarn.vllm.paged import (
    BLOCK,
    PagedJournal,
    PagedSettings,
    WindowJournal,
    page_state_bytes,
    sequences_per_gib,
    window_block_tokens,
    window_row_bytes,
)

KVH, QH, D = 2, 6, 64
SCALE = D**-0.5


def pages_for(settings: PagedSettings, blocks: int, dtype: torch.dtype = torch.float32):
    state = page_state_bytes(settings, D, dtype)
    return torch.zeros(blocks, KVH, 1, state // 4, dtype=torch.float32)


def rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, KVH, D, generator=g) + 0.5
    v = torch.randn(n, KVH, D, generator=g)
    q = torch.randn(n, QH, D, generator=g)
    return k, v, q


def reference(settings: PagedSettings, k, v, q, window: int | None = None) -> torch.Tensor:
    """Attention of query i (position i) over the journal's view at position i."""
    n = k.shape[0]
    half_k, half_v = k.half().float(), v.half().float()
    coded_k, coded_v = half_k.clone(), half_v.clone()
    for b in range(n // BLOCK):
        sl = slice(b * BLOCK, (b + 1) * BLOCK)
        blob = codec.encode_body(
            half_k[sl].permute(1, 0, 2).numpy(),
            half_v[sl].permute(1, 0, 2).numpy(),
            k_bits=settings.k_bits,
            v_bits=settings.v_bits,
            k_body=settings.body,
            v_body=settings.body,
        )
        dk, dv = codec.decode_body(
            blob,
            head_dim=D,
            k_bits=settings.k_bits,
            v_bits=settings.v_bits,
            k_body=settings.body,
            v_body=settings.body,
        )
        coded_k[sl] = torch.from_numpy(dk).permute(1, 0, 2)
        coded_v[sl] = torch.from_numpy(dv).permute(1, 0, 2)
    out = torch.empty(n, QH, D)
    for p in range(n):
        own = (p // BLOCK) * BLOCK
        kk, vv = coded_k[: p + 1].clone(), coded_v[: p + 1].clone()
        kk[own:], vv[own:] = half_k[own : p + 1], half_v[own : p + 1]
        if settings.sink and window is None:
            kk[:BLOCK], vv[:BLOCK] = half_k[: min(BLOCK, p + 1)], half_v[: min(BLOCK, p + 1)]
        lo = 0 if window is None else max(0, p - window + 1)
        kk, vv = kk[lo:], vv[lo:]
        for h in range(QH):
            kv = h // (QH // KVH)
            w = torch.softmax(kk[:, kv] @ q[p, h] * SCALE, dim=0)
            out[p, h] = w @ vv[:, kv]
    return out


def assert_reads_records(got: torch.Tensor, want: torch.Tensor) -> None:
    """The core's kernels read 4-bit and trellis records in fixed point: at most 3e-4 of the
    output's size from f32 attention over the decoded rows (the crate's
    ``sealed_records_attend_as_their_decoded_rows``), per query head."""
    err = (got - want).abs().amax(dim=(0, 2)) / want.abs().amax(dim=(0, 2))
    assert float(err.max()) <= 3e-4, f"error {float(err.max()):.2e} of the output"


# Outputs that read the same view may differ in the last bits where the queries are batched
# differently (summation order); 1e-6 is far below the codec's error (~1e-2).
SAME = {"rtol": 1e-5, "atol": 1e-6}


def run(journal: PagedJournal, pages, k, v, q, table: list[int], chunks: list[int]):
    """Feeds positions in ``chunks`` (sizes) as an engine would; returns all outputs."""
    out, pos = [], 0
    for size in chunks:
        sl = slice(pos, pos + size)
        slots = torch.tensor(
            [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(pos, pos + size)]
        )
        journal.write(pages, k[sl], v[sl], slots)
        bt = torch.tensor([table])
        out.append(journal.attend(pages, q[sl], [0, size], [pos + size], bt, SCALE))
        journal.forget({table[0]})
        pos += size
    return torch.cat(out)


@pytest.mark.parametrize(
    "settings", [PagedSettings(), PagedSettings(k_bits=3, v_bits=2, body="trellis")]
)
def test_matches_reference_for_any_chunking(settings: PagedSettings) -> None:
    n = 3 * BLOCK + 40
    k, v, q = rows(n, 1)
    want = reference(settings, k, v, q)
    table = [7, 3, 9, 4]
    for chunks in ([n], [100, 200, n - 300], [BLOCK] * 3 + [40]):
        journal = PagedJournal(settings, KVH, D, torch.float32)
        pages = pages_for(settings, 10)
        got = run(journal, pages, k, v, q, table, chunks)
        assert_reads_records(got, want)


def test_decode_one_token_at_a_time_matches_prefill() -> None:
    settings = PagedSettings()
    n = 2 * BLOCK + 5
    k, v, q = rows(n, 2)
    table = [1, 2, 3]
    a = run(
        PagedJournal(settings, KVH, D, torch.float32), pages_for(settings, 4), k, v, q, table, [n]
    )
    b = run(
        PagedJournal(settings, KVH, D, torch.float32),
        pages_for(settings, 4),
        k,
        v,
        q,
        table,
        [BLOCK + 60] + [1] * (n - BLOCK - 60),
    )
    torch.testing.assert_close(a, b, **SAME)


def test_sliding_window() -> None:
    settings = PagedSettings()
    n = 3 * BLOCK + 10
    k, v, q = rows(n, 3)
    journal = PagedJournal(settings, KVH, D, torch.float32, sliding_window=200)
    got = run(journal, pages_for(settings, 5), k, v, q, [4, 1, 2, 3], [150, n - 150])
    # Sliding-window layers read decoded records (float sums).
    torch.testing.assert_close(got, reference(settings, k, v, q, window=200), rtol=2e-5, atol=2e-5)


def window_pages(settings: PagedSettings, blocks: int) -> torch.Tensor:
    """Sliding-window pages as vLLM views them: ``[blocks, kv_heads, tokens, row]`` float32,
    each block padded to the record page (so the view is strided)."""
    tokens = window_block_tokens(settings, D)
    record = KVH * page_state_bytes(settings, D, torch.float32)
    raw = torch.zeros(blocks * record, dtype=torch.uint8)
    row = window_row_bytes(D)
    view = raw.as_strided((blocks, KVH, tokens, row), (record, tokens * row, row, 1))
    return view.view(torch.float32)


def exact_window_reference(k, v, q, window: int) -> torch.Tensor:
    out = torch.empty(q.shape)
    half_k, half_v = k.half().float(), v.half().float()
    for p in range(k.shape[0]):
        lo = max(0, p - window + 1)
        for h in range(QH):
            kv = h // (QH // KVH)
            w = torch.softmax(half_k[lo : p + 1, kv] @ q[p, h] * SCALE, dim=0)
            out[p, h] = w @ half_v[lo : p + 1, kv]
    return out


@pytest.mark.parametrize("settings", [PagedSettings(), PagedSettings(2, 2, "trellis")])
def test_sliding_window_layers_keep_exact_rows(settings: PagedSettings) -> None:
    """Window pages hold fp16 rows in padded, strided pages; any chunking and block ids give
    attention over exactly the last ``window`` rows."""
    tokens = window_block_tokens(settings, D)
    assert tokens * window_row_bytes(D) <= page_state_bytes(settings, D, torch.float32)
    n, window = 7 * tokens + 5, 3 * tokens + 7
    k, v, q = rows(n, 12)
    want = exact_window_reference(k, v, q, window)
    table = [9, 3, 0, 7, 1, 8, 2, 5]
    for chunks in ([n], [tokens - 1, 2 * tokens + 3, n - 3 * tokens - 2], [1] * 10 + [n - 10]):
        pages = window_pages(settings, 10)
        journal = WindowJournal(KVH, D, window)
        out, pos = [], 0
        for size in chunks:
            slots = torch.tensor(
                [table[p // tokens] * tokens + p % tokens for p in range(pos, pos + size)]
            )
            journal.write(pages, k[pos : pos + size], v[pos : pos + size], slots)
            bt = torch.tensor([table])
            qs = q[pos : pos + size]
            out.append(journal.attend(pages, qs, [0, size], [pos + size], bt, SCALE))
            pos += size
        torch.testing.assert_close(torch.cat(out), want, rtol=1e-5, atol=1e-5)


def test_window_journal_refuses_bad_rows_and_changes_nothing() -> None:
    settings = PagedSettings()
    journal = WindowJournal(KVH, D, 64)
    pages = window_pages(settings, 2)
    k, v, _ = rows(4, 13)
    k[0, 0, 0] = 1e6  # beyond fp16
    with pytest.raises(InvalidInputError, match="float16"):
        journal.write(pages, k, v, torch.arange(4))
    k[0, 0, 0] = float("inf")
    with pytest.raises(InvalidInputError, match="NaN or Inf"):
        journal.write(pages, k, v, torch.arange(4))
    with pytest.raises(InvalidInputError, match="past the last page"):
        journal.write(pages, v, v, torch.arange(4) + 10_000)
    assert not pages.view(torch.uint8).any()
    with pytest.raises(InvalidInputError, match="sliding-window page"):
        journal.write(torch.zeros(2, KVH, 8, 3), v, v, torch.arange(4))
    with pytest.raises(InvalidInputError, match="positive"):
        WindowJournal(KVH, D, 0)


def test_lossless_pages_hold_the_rows_exactly() -> None:
    settings = PagedSettings(lossless=True)
    n = BLOCK + 30
    k, v, q = rows(n, 4)
    journal = PagedJournal(settings, KVH, D, torch.float32)
    got = run(journal, pages_for(settings, 3), k, v, q, [2, 1], [70, n - 70])
    want = torch.empty(n, QH, D)
    for p in range(n):
        for h in range(QH):
            kv = h // (QH // KVH)
            w = torch.softmax(k[: p + 1, kv] @ q[p, h] * SCALE, dim=0)
            want[p, h] = w @ v[: p + 1, kv]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_shared_prefix_blocks_give_the_same_outputs() -> None:
    """Two sequences share two full blocks (prefix caching): the second writes only its own
    suffix, yet matches a run that computed everything itself."""
    settings = PagedSettings()
    n = 2 * BLOCK + 50
    k, v, q = rows(n, 5)
    k2, v2, q2 = rows(n, 6)
    k2[: 2 * BLOCK], v2[: 2 * BLOCK] = k[: 2 * BLOCK], v[: 2 * BLOCK]
    alone = run(
        PagedJournal(settings, KVH, D, torch.float32),
        pages_for(settings, 8),
        k2,
        v2,
        q2,
        [1, 2, 3],
        [n],
    )
    journal = PagedJournal(settings, KVH, D, torch.float32)
    pages = pages_for(settings, 8)
    run(journal, pages, k, v, q, [1, 2, 3], [n])
    # The second sequence: blocks 1 and 2 shared, block 5 its own; only its suffix is computed.
    start = 2 * BLOCK
    slots = torch.tensor([5 * BLOCK + p - start for p in range(start, n)])
    journal.write(pages, k2[start:], v2[start:], slots)
    shared = journal.attend(
        pages, q2[start:], [0, n - start], [n], torch.tensor([[1, 2, 5]]), SCALE
    )
    torch.testing.assert_close(shared, alone[start:], **SAME)


def test_recomputed_last_token_of_a_cached_block_keeps_its_record() -> None:
    settings = PagedSettings()
    n = 2 * BLOCK
    k, v, q = rows(n, 7)
    journal = PagedJournal(settings, KVH, D, torch.float32)
    pages = pages_for(settings, 4)
    run(journal, pages, k, v, q, [1, 2], [n])
    before = pages.clone()
    journal.write(pages, k[-1:], v[-1:], torch.tensor([2 * BLOCK + BLOCK - 1]))
    out = journal.attend(pages, q[-1:], [0, 1], [n], torch.tensor([[1, 2]]), SCALE)
    assert torch.equal(pages.view(torch.uint8), before.view(torch.uint8))
    assert torch.isfinite(out).all()


def test_reused_block_starts_afresh() -> None:
    settings = PagedSettings()
    k, v, q = rows(BLOCK + 10, 8)
    journal = PagedJournal(settings, KVH, D, torch.float32)
    pages = pages_for(settings, 3)
    run(journal, pages, k, v, q, [1, 2], [BLOCK + 10])
    # Block 2 freed and handed to a new sequence (as its first block).
    k2, v2, q2 = rows(20, 9)
    got = run(journal, pages, k2, v2, q2, [2], [20])
    want = run(
        PagedJournal(settings, KVH, D, torch.float32), pages_for(settings, 3), k2, v2, q2, [2], [20]
    )
    torch.testing.assert_close(got, want, **SAME)


def test_tensor_parallel_head_split() -> None:
    """Each rank holds its KV heads' records: two journals over half the heads each give the
    two halves of one journal's output."""
    settings = PagedSettings()
    n = 2 * BLOCK + 3
    k, v, q = rows(n, 10)
    whole = run(
        PagedJournal(settings, KVH, D, torch.float32),
        pages_for(settings, 4),
        k,
        v,
        q,
        [1, 2, 3],
        [n],
    )
    halves = []
    for r in range(2):
        journal = PagedJournal(settings, 1, D, torch.float32)
        state = page_state_bytes(settings, D, torch.float32)
        pages = torch.zeros(4, 1, 1, state // 4)
        hs = slice(r * QH // 2, (r + 1) * QH // 2)
        slots = torch.tensor([[1, 2, 3][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        journal.write(pages, k[:, r : r + 1], v[:, r : r + 1], slots)
        out = journal.attend(pages, q[:, hs], [0, n], [n], torch.tensor([[1, 2, 3]]), SCALE)
        halves.append(out)
    torch.testing.assert_close(torch.cat(halves, dim=1), whole, **SAME)


def test_bad_input_is_refused_and_changes_nothing() -> None:
    settings = PagedSettings()
    journal = PagedJournal(settings, KVH, D, torch.float32)
    pages = pages_for(settings, 2)
    k, v, _ = rows(4, 11)
    k[1, 0, 3] = float("nan")
    with pytest.raises(InvalidInputError, match="NaN"):
        journal.write(pages, k, v, torch.arange(4) + BLOCK)
    assert not pages.any() and not journal._open
    with pytest.raises(InvalidInputError, match="page"):
        journal.write(torch.zeros(2, KVH, 1, 8), v, v, torch.arange(4) + BLOCK)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"k_bits": 5}, "2..4"),
        ({"body": "lattice"}, "body"),
        ({"body": "trellis", "k_bits": 4}, "trellis"),
        ({"kbits": 4}, "unknown"),
        ({"k_bits": "4"}, "must be int"),
        ({"sink": 1}, "must be bool"),
        ({"max_sink_blocks": -1}, "max_sink_blocks"),
    ],
)
def test_settings_are_checked(values: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        PagedSettings.from_dict(values)


def test_compressed_pages_fit_more_sequences() -> None:
    coded = sequences_per_gib(PagedSettings(), 8192, 30, 3, 64, torch.bfloat16)
    plain = sequences_per_gib(PagedSettings(lossless=True), 8192, 30, 3, 64, torch.bfloat16)
    assert coded / plain == pytest.approx(
        (64 * 2 * BLOCK * 64 * 2) / (64 * 9344 + 2 * 2 * BLOCK * 64 * 2), rel=1e-9
    )
    assert np.isclose(plain, 2**30 / (64 * 30 * 3 * BLOCK * 2 * 64 * 2))


def test_window_layers_count_only_the_window() -> None:
    """Gemma 3 270M's geometry: 15 of 18 layers see the last 512 positions."""
    geo = dict(layers=18, kv_heads=1, head_dim=256, dtype=torch.bfloat16)
    record = page_state_bytes(PagedSettings(), 256, torch.bfloat16)
    tokens = window_block_tokens(PagedSettings(), 256)
    coded = sequences_per_gib(PagedSettings(), 8192, window_layers=15, window=512, **geo)
    full = 3 * 64 * record + 2 * 3 * 2 * BLOCK * 256 * 2
    assert coded == pytest.approx(2**30 / (full + 15 * (512 // tokens + 1) * record))
    plain = sequences_per_gib(
        PagedSettings(lossless=True), 8192, window_layers=15, window=512, **geo
    )
    page = 2 * BLOCK * 256 * 2
    assert plain == pytest.approx(2**30 / (3 * 64 * page + 15 * 5 * page))
    assert coded > 2 * plain
