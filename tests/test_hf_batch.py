"""SJKVCache with batches: left padding, beam search, parallel sampling and sliding-window layers.

"Exact" configurations stage K/V in fp16 and never seal (a large tail), so they differ from
transformers' fp32 `DynamicCache` only by fp16 rounding of K and V: greedy and beam outputs match
token for token on these prompts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from sjkvarn import CacheError, UnsupportedTypeError, hf  # noqa: E402
from sjkvarn.eval import histories, models  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer() -> tuple[Any, Any]:
    try:
        return models.load()
    except models.ModelNotFound as e:
        pytest.skip(f"the default model is not installed: {e}")


def _prompts(tok: Any, lengths: list[int]) -> list[list[int]]:
    """Token ids of real text and code, one prompt per length, each from a different place."""
    sources = [histories.coding().text, histories.prose().text, histories.agentic().text]
    out = []
    for i, n in enumerate(lengths):
        ids = tok(sources[i % len(sources)], add_special_tokens=False).input_ids
        start = 97 * i
        out.append(ids[start : start + n])
        assert len(out[-1]) == n
    return out


def _left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, width - len(s) :] = torch.tensor(s)
        mask[b, width - len(s) :] = 1
    return ids, mask


def _exact(net: Any) -> Any:
    return hf.config_for(net, staging="f16", min_tail=512, max_tail=1024, max_tokens=1024)


def _greedy(net: Any, ids: torch.Tensor, cache: Any, new: int, **kw: Any) -> torch.Tensor:
    if isinstance(cache, DynamicCache):
        net.set_attn_implementation("sdpa")
    with torch.no_grad():
        return net.generate(
            input_ids=ids,
            cache=cache,
            max_new_tokens=new,
            min_new_tokens=new,  # no early EOS: every row generates `new` tokens
            do_sample=False,
            pad_token_id=kw.pop("pad_token_id", 2),
            **kw,
        )


def test_padded_batch_generates_what_each_prompt_generates_alone(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    net, tok = model_and_tokenizer
    pad = tok.pad_token_id
    prompts = _prompts(tok, [5, 23, 41, 67])
    ids, mask = _left_pad(prompts, pad)
    cache = hf.SJKVCache(net, _exact(net))
    out = _greedy(net, ids, cache, 12, attention_mask=mask, pad_token_id=pad)
    width = ids.shape[1]
    assert cache.get_seq_length() == out.shape[1] - 1  # the padded length, as transformers counts
    for b, p in enumerate(prompts):
        one = torch.tensor([p])
        alone = _greedy(net, one, hf.SJKVCache(net, _exact(net)), 12, pad_token_id=pad)
        reference = _greedy(net, one, DynamicCache(), 12, pad_token_id=pad)
        assert out[b, width:].tolist() == alone[0, len(p) :].tolist(), f"row {b}"
        assert alone.tolist() == reference.tolist(), f"row {b}"
        # the row holds its own real tokens only (the last generated token is never fed)
        assert all(cache.rows[b].length(layer) == len(p) + 11 for layer in (0, 15, 29))


def test_compressing_batch_rows_hold_their_own_tokens(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    net, tok = model_and_tokenizer
    prompts = _prompts(tok, [150, 260, 330, 400])
    ids, mask = _left_pad(prompts, tok.pad_token_id)
    cfg = hf.config_for(net, k_bits=4, v_bits=4, min_tail=128, max_tail=256, max_tokens=1024)
    cache = hf.SJKVCache(net, cfg)
    out = _greedy(net, ids, cache, 6, attention_mask=mask, pad_token_id=tok.pad_token_id)
    assert out.shape == (4, 400 + 6)
    assert cache.get_seq_length() == 405
    for b, p in enumerate(prompts):
        assert [cache.rows[b].length(layer) for layer in (0, 29)] == [len(p) + 5] * 2
    # The long rows sealed records, each at the seal points its own token count gives: the same
    # regions as the longest prompt alone.
    assert cache.rows[3].regions(5)["body"][1] > cache.rows[3].regions(5)["body"][0]
    alone = hf.SJKVCache(net, cfg)
    _greedy(net, torch.tensor([prompts[3]]), alone, 6, pad_token_id=tok.pad_token_id)
    assert all(cache.rows[3].regions(i) == alone.sjkv.regions(i) for i in range(30))
    with pytest.raises(CacheError, match="rows"):
        cache.sjkv  # noqa: B018 - several rows: no single sequence
    with pytest.raises(CacheError):
        cache.truncate(10)


def test_beam_search_matches_dynamic_cache(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    net, tok = model_and_tokenizer
    pad = tok.pad_token_id
    prompts = _prompts(tok, [9, 30])
    ids, mask = _left_pad(prompts, pad)
    kw = dict(attention_mask=mask, num_beams=3, pad_token_id=pad)
    cache = hf.SJKVCache(net, _exact(net))
    out = _greedy(net, ids, cache, 8, **kw)
    reference = _greedy(net, ids, DynamicCache(), 8, **kw)
    assert out.tolist() == reference.tolist()
    assert len(cache.rows) == 6  # the batch seen at the first update is already expanded
    # every beam row holds its prompt's real tokens and 7 generated ones
    assert [r.length(0) for r in cache.rows] == [9 + 7] * 3 + [30 + 7] * 3


def test_parallel_sampling_with_a_seed(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    net, tok = model_and_tokenizer
    pad = tok.pad_token_id
    prompts = _prompts(tok, [12, 33])
    ids, mask = _left_pad(prompts, pad)

    def sample(cache: Any) -> torch.Tensor:
        if isinstance(cache, DynamicCache):
            net.set_attn_implementation("sdpa")
        torch.manual_seed(7)
        with torch.no_grad():
            return net.generate(
                input_ids=ids,
                attention_mask=mask,
                cache=cache,
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=True,
                top_k=20,
                num_return_sequences=2,
                pad_token_id=pad,
            )

    cache = hf.SJKVCache(net, _exact(net))
    out = sample(cache)
    assert out.shape == (4, ids.shape[1] + 8)
    assert torch.equal(out[0, : ids.shape[1]], out[1, : ids.shape[1]])
    assert [r.length(0) for r in cache.rows] == [12 + 7] * 2 + [33 + 7] * 2
    # The same draws as with DynamicCache: logits agree to fp16 rounding of K/V, far inside the
    # gaps between cumulative probabilities that the seeded draws land in.
    assert out.tolist() == sample(DynamicCache()).tolist()


def test_fully_padded_chunk_rows(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A chunked prefill where one row has no real token in the first chunk."""
    net, tok = model_and_tokenizer
    prompts = _prompts(tok, [3, 20])
    ids, mask = _left_pad(prompts, tok.pad_token_id)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    chunked = hf.SJKVCache(net, _exact(net))
    with torch.no_grad():
        net(ids[:, :10], attention_mask=mask[:, :10], position_ids=pos[:, :10], cache=chunked)
        assert [r.length(0) for r in chunked.rows] == [0, 10]
        a = net(ids[:, 10:], attention_mask=mask, position_ids=pos[:, 10:], cache=chunked).logits
        whole = hf.SJKVCache(net, _exact(net))
        b = net(ids, attention_mask=mask, position_ids=pos, cache=whole).logits[:, 10:]
    assert [r.length(0) for r in chunked.rows] == [3, 20]
    assert chunked.get_seq_length() == 20
    real = mask[:, 10:].bool()
    # The same K/V rows reach the journals either way (bit-identical here); the tolerance only
    # allows for BLAS blocking differences in the fp32 projections on other machines.
    assert torch.allclose(a[real], b[real], atol=1e-3, rtol=0)
    # and each row's logits are its prompt's alone (fp32 DynamicCache; fp16 K/V rounding apart)
    net.set_attn_implementation("sdpa")
    for r, p in enumerate(prompts):
        with torch.no_grad():
            alone = net(torch.tensor([p]), cache=DynamicCache()).logits[0, -min(len(p), 10) :]
        assert (a[r, -alone.shape[0] :] - alone).abs().max() < 0.05


def test_bad_masks_raise_cache_error(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    net, tok = model_and_tokenizer
    ids = torch.tensor(_prompts(tok, [6, 6]))
    cases = [
        ([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], "left-padded"),  # right padding
        ([[0, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], "left-padded"),  # a hole
    ]
    for rows, message in cases:
        cache = hf.SJKVCache(net, _exact(net))
        with pytest.raises(CacheError, match=message), torch.no_grad():
            net(ids, attention_mask=torch.tensor(rows), cache=cache)
        assert cache.get_seq_length() == 0 and all(r.length(0) == 0 for r in cache.rows)
    cache = hf.SJKVCache(net, _exact(net))
    with torch.no_grad():
        net(ids, attention_mask=torch.ones_like(ids), cache=cache)
        with pytest.raises(CacheError, match="covers 1 positions"):
            net(ids[:, :1], attention_mask=torch.ones((2, 1), dtype=torch.long), cache=cache)
    with pytest.raises(CacheError, match="batch size"), torch.no_grad():
        net(ids[:1], cache=cache)


def _tiny_hybrid(window: int) -> Any:
    """A small randomly initialised Qwen2 alternating sliding-window and full-attention layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        use_sliding_window=True,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        # peaked logits: greedy choices differ by far more than fp16 rounding of K/V moves them
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float().eval()


def test_sliding_window_layers_stay_bounded() -> None:
    window = 8
    net = _tiny_hybrid(window)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 14)]
    ids, mask = _left_pad(prompts, 0)
    cfg = hf.config_for(net, staging="f16", min_tail=512, max_tail=1024, max_tokens=256)
    for beams in (1, 2):
        kw = dict(attention_mask=mask, num_beams=beams, pad_token_id=0)
        cache = hf.SJKVCache(net, cfg)
        assert isinstance(cache.layers[0], DynamicSlidingWindowLayer)
        assert isinstance(cache.layers[1], hf.SJKVLayer)
        out = _greedy(net, ids, cache, 24, **kw)
        for layer in (0, 2):
            assert cache.layers[layer].keys.shape[-2] <= window
        assert cache.get_seq_length() == ids.shape[1] + 23
        assert [r.length(1) for r in cache.rows] == [n + 23 for n in (5, 14) for _ in range(beams)]
        reference = _greedy(net, ids, DynamicCache(config=net.config), 24, **kw)
        assert out.tolist() == reference.tolist(), f"num_beams={beams}"


def test_truncation_is_batch_one_and_cuts_sliding_layers_too() -> None:
    window = 8
    net = _tiny_hybrid(window)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    cfg = hf.config_for(net, staging="f16", min_tail=512, max_tail=1024, max_tokens=256)
    cache = hf.SJKVCache(net, cfg)
    with torch.no_grad():
        net(ids[:, :6], cache=cache)
        assert cache.truncate(4) == 4
        assert cache.get_seq_length() == 4 and cache.sjkv.length(1) == 4
        assert cache.layers[0].get_seq_length() == 4  # the sliding layer is cut as well
        cache.crop(-1)
        assert cache.get_seq_length() == 3 and cache.layers[2].keys.shape[-2] == 3
        # the continuation equals a fresh run of the same tokens
        a = net(ids[:, 3:12], cache=cache).logits
        b = net(ids[:, :12], cache=hf.SJKVCache(net, cfg)).logits[:, 3:]
    # K/V of a 6-token and a 12-token chunk differ in the last fp32 bits, which fp16 staging can
    # round to neighbouring values (5e-4 here, on logits up to 8); a wrong cut moves them by ~1.
    assert torch.allclose(a, b, atol=5e-3, rtol=0)
    with pytest.raises(CacheError, match="sliding-window"):
        cache.truncate(2)  # the window has already dropped positions
    assert cache.get_seq_length() == 12
    batch = hf.SJKVCache(net, cfg)
    with torch.no_grad():
        net(ids[:, :4].repeat(2, 1), cache=batch)
    for cut in (lambda: batch.truncate(2), lambda: batch.crop(-1)):
        with pytest.raises(CacheError, match="rows"):
            cut()


def test_crop_follows_transformers_convention_and_refuses_non_integers() -> None:
    net = _tiny_hybrid(8)
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(5))
    cfg = hf.config_for(net, staging="f16", min_tail=512, max_tail=1024, max_tokens=256)
    cache = hf.SJKVCache(net, cfg)
    with torch.no_grad():
        net(ids, cache=cache)
    cache.crop(10)  # longer than the cache: nothing to cut
    assert cache.get_seq_length() == 7
    cache.crop(5)  # a positive length is the number of tokens kept
    assert cache.get_seq_length() == 5 and cache.sjkv.length(1) == 5
    cache.crop(-2)  # a negative one, the number removed
    assert cache.get_seq_length() == 3
    for bad in (2.5, "1", None, True):
        with pytest.raises(UnsupportedTypeError, match="max_length"):
            cache.crop(bad)
    with pytest.raises(CacheError, match="cannot remove 4 tokens from 3"):
        cache.crop(-4)
    assert cache.get_seq_length() == 3


def test_config_for_names_what_it_cannot_use() -> None:
    net = _tiny_hybrid(8)
    with pytest.raises(UnsupportedTypeError, match="nope"):
        hf.config_for(net, nope=1)
    with pytest.raises(UnsupportedTypeError, match="transformers model"):
        hf.config_for(None)
