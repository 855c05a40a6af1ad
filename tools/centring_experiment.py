"""Attention-output error of one-layer caches whose keys are centred before they are appended.

Uses the diagnosis's capture (``sjkvarn.eval.diagnose``): one exact forward pass of Gemma 3
270M per history captures each full-attention layer's queries at the scored positions and its
keys and values everywhere; each configuration stores one layer alone and attends the captured
queries. Centring is applied here, to the captured keys, before they are appended (every
position, sink included, so scores move by the same ``q . mu`` and softmax does not see it):
``sink`` subtracts the mean key of positions 0..127, ``nobos`` of positions 1..127 (what
``Config(centre_keys=True)`` stores), ``all`` the mean over the whole history (not causal: a
bound). Writes the mean error per configuration and layer over histories as JSON.

``python tools/centring_experiment.py 16640 out.json [history files...]`` (the seed preset's four
histories by default). Data of ``docs/results/quality.md``: ``docs/results/data/
gemma3_centring_16k.json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch

from sjkvarn.eval import diagnose, evaluation, histories, models

#: Keys as appended in the cache itself (``centre_keys=False``): centring happens here.
DEFAULT_SHAPE: dict[str, Any] = dict(
    min_tail=2048, max_tail=3072, staging="q8_0/tq6_0", centre_keys=False
)
CONFIGS: dict[str, tuple[dict[str, Any], str | None]] = {
    "tail1024": (dict(diagnose.FAITHFUL, min_tail=1024, max_tail=1152), None),
    "default": (DEFAULT_SHAPE, None),
    "default c-sink": (DEFAULT_SHAPE, "sink"),
    "default c-sink-nobos": (DEFAULT_SHAPE, "nobos"),
    "default c-all": (DEFAULT_SHAPE, "all"),
    "q8q8 2048/3072": (dict(DEFAULT_SHAPE, staging="q8_0"), None),
    "q8q8 c-sink-nobos": (dict(DEFAULT_SHAPE, staging="q8_0"), "nobos"),
    "tq6 c-nobos 2048/3072": (dict(DEFAULT_SHAPE, staging="tq6_0"), "nobos"),
    "tq6 c-nobos 4096/8192": (
        dict(DEFAULT_SHAPE, min_tail=4096, max_tail=8192, staging="tq6_0"),
        "nobos",
    ),
}


def centred(c: diagnose.Captured, how: str | None) -> diagnose.Captured:
    """``c`` with every key minus the mean ``how`` names (unchanged for ``None``)."""
    k = c.k
    if how == "sink":
        k = k - k[:128].mean(0, keepdim=True)
    elif how == "nobos":
        k = k - k[1:128].mean(0, keepdim=True)
    elif how == "all":
        k = k - k.mean(0, keepdim=True)
    return diagnose.Captured(c.q, k, c.v, c.scale)


def main() -> int:
    tokens, out = int(sys.argv[1]), sys.argv[2]
    torch.set_grad_enabled(False)
    net, tok = models.load("gemma3")
    settings = evaluation.EvalSettings(history_tokens=tokens, scored_tokens=256, preset="seed")
    texts = sys.argv[3:]
    hist = [histories.from_file(p) for p in texts] if texts else histories.seed_scale()
    result: dict[str, dict[int, list[float]]] = {}
    for h in hist:
        ids = evaluation.prepare_ids(net, tok, h, settings)
        for layer, c in sorted(diagnose.capture_layers(net, ids, 256).items()):
            want, _ = diagnose.exact_attention(c)
            for name, (overrides, how) in CONFIGS.items():
                got, _ = diagnose.cached_attention(centred(c, how), overrides)
                error = float(diagnose.relative_error(got, want).mean())
                result.setdefault(name, {}).setdefault(layer, []).append(error)
        print(h.name, "done", flush=True)
    for name, layers in result.items():
        print(name, [round(float(np.mean(v)), 4) for _, v in sorted(layers.items())])
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
