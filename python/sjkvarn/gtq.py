"""Block-GTQ (seed 003): RoPE-block key-rate allocation for SJ-KVaRN body records.

1. Calibration (:func:`calibrate`): per layer, KV head and RoPE block ``i`` (channels ``i`` and
   ``i + D/2``), the score ``E_q[|q_i|^2] * E_k[|k_i|^2]`` from pre-RoPE activations of a
   calibration text, query energies pooled over the query heads that share the KV head. Saved as
   a small JSON next to a configuration (:meth:`BlockScores.save`).
2. Allocation (:meth:`BlockScores.schedules`): integer widths 1..8 per block with mean ``k_bits``
   minimising ``sum(score * 4^-bits)`` (Rust ``sjkvarn::gtq::allocate``, largest marginal gain).
3. Coding: ``Config(key_schedules=...)`` seals keys in the schedule's frame (equal-width blocks
   grouped, each group rotated); values, the sink and the staging ring are unchanged. Why:
   ``docs/block_gtq.md``.
4. Diagnostics (:func:`diagnostics`): seed 003's K-only protocol scaled to a small model: per
   layer, the RoPE-logit MAE and the attention KL of Block-GTQ against uniform allocation at the
   same average key bits, on held-out text.
"""

from __future__ import annotations

import inspect
import json
import os
import pydoc
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sjkvarn import _core

GROUP = 128


def calibration_text() -> str:
    """Default calibration text: stdlib material that none of the evaluation histories use."""
    import bisect
    import functools
    import heapq

    doc = pydoc.render_doc(functools, renderer=pydoc.plaintext)
    return inspect.getsource(heapq) + "\n\n" + inspect.getsource(bisect) + "\n\n" + doc


def heldout_text() -> str:
    """Default held-out text for the diagnostics (also unused by the evaluation histories)."""
    import difflib

    return inspect.getsource(difflib)


@dataclass
class BlockScores:
    """Calibrated RoPE-block scores, ``scores[layer, kv_head, block]``."""

    model: str
    tokens: int
    head_dim: int
    scores: np.ndarray

    @property
    def layers(self) -> int:
        return int(self.scores.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.scores.shape[1])

    def schedules(self, k_bits: int) -> list[list[list[int]]]:
        """Per layer and KV head, the widths of every RoPE block (mean exactly ``k_bits``)."""
        blocks = self.head_dim // 2
        return [
            [_core.gtq_allocate([float(s) for s in head], int(k_bits) * blocks) for head in layer]
            for layer in self.scores
        ]

    def save(self, path: str | os.PathLike[str]) -> None:
        data = {
            "format": "sjkvarn-block-scores-1",
            "model": self.model,
            "tokens": self.tokens,
            "head_dim": self.head_dim,
            "scores": self.scores.tolist(),
        }
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BlockScores:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != "sjkvarn-block-scores-1":
            raise ValueError(f"{path}: not an sjkvarn block-score file")
        scores = np.asarray(data["scores"], dtype=np.float64)
        if scores.ndim != 3 or scores.shape[2] * 2 != int(data["head_dim"]):
            shape, d = scores.shape, data["head_dim"]
            raise ValueError(f"{path}: scores of shape {shape} for head_dim {d}")
        if not np.all(np.isfinite(scores)) or np.any(scores < 0):
            raise ValueError(f"{path}: scores must be finite and non-negative")
        return cls(str(data["model"]), int(data["tokens"]), int(data["head_dim"]), scores)


def _geometry(model: Any) -> tuple[int, int, int, int]:
    c = model.config
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    d = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, heads, kv, d


def capture_qk(model: Any, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, pre-RoPE ``(q [T, q_heads, D], k [T, kv_heads, D])`` float32, from hooks on the
    attention's query and key projections."""
    layers, heads, kv, d = _geometry(model)
    found: dict[int, dict[str, torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for name, proj, h in (("q", attn.q_proj, heads), ("k", attn.k_proj, kv)):

            def hook(
                _m: Any, _inp: Any, out: torch.Tensor, i: int = i, name: str = name, h: int = h
            ) -> None:
                found.setdefault(i, {})[name] = out[0].detach().float().reshape(-1, h, d)

            hooks.append(proj.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hk in hooks:
            hk.remove()
    return [(found[i]["q"], found[i]["k"]) for i in range(layers)]


def block_energy(x: torch.Tensor) -> torch.Tensor:
    """``|x_i|^2 + |x_{i+D/2}|^2`` per RoPE block (the rotate-half layout)."""
    half = x.shape[-1] // 2
    return x[..., :half] ** 2 + x[..., half:] ** 2


def calibrate(
    model: Any, tokenizer: Any, text: str | None = None, tokens: int = 1024, name: str = "model"
) -> BlockScores:
    """Mean Q/K energy scores of every RoPE block from ``tokens`` tokens of ``text``."""
    text = calibration_text() if text is None else text
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    _, heads, kv, d = _geometry(model)
    per_layer = []
    for q, k in capture_qk(model, ids):
        eq = block_energy(q).mean(dim=0).reshape(kv, heads // kv, d // 2).mean(dim=1)
        ek = block_energy(k).mean(dim=0)
        per_layer.append((eq * ek).double().numpy())
    return BlockScores(name, int(ids.shape[1]), d, np.stack(per_layer))


def _rope(model: Any, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Applies the model's rotary embedding to ``x [T, H, D]`` at ``positions`` (rotate-half)."""
    cos, sin = model.model.rotary_emb(x, positions[None, :])
    cos, sin = cos[0][:, None, :].float(), sin[0][:, None, :].float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def roundtrip_keys(k: torch.Tensor, k_bits: int, block_bits: list[int] | None) -> torch.Tensor:
    """Seals post-RoPE keys ``[T, D]`` (T a multiple of 128) as body records and decodes them:
    Block-GTQ frame with ``block_bits``, else the scalar body's Hadamard frame."""
    raw = _core.gtq_roundtrip_keys(k.contiguous().numpy(), int(k_bits), block_bits)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy()).reshape(k.shape)


def diagnostics(
    model: Any,
    tokenizer: Any,
    scores: BlockScores,
    bits: tuple[int, ...] = (2, 3),
    text: str | None = None,
    tokens: int = 1024,
    sink: int = 0,
) -> dict[str, Any]:
    """Seed 003's K-only diagnostics on held-out text: keys sealed at ``b`` average bits with
    Block-GTQ widths, with uniform widths through the same codec, and with the scalar body;
    values exact, no ring; ``sink`` first keys kept exact (0: the seed's protocol; 128: what the
    SJ-KVaRN journal does). Per layer: mean |logit error| over every causal (query, key) pair of
    the second half of the text (unscaled logits, all query heads), and the mean KL of the
    attention rows (softmax of logits / sqrt(D))."""
    if sink % GROUP:
        raise ValueError(f"sink must be a multiple of {GROUP}")
    text = heldout_text() if text is None else text
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    t = ids.shape[1] // GROUP * GROUP
    ids = ids[:, :t]
    _, heads, kv, d = _geometry(model)
    group = heads // kv
    positions = torch.arange(t)
    first_query = t // 2
    causal = positions[None, :] <= positions[first_query:, None]  # [Tq, T]
    out: dict[str, Any] = {"tokens": t, "bits": list(bits), "sink": sink, "layers": []}
    schedules = {b: scores.schedules(b) for b in bits}
    for li, (q_pre, k_pre) in enumerate(capture_qk(model, ids)):
        q = _rope(model, q_pre, positions)[first_query:]  # [Tq, H, D]
        k = _rope(model, k_pre, positions)  # [T, KV, D]
        row: dict[str, Any] = {"layer": li}
        for b in bits:
            variants = {
                "block_gtq": [schedules[b][li][h] for h in range(kv)],
                "uniform": [[b] * (d // 2)] * kv,
                "scalar_body": [None] * kv,
            }
            for name, per_head in variants.items():
                mae_sum, kl_sum = 0.0, 0.0
                for h in range(kv):
                    k_hat = k[:, h].clone()
                    k_hat[sink:] = roundtrip_keys(k[sink:, h], b, per_head[h])
                    qh = q[:, h * group : (h + 1) * group].transpose(0, 1)  # [G, Tq, D]
                    s = qh @ k[:, h].T
                    s_hat = qh @ k_hat.T
                    err = (s - s_hat).abs()
                    mae_sum += float(err[:, causal].mean())
                    neg = torch.finfo(torch.float32).min
                    lp = torch.log_softmax((s / d**0.5).masked_fill(~causal, neg), dim=-1)
                    lq = torch.log_softmax((s_hat / d**0.5).masked_fill(~causal, neg), dim=-1)
                    kl = (lp.exp() * (lp - lq)).masked_fill(~causal, 0.0).sum(-1)
                    kl_sum += float(kl.mean())
                row[f"mae_{name}_{b}"] = mae_sum / kv
                row[f"kl_{name}_{b}"] = kl_sum / kv
        out["layers"].append(row)
    for b in bits:
        rows = out["layers"]
        out[f"wins_{b}"] = sum(r[f"mae_block_gtq_{b}"] < r[f"mae_uniform_{b}"] for r in rows)
        for name in ("block_gtq", "uniform", "scalar_body"):
            out[f"mean_mae_{name}_{b}"] = float(np.mean([r[f"mae_{name}_{b}"] for r in rows]))
            out[f"mean_kl_{name}_{b}"] = float(np.mean([r[f"kl_{name}_{b}"] for r in rows]))
    return out


def render(diag: dict[str, Any]) -> str:
    """The per-layer diagnostics table in Markdown."""
    lines = []
    for b in diag["bits"]:
        sink = diag.get("sink", 0)
        kept = f", first {sink} keys exact" if sink else ""
        lines.append(f"\nK{b} (keys only, {diag['tokens']} held-out tokens{kept})\n")
        lines.append(
            "| layer | MAE uniform | MAE Block-GTQ | change | MAE scalar body | "
            "KL uniform | KL Block-GTQ | KL scalar body |"
        )
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in diag["layers"]:
            u, g = r[f"mae_uniform_{b}"], r[f"mae_block_gtq_{b}"]
            lines.append(
                f"| {r['layer']} | {u:.4f} | {g:.4f} | {100 * (g / u - 1):+.1f}% | "
                f"{r[f'mae_scalar_body_{b}']:.4f} | {r[f'kl_uniform_{b}']:.2e} | "
                f"{r[f'kl_block_gtq_{b}']:.2e} | {r[f'kl_scalar_body_{b}']:.2e} |"
            )
        n = len(diag["layers"])
        u, g = diag[f"mean_mae_uniform_{b}"], diag[f"mean_mae_block_gtq_{b}"]
        lines.append(
            f"| mean | {u:.4f} | {g:.4f} | {100 * (g / u - 1):+.1f}% | "
            f"{diag[f'mean_mae_scalar_body_{b}']:.4f} | {diag[f'mean_kl_uniform_{b}']:.2e} | "
            f"{diag[f'mean_kl_block_gtq_{b}']:.2e} | {diag[f'mean_kl_scalar_body_{b}']:.2e} |"
        )
        lines.append(f"\nBlock-GTQ has the lower MAE in {diag[f'wins_{b}']} of {n} layers.")
    return "\n".join(lines)
