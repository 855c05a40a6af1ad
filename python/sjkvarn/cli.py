"""The ``sjkvarn`` command.

``sjkvarn`` (or ``sjkvarn eval``) measures what each cache format costs in next-token KL where
SJ-KVaRN is meant to work: Gemma 3 270M (256-wide heads) over 16K-token histories of real local
text, with the journal ``Config()`` ships, so sealed records hold most of the cache
(``--preset main``; ``--preset small`` is the quick SmolLM2 run at 1,024 tokens).
``sjkvarn memory`` computes allocations and the largest context in a budget; ``sjkvarn formats``
prints every codec format's error on seeded synthetic tiles.
"""

from __future__ import annotations

import argparse
import sys

from sjkvarn import memory
from sjkvarn.eval import report
from sjkvarn.memory import KNOWN_MODELS

MODEL_HELP = "gemma3 (main and seed presets), smollm2 (small), a GGUF file or a local HF folder"

# What each preset runs on unless told otherwise: model, history and scored tokens, histories.
PRESETS = {
    # 16,640 history tokens: with the default 2,048..3,072-token ring the scored positions see
    # about 85% of the cache sealed (with the reference's 4,096..8,192 ring, about 73%).
    "main": ("gemma3", 16640, 256),
    "small": ("smollm2", 1024, 128),
    "seed": ("gemma3", 12288, 256),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sjkvarn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    fmt = sub.add_parser("formats", help="format sizes and error tables on synthetic tiles")
    fmt.add_argument("--seed", type=int, default=20261129)
    fmt.add_argument("--tiles", type=int, default=16, help="128-token tiles per distribution")
    fmt.add_argument("--head-dim", type=int, default=128, choices=[64, 128, 256, 512])
    mem = sub.add_parser("memory", help="cache allocation per format and the largest context")
    mem.add_argument("--model", help="known model: " + ", ".join(KNOWN_MODELS))
    mem.add_argument("--layers", type=int)
    mem.add_argument("--kv-heads", type=int)
    mem.add_argument("--head-dim", type=int)
    mem.add_argument("--context", type=int, default=110_592)
    mem.add_argument("--budget-gb", type=float, default=None, help="find the largest context")
    ev = sub.add_parser("eval", help="KL of every cache arm against an exact cache (default)")
    ev.add_argument("--model", default=None, help=MODEL_HELP)
    ev.add_argument(
        "--text", action="extend", nargs="+", default=None, help="history files (repeatable)"
    )
    ev.add_argument(
        "--histories",
        nargs="+",
        default=None,
        help="run only these of the preset's histories (main: code tool-calls; seed: code "
        "prose docs tool-calls; small: coding prose agentic)",
    )
    ev.add_argument(
        "--preset",
        choices=list(PRESETS),
        default="main",
        help="main (default): Gemma 3 270M, code and tool-call histories of 16,640 tokens, the "
        "real 4,096/8,192 tails, five arms (sealed records hold most tokens); small: SmolLM2, "
        "three 1,024-token histories, tails scaled down, every arm; seed: Gemma 3 270M, four "
        "histories of 12,288 tokens, all 14 seed arms",
    )
    ev.add_argument(
        "--history-tokens", type=int, default=None, help="main 16640, small 1024, seed 12288"
    )
    ev.add_argument("--scored-tokens", type=int, default=None, help="main and seed 256, small 128")
    ev.add_argument("--mode", choices=["teacher", "greedy", "sample"], default="teacher")
    ev.add_argument("--arms", nargs="+", default=None, help="subset of arm names")
    ev.add_argument(
        "--exact-recent",
        type=int,
        default=None,
        help="exact window of the SJ-KVaRN arms on Config()'s journal (default: Config()'s)",
    )
    ev.add_argument(
        "--centre-keys",
        choices=("true", "false"),
        default=None,
        help="centred keys in the SJ-KVaRN arms on Config()'s journal (default: Config()'s)",
    )
    ev.add_argument(
        "--sj-tail",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=None,
        help="small preset: the SJ-KVaRN arms' ring (default: scaled to --history-tokens; "
        "2048 3072 is Config()'s own)",
    )
    ev.add_argument(
        "--kvarn-tail",
        type=int,
        default=None,
        help="small preset: KVarN's exact tail (default: scaled to --history-tokens; 1024 is "
        "the paper's)",
    )
    ev.add_argument(
        "--baseline",
        default=None,
        help="the arm every ratio is paired against (default: KVarN 4/4 tail 0; with --merge, "
        "the first run's)",
    )
    ev.add_argument("--out", default="sjkvarn-eval", help="folder for results.json, report.md, PNG")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument(
        "--task",
        choices=["kl", "needles", "positions"],
        default="kl",
        help="kl: KL over scored positions after each history (default); needles: facts asked "
        "back at several distances; positions: KL against position over one long history",
    )
    ev.add_argument(
        "--context-tokens",
        type=int,
        default=None,
        help="needles and positions: sequence length (main and seed: 30720; small: 1536 and 4096)",
    )
    ev.add_argument(
        "--needle-layout",
        choices=["single", "shared"],
        default=None,
        help="needles: one fact per sequence, or all distances in one (main and seed: shared; "
        "small: single)",
    )
    ev.add_argument(
        "--bin-tokens", type=int, default=1024, help="positions: tokens per reported bin"
    )
    ev.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch and sjkvarn's attention (default: all cores); the figures "
        "move slightly with it, the report records it",
    )
    ev.add_argument(
        "--merge",
        nargs="+",
        metavar="RESULTS_JSON",
        help="merge the results.json of runs of the same settings that ran different arms "
        "or histories into one report under --out, every ratio paired against --baseline "
        "over the same positions (runs no model)",
    )
    ev.add_argument(
        "--allow-other-texts",
        action="store_true",
        help="--merge: accept histories whose texts differ between the runs (named in the report)",
    )
    an = sub.add_parser("analyze", help="per-layer statistics and rounding errors of a KV cache")
    an.add_argument("--model", default=None, help=MODEL_HELP)
    an.add_argument("--text", default=None, help="text file (default: stdlib sources)")
    an.add_argument("--tokens", type=int, default=1024)
    an.add_argument("--out", default=None, help="write the full results as JSON here")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["eval", *argv]
    args = parser.parse_args(argv)
    model_commands = {"eval": run_eval, "analyze": run_analyze}
    if args.command in model_commands:
        missing = missing_eval_packages()
        if missing:
            print(
                f"sjkvarn {args.command} needs the evaluation extra (missing: "
                f"{', '.join(missing)}): pip install 'sjkvarn[eval]' "
                "(from a checkout: pip install '.[eval]')",
                file=sys.stderr,
            )
            return 2
        from sjkvarn.eval import models

        try:
            return model_commands[args.command](args, parser)
        except models.ModelNotFound as e:
            print(f"sjkvarn {args.command}: {e}", file=sys.stderr)
            return 2
    if args.command == "memory":
        try:
            geo = memory.geometry(args.model, args.layers, args.kv_heads, args.head_dim)
        except ValueError as e:
            parser.error(str(e))
        if args.context < 1:
            parser.error("--context must be at least 1")
        print(f"{geo.layers} full-attention layers x {geo.kv_heads} KV heads x {geo.head_dim}")
        print(
            memory.render(
                memory.table(geo, args.context, args.budget_gb), args.context, args.budget_gb
            )
        )
        return 0
    if args.command == "formats":
        seed = getattr(args, "seed", 20261129)
        tiles = getattr(args, "tiles", 16)
        head_dim = getattr(args, "head_dim", 128)
        if tiles < 1:
            parser.error("--tiles must be at least 1")
        dists = report.synthetic_tiles(seed, tiles, head_dim)
        print(f"normalised MSE on {tiles} seeded tiles of 128 tokens x {head_dim} channels")
        print(report.render(report.error_table(dists)))
        return 0
    parser.print_help(sys.stderr)
    return 2


# The modules the evaluation harness imports beyond numpy (the `eval` extra in pyproject.toml).
EVAL_MODULES = ("torch", "transformers", "gguf", "tqdm", "matplotlib")


def missing_eval_packages() -> list[str]:
    """Names of the `eval` extra's packages that are not importable here."""
    import importlib.util

    return [m for m in EVAL_MODULES if importlib.util.find_spec(m) is None]


def run_eval(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pathlib import Path

    from sjkvarn.eval import evaluation, histories, models

    if args.merge:
        return merge_results(args)
    if args.baseline is None:
        args.baseline = evaluation.DEFAULT_BASELINE
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        set_threads(args.threads)
    # main and seed: the method's own regime (Gemma 3 270M, the real tails, long contexts)
    long = args.preset != "small"
    if args.task != "kl" and long:
        # the long needle and position tasks are the same under main and seed
        args.preset = "seed"
    model, history_tokens, scored_tokens = PRESETS[args.preset]
    if args.history_tokens is None:
        args.history_tokens = history_tokens
    if args.scored_tokens is None:
        args.scored_tokens = scored_tokens
    if args.history_tokens < 256 or args.scored_tokens < 1:
        parser.error("--history-tokens must be at least 256 and --scored-tokens at least 1")
    if (args.sj_tail or args.kvarn_tail is not None) and args.preset != "small":
        parser.error("--sj-tail and --kvarn-tail apply to the small preset's arms")
    if args.sj_tail and not 0 <= args.sj_tail[0] <= args.sj_tail[1]:
        parser.error(f"--sj-tail needs 0 <= MIN <= MAX, got {args.sj_tail[0]} {args.sj_tail[1]}")
    if args.kvarn_tail is not None and args.kvarn_tail < 0:
        parser.error(f"--kvarn-tail must be at least 0, got {args.kvarn_tail}")
    if args.text:
        hist = [histories.from_file(p) for p in args.text]
    else:
        hist = {
            "main": histories.main_job,
            "seed": histories.seed_scale,
            "small": histories.defaults,
        }[args.preset]()
    if args.histories:
        unknown = set(args.histories) - {h.name for h in hist}
        if unknown:
            parser.error(f"unknown histories {sorted(unknown)}; known: {[h.name for h in hist]}")
        hist = [h for h in hist if h.name in args.histories]
    net, tok = models.load(args.model or model)
    if args.context_tokens is None:
        args.context_tokens = 30720 if long else {"needles": 1536}.get(args.task, 4096)
    need = args.context_tokens if args.task != "kl" else args.history_tokens + args.scored_tokens
    limit = getattr(net.config, "max_position_embeddings", None)
    if limit is not None and need > limit:
        print(
            f"sjkvarn eval: {need} positions needed but the model takes at most {limit} "
            "(--history-tokens/--scored-tokens or --context-tokens set the length)",
            file=sys.stderr,
        )
        return 2
    if args.task != "kl" and args.arms is None and long:
        # every seed arm at 30K tokens would take hours here: the ones the question is about
        from sjkvarn.eval import positions

        args.arms = list(positions.DEFAULT_ARMS)
    if args.task == "needles":
        return run_needles(args, net, tok, hist)
    if args.task == "positions":
        return run_positions(args, net, tok, hist)
    if long:
        # The method's own tails: at 16K tokens sealed records hold most of the cache.
        sj_tail, kvarn_tail = (4096, 8192), 1024
    else:
        sj_tail, kvarn_tail = scaled_tails(args.history_tokens)
    if args.sj_tail:
        sj_tail = (args.sj_tail[0], args.sj_tail[1])
    if args.kvarn_tail is not None:
        kvarn_tail = args.kvarn_tail
    settings = evaluation.EvalSettings(
        history_tokens=args.history_tokens,
        scored_tokens=args.scored_tokens,
        mode=args.mode,
        seed=args.seed,
        baseline=args.baseline,
        sj_tail=sj_tail,
        kvarn_tail=kvarn_tail,
        arms=args.arms,
        preset=args.preset,
        sj_exact_recent=args.exact_recent,
        sj_centre_keys=None if args.centre_keys is None else args.centre_keys == "true",
    )
    try:
        report = evaluation.evaluate(net, tok, hist, settings)
    except ValueError as e:
        print(f"sjkvarn eval: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    evaluation.write_outputs(report, out)
    print(evaluation.render_table(report))
    print(f"\nwrote {out / 'results.json'}, {out / 'report.md'}, {out / 'kl_vs_bits.png'}")
    return 0


def set_threads(n: int) -> None:
    """Runs torch and sjkvarn's attention on ``n`` threads. sjkvarn's pool reads
    ``RAYON_NUM_THREADS`` when it first starts, which is after this (no attention has run yet)."""
    import os

    import torch

    os.environ["RAYON_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def scaled_tails(tokens: int) -> tuple[tuple[int, int], int]:
    """SJ-KVaRN's min/max tail and KVarN's exact tail scaled to a context shorter than the
    method's (128/256 and 64 at 1,024 tokens; 4,096/8,192 and 1,024 at full scale)."""
    scale = tokens / 1024
    return (max(128, int(128 * scale)), max(256, int(256 * scale))), max(64, int(64 * scale))


def merge_results(args: argparse.Namespace) -> int:
    """`sjkvarn eval --merge A/results.json B/results.json --out DIR`."""
    import json
    from pathlib import Path

    from sjkvarn.eval import evaluation

    try:
        reports = [json.loads(Path(p).read_text()) for p in args.merge]
        report = evaluation.merge_reports(
            reports, allow_other_texts=args.allow_other_texts, baseline=args.baseline
        )
    except (OSError, ValueError, KeyError) as e:
        print(f"sjkvarn eval --merge: {e!s}", file=sys.stderr)
        return 2
    out = Path(args.out)
    evaluation.write_outputs(report, out)
    print(evaluation.render_table(report))
    print(f"\nwrote {out / 'results.json'}, {out / 'report.md'}, {out / 'kl_vs_bits.png'}")
    return 0


def run_analyze(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import json
    from pathlib import Path

    from tqdm import tqdm

    from sjkvarn.eval import analyze, histories, models

    if args.tokens < 128:
        parser.error("--tokens must be at least 128")
    net, tok = models.load(args.model)
    text = histories.from_file(args.text).text if args.text else histories.coding().text
    layers = analyze.capture(net, tok, text, args.tokens)
    rows = [analyze.analyze_layer(k, v) for k, v in tqdm(layers, desc="layers", unit="layer")]
    print(
        f"normalised MSE per layer over {layers[0][0].shape[0]} tokens "
        "(mm = per-token min-max, rot = rotated min-max, chan = per-channel min-max)"
    )
    print(analyze.render(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.out}")
    return 0


def run_needles(args: argparse.Namespace, net: object, tok: object, hist: list) -> int:  # type: ignore[type-arg]
    import json
    from pathlib import Path

    from sjkvarn.eval import needles

    c = args.context_tokens
    seed = args.preset == "seed"
    # seed: 2K, 8K, 16K and 28K tokens back at 30,720 (the seed's needle distances)
    fractions = (1 / 15, 4 / 15, 8 / 15, 14 / 15) if seed else (1 / 12, 1 / 4, 1 / 2, 5 / 6)
    distances = tuple(sorted({max(64, int(c * f)) for f in fractions}))
    settings = needles.NeedleSettings(
        context_tokens=c,
        distances=distances,
        seed=args.seed,
        baseline=args.baseline,
        arms=args.arms,
        preset=args.preset,
        layout=args.needle_layout or ("shared" if seed else "single"),
    )
    haystacks = [h for h in hist if h.name in ("coding", "code", "prose")] or hist
    try:
        report = needles.evaluate_needles(net, tok, haystacks, settings)
    except ValueError as e:
        print(f"sjkvarn eval: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "needles.json").write_text(json.dumps(report, indent=2))
    print(needles.render(report))
    print(f"\nwrote {out / 'needles.json'}")
    return 0


def run_positions(args: argparse.Namespace, net: object, tok: object, hist: list) -> int:  # type: ignore[type-arg]
    from pathlib import Path

    from sjkvarn.eval import positions

    c = args.context_tokens
    sj_tail, kvarn_tail = scaled_tails(c)
    settings = positions.PositionSettings(
        context_tokens=c,
        bin_tokens=args.bin_tokens,
        seed=args.seed,
        baseline=args.baseline,
        arms=args.arms,
        preset=args.preset,
        sj_tail=sj_tail,
        kvarn_tail=kvarn_tail,
    )
    try:
        report, kl = positions.evaluate_positions(net, tok, hist[0], settings)
    except ValueError as e:
        print(f"sjkvarn eval: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    positions.write_outputs(report, kl, out)
    print(positions.render(report))
    written = ", ".join(str(out / f) for f in positions.OUTPUTS)
    print(f"\nwrote {written}")
    return 0
