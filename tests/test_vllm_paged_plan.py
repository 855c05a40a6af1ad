"""The paged journal's crate side (sjkvarn::backend::paged) seen from Python: seals equal to
codec.encode_body, one step plan shared by every layer, refused input leaving state alone."""

from __future__ import annotations

import pytest
import torch

from sjkvarn import InvalidInputError, codec
from sjkvarn.vllm.paged import BLOCK, PagedJournal, PagedSettings, make_step, page_state_bytes

KVH, QH, D = 2, 6, 64
SCALE = D**-0.5
SAME = {"rtol": 1e-5, "atol": 1e-6}


def pages_for(settings: PagedSettings, blocks: int) -> torch.Tensor:
    state = page_state_bytes(settings, D, torch.float32)
    return torch.zeros(blocks, KVH, 1, state // 4, dtype=torch.float32)


def rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, KVH, D, generator=g) + 0.5
    v = torch.randn(n, KVH, D, generator=g)
    q = torch.randn(n, QH, D, generator=g)
    return k, v, q


def test_sealed_pages_are_encode_body_of_the_fp16_rows() -> None:
    """The journal's seal writes exactly ``codec.encode_body`` of the block's rows rounded to
    fp16, one record per KV head, into the block's page."""
    for settings in (PagedSettings(), PagedSettings(3, 3, "trellis")):
        journal = PagedJournal(settings, KVH, D, torch.float32)
        pages = pages_for(settings, 3)
        k, v, _ = rows(BLOCK + 9, 14)
        slots = torch.tensor([2 * BLOCK + p if p < BLOCK else p - BLOCK for p in range(BLOCK + 9)])
        journal.write(pages, k, v, slots)
        want = codec.encode_body(
            k[:BLOCK].half().float().permute(1, 0, 2).numpy(),
            v[:BLOCK].half().float().permute(1, 0, 2).numpy(),
            k_bits=settings.k_bits,
            v_bits=settings.v_bits,
            k_body=settings.body,
            v_body=settings.body,
        )
        assert pages[2].numpy().tobytes() == want
        assert not pages[0].view(torch.uint8).any(), "the open block has no record yet"
        assert journal._open == [0, 2]


def test_one_step_plan_serves_every_layer() -> None:
    """A step plan built once from the step's metadata gives each layer what a plan of its own
    would: two layers (one coded, one lossless) read the same shared plan."""
    n = 2 * BLOCK + 20
    k, v, q = rows(n, 15)
    table, lens, starts = torch.tensor([[3, 1, 2], [4, 5, 6]]), [n, 60], [0, 30, 90]
    step = make_step(starts, lens, table, BLOCK)
    assert step.live_sinks == [3, 4]
    assert step.query_blocks == [(0, 10, n - 30), (10, 30, 2 * BLOCK), (30, 90, 0)]
    for settings in (PagedSettings(), PagedSettings(lossless=True)):
        journal = PagedJournal(settings, KVH, D, torch.float32)
        pages = pages_for(settings, 8)
        first = torch.tensor([[3, 1, 2][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        journal.write(pages, k, v, first)
        journal.write(pages, k[:60], v[:60], torch.arange(60) + 4 * BLOCK)
        shared = journal.attend(pages, q[:90], None, None, None, SCALE, step=step)
        again = journal.attend(pages, q[:90], starts, lens, table, SCALE)
        assert torch.equal(shared, again)
        alone = journal.attend(pages, q[30:90], [0, 60], [60], table[1:], SCALE)
        torch.testing.assert_close(shared[30:90], alone, **SAME)
        journal.forget(set(step.live_sinks))


def test_bad_slots_and_unwritten_blocks_are_refused() -> None:
    settings = PagedSettings()
    journal = PagedJournal(settings, KVH, D, torch.float32)
    pages = pages_for(settings, 2)
    k, v, q = rows(4, 16)
    with pytest.raises(InvalidInputError, match="past the last page"):
        journal.write(pages, k, v, torch.tensor([0, 1, 2, 2 * BLOCK]))
    with pytest.raises(InvalidInputError, match="never written"):
        journal.write(pages, k, v, torch.arange(4) + 5)
    with pytest.raises(InvalidInputError, match="never written"):
        journal.attend(pages, q[:1], [0, 1], [BLOCK + 1], torch.tensor([[0, 1]]), SCALE)
    with pytest.raises(InvalidInputError, match="key/value"):
        journal.write(pages, k[:, :1], v[:, :1], torch.arange(4))
    assert not pages.any() and not journal._open


def test_overlapping_calls_are_refused_never_interleaved() -> None:
    """Threads sharing one layer's journal: a call that finds another running is refused with
    InvalidInputError and changes nothing, so retrying each refused call ends with the pages of
    a serial run."""
    import threading

    settings = PagedSettings()
    n = 4 * BLOCK
    k, v, _ = rows(2 * n, 17)
    shared = PagedJournal(settings, KVH, D, torch.float32)
    pages = pages_for(settings, 8)
    refused = []

    def feed(first: int) -> None:
        for c in range(0, n, 64):
            slots = torch.arange(c, c + 64) + first * BLOCK
            rows_k, rows_v = k[first * BLOCK + c :][:64], v[first * BLOCK + c :][:64]
            while True:
                try:
                    shared.write(pages, rows_k, rows_v, slots)
                    break
                except InvalidInputError as e:
                    assert "in use" in str(e)
                    refused.append(e)

    threads = [threading.Thread(target=feed, args=(first,)) for first in (0, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    serial = PagedJournal(settings, KVH, D, torch.float32)
    want = pages_for(settings, 8)
    serial.write(want, k, v, torch.arange(2 * n))
    assert torch.equal(pages.view(torch.uint8), want.view(torch.uint8))
    assert want.view(torch.uint8).any(), "every block was sealed"
    assert shared._open == serial._open == list(range(8))
