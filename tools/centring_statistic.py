"""Whether the sink's mean key describes the keys that follow it, per full-attention layer.

``Config(centre_keys=True)`` subtracts the mean key of positions 1..127 from every key, which
pays where the keys share an offset: the rounding of the ring and the records then meets smaller
numbers. Per layer, KV head and history this prints and saves

* ``later``: energy of the keys after the sink once centred, over their energy as appended
  (below 1: centring shrinks the keys it is applied to; it uses the whole history, not causal);
* ``within_sink``: the same ratio inside the sink, positions 64..127 centred on the mean of
  1..63 (what a cache could know when the sink completes);
* ``offset_share``: the mean key's energy over the sink keys' mean energy.

``python tools/centring_statistic.py MODEL TOKENS out.json`` (``smollm2 7936`` or ``gemma3
16640``; the seed preset's four tuning histories). Data of ``docs/results/quality.md``:
``docs/results/data/centring_key_energy.json``.
"""

from __future__ import annotations

import json
import sys

import torch

from sjkvarn.eval import diagnose, evaluation, histories, models

#: Sink positions, and the first one the mean leaves out (the first token's key is an outlier).
SINK, FIRST = 128, 1


def energy_ratio(keys: torch.Tensor, mean: torch.Tensor) -> float:
    """Mean squared norm of ``keys - mean`` over that of ``keys`` (``[N, kv, d]``)."""
    return float(((keys - mean) ** 2).sum(-1).mean() / (keys**2).sum(-1).mean())


def layer_statistics(k: torch.Tensor) -> dict[str, float]:
    k = k.double()
    mean = k[FIRST:SINK].mean(0)
    half = SINK // 2
    return {
        "later": energy_ratio(k[SINK:], mean),
        "within_sink": energy_ratio(k[half:SINK], k[FIRST:half].mean(0)),
        "offset_share": float((mean**2).sum(-1).mean() / (k[FIRST:SINK] ** 2).sum(-1).mean()),
    }


def main(argv: list[str]) -> int:
    model_name, tokens, out = argv[0], int(argv[1]), argv[2]
    net, tok = models.load(model_name)
    settings = evaluation.EvalSettings(history_tokens=tokens, scored_tokens=16, preset="seed")
    result: dict[str, dict[str, dict[str, float]]] = {}
    for h in histories.seed_scale():
        ids = evaluation.prepare_ids(net, tok, h, settings)
        layers = diagnose.capture_layers(net, ids, 16)
        result[h.name] = {str(i): layer_statistics(c.k) for i, c in sorted(layers.items())}
        for i, s in result[h.name].items():
            print(f"{h.name} layer {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()))
    with open(out, "w") as f:
        json.dump({"model": model_name, "history_tokens": tokens, "histories": result}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
