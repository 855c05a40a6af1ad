"""Merging eval reports of runs that ran different arms of the same settings."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("torch")

from sjkvarn.eval import evaluation  # noqa: E402

BASE = "KVarN 4/4 tail 0"


def _report(arms: dict[str, tuple[float, float]], base_mean: float) -> dict:
    entries = {}
    for name, (bits, mean) in arms.items():
        ratio = mean / base_mean
        entries[name] = {
            "mean": mean,
            "median": mean / 2,
            "p90": 2 * mean,
            "p99": 5 * mean,
            "top1": 0.97,
            "bits_per_value": bits,
            "allocated_mib": 10.0,
            "allocated_bits": bits + 0.3,
            "seconds": 60.0,
            "positions": 1024,
            "ratio": {
                "point": ratio,
                "ci_positions": [0.8 * ratio, 1.2 * ratio],
                "ci_histories": [0.7 * ratio, 1.3 * ratio],
            },
        }
    return {
        "settings": {
            "seed": 0,
            "baseline": BASE,
            "sj_tail": [4096, 8192],
            "kvarn_tail": 1024,
            "bootstrap": 2000,
            "arms": list(arms),
            "preset": "seed",
            "history_tokens": 12288,
            "scored_tokens": 256,
            "mode": "teacher",
        },
        "histories": ["code", "prose"],
        "environment": {
            "python": "3.11.7",
            "torch": "2.15.0",
            "history_sha256": {"code": "5949d4e7acdaee31", "prose": "71f2ff5d99bdc1f9"},
        },
        "distinct_scored_tokens": [100, 120],
        "arms": entries,
    }


def _two_runs() -> tuple[dict, dict]:
    a = _report(
        {BASE: (4.64, 1.1e-2), "SJ-KVaRN 4/4": (5.6, 4.7e-3), "q8_0/q8_0": (8.5, 3e-4)}, 1.1e-2
    )
    b = _report(
        {BASE: (4.64, 1.2e-2), "SJ-KVaRN 3/2t": (5.1, 6e-3), "turbo3/turbo3": (3.1, 2e-1)}, 1.2e-2
    )
    return a, b


def test_merged_report_keeps_each_arm_from_its_first_run() -> None:
    a, b = _two_runs()
    merged = evaluation.merge_reports([a, b])
    assert list(merged["arms"]) == [
        BASE,
        "SJ-KVaRN 4/4",
        "q8_0/q8_0",
        "SJ-KVaRN 3/2t",
        "turbo3/turbo3",
    ]
    assert merged["arms"][BASE] == a["arms"][BASE]  # the first run's baseline
    assert merged["arms"]["SJ-KVaRN 3/2t"] == b["arms"]["SJ-KVaRN 3/2t"]
    assert merged["settings"]["arms"] == list(merged["arms"])
    assert [r["baseline_mean"] for r in merged["merged_from"]] == [1.1e-2, 1.2e-2]
    assert [r["arms"] for r in merged["merged_from"]] == [list(a["arms"]), list(b["arms"])]
    text = evaluation.render_markdown(merged)
    assert "Merged from 2 runs" in text and "1.100e-02, 1.200e-02" in text
    assert text.count("| turbo3/turbo3 |") == 1
    # The inputs are left as they were.
    assert list(a["arms"]) == [BASE, "SJ-KVaRN 4/4", "q8_0/q8_0"]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r["settings"].update(history_tokens=1024), "history_tokens"),
        (lambda r: r.update(histories=["code", "docs"]), "other histories"),
        (lambda r: r["environment"]["history_sha256"].update(code="0" * 16), "other texts"),
        (lambda r: r["arms"].pop(BASE), "baseline"),
    ],
)
def test_runs_that_do_not_match_are_refused(change, message: str) -> None:
    a, b = _two_runs()
    before = copy.deepcopy(a)
    change(b)
    with pytest.raises(ValueError, match=message):
        evaluation.merge_reports([a, b])
    assert a == before
    with pytest.raises(ValueError, match="at least two"):
        evaluation.merge_reports([a])


def test_cli_merges_results_files_and_reports_bad_ones(tmp_path: Path) -> None:
    a, b = _two_runs()
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = tmp_path / "merged"
    cmd = [sys.executable, "-m", "sjkvarn", "eval", "--merge"]
    done = subprocess.run(
        [*cmd, str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    merged = json.loads((out / "results.json").read_text())
    assert len(merged["arms"]) == 5
    assert (out / "kl_vs_bits.png").stat().st_size > 10_000
    assert "Merged from 2 runs" in (out / "report.md").read_text()
    (tmp_path / "bad.json").write_text("{not json")
    done = subprocess.run(
        [*cmd, str(tmp_path / "a.json"), str(tmp_path / "bad.json"), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "sjkvarn eval --merge" in done.stderr
    assert not (tmp_path / "x").exists()


def test_other_texts_merge_only_when_allowed_and_are_named() -> None:
    a, b = _two_runs()
    b["environment"]["history_sha256"]["prose"] = "0" * 16
    with pytest.raises(ValueError, match=r"other texts for the histories \['prose'\]"):
        evaluation.merge_reports([a, b])
    merged = evaluation.merge_reports([a, b], allow_other_texts=True)
    assert merged["other_texts"] == ["prose"]
    assert "texts differ for the histories ['prose']" in evaluation.render_markdown(merged)


def _one_history_run(name: str, kl: dict[str, list[float]]) -> dict:
    """A run over one history, with per-position KL as `evaluate` writes it."""
    report = _report({arm: (4.5, float(sum(v) / len(v))) for arm, v in kl.items()}, 1.0)
    report["histories"] = [name]
    report["distinct_scored_tokens"] = [len(next(iter(kl.values())))]
    for arm, values in kl.items():
        report["arms"][arm]["per_position"] = {"kl": values, "history": [0] * len(values)}
    return report


def test_runs_over_different_histories_pool_into_one_report() -> None:
    runs = [
        _one_history_run("a", {BASE: [1.0, 3.0], "SJ-KVaRN 4/4": [0.5, 0.5], "x": [9.0, 9.0]}),
        _one_history_run("b", {BASE: [2.0, 2.0], "SJ-KVaRN 4/4": [1.0, 3.0]}),
        _one_history_run("c", {BASE: [4.0, 4.0], "SJ-KVaRN 4/4": [1.0, 1.0]}),
    ]
    pooled = evaluation.merge_reports(runs)
    assert pooled["histories"] == ["a", "b", "c"]
    assert list(pooled["arms"]) == [BASE, "SJ-KVaRN 4/4"]  # "x" ran on one history only
    sj = pooled["arms"]["SJ-KVaRN 4/4"]
    assert sj["per_position"]["history"] == [0, 0, 1, 1, 2, 2]
    assert sj["mean"] == pytest.approx(7.0 / 6)
    assert sj["ratio"]["point"] == pytest.approx(7.0 / 16)
    lo, hi = sj["ratio"]["ci_histories"]
    # Resampling whole histories: the interval spans the per-history ratios' range.
    assert 0.25 - 1e-9 <= lo <= 7.0 / 16 <= hi <= 1.0 + 1e-9
    with pytest.raises(ValueError, match="different histories"):
        evaluation.pool_histories([runs[0], runs[0]])


def _per_position_run(kl: dict[str, list[float]], baseline: str) -> dict:
    """A run over both histories (two positions each) with per-position KL and ``baseline``."""
    report = _one_history_run("code", kl)
    report["histories"] = ["code", "prose"]
    report["settings"]["baseline"] = baseline
    for arm in kl:
        report["arms"][arm]["per_position"]["history"] = [0, 0, 1, 1]
    return evaluation.with_ratios(report)


def test_an_arm_run_alone_is_paired_against_the_baseline_of_another_run() -> None:
    base, sj, new = [1.0, 2.0, 4.0, 8.0], [0.5, 0.5, 1.0, 2.0], [2.0, 2.0, 2.0, 2.0]
    earlier = _per_position_run({BASE: base, "SJ-KVaRN 4/4": sj}, BASE)
    alone = _per_position_run({"SJ-KVaRN 3/2t": new}, "SJ-KVaRN 3/2t")
    assert alone["arms"]["SJ-KVaRN 3/2t"]["ratio"]["point"] == 1.0  # its own baseline
    merged = evaluation.merge_reports([earlier, alone])
    together = evaluation.with_ratios(
        _per_position_run({BASE: base, "SJ-KVaRN 4/4": sj, "SJ-KVaRN 3/2t": new}, BASE)
    )
    assert merged["settings"]["baseline"] == BASE
    for arm in (BASE, "SJ-KVaRN 4/4", "SJ-KVaRN 3/2t"):
        assert merged["arms"][arm]["ratio"] == together["arms"][arm]["ratio"]
    assert merged["arms"]["SJ-KVaRN 3/2t"]["ratio"]["point"] == pytest.approx(8.0 / 15.0)
    assert [r["baseline"] for r in merged["merged_from"]] == [BASE, "SJ-KVaRN 3/2t"]
    assert "paired against KVarN 4/4 tail 0 over the same positions" in (
        evaluation.render_markdown(merged)
    )
    # The inputs keep their own ratios.
    assert alone["arms"]["SJ-KVaRN 3/2t"]["ratio"]["point"] == 1.0
    # Another baseline on request, from whichever run has it.
    other = evaluation.merge_reports([earlier, alone], baseline="SJ-KVaRN 3/2t")
    assert other["arms"][BASE]["ratio"]["point"] == pytest.approx(15.0 / 8.0)


def test_re_pairing_refuses_a_missing_baseline_and_other_positions() -> None:
    earlier = _per_position_run({BASE: [1.0, 2.0, 4.0, 8.0]}, BASE)
    alone = _per_position_run({"SJ-KVaRN 3/2t": [2.0, 2.0, 2.0, 2.0]}, "SJ-KVaRN 3/2t")
    with pytest.raises(ValueError, match="no run has the baseline arm 'q8_0/q8_0'"):
        evaluation.merge_reports([earlier, alone], baseline="q8_0/q8_0")
    alone["arms"]["SJ-KVaRN 3/2t"]["per_position"]["history"] = [0, 1, 1, 1]
    with pytest.raises(ValueError, match="other positions"):
        evaluation.merge_reports([earlier, alone])


def test_cli_merge_takes_a_baseline(tmp_path: Path) -> None:
    earlier = _per_position_run({BASE: [1.0, 2.0, 4.0, 8.0], "x": [1.0, 1.0, 1.0, 1.0]}, BASE)
    alone = _per_position_run({"SJ-KVaRN 3/2t": [2.0, 2.0, 2.0, 2.0]}, "SJ-KVaRN 3/2t")
    (tmp_path / "a.json").write_text(json.dumps(earlier))
    (tmp_path / "b.json").write_text(json.dumps(alone))
    out = tmp_path / "merged"
    done = subprocess.run(
        [sys.executable, "-m", "sjkvarn", "eval", "--merge", str(tmp_path / "a.json")]
        + [str(tmp_path / "b.json"), "--baseline", "x", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    merged = json.loads((out / "results.json").read_text())
    assert merged["settings"]["baseline"] == "x"
    assert merged["arms"]["SJ-KVaRN 3/2t"]["ratio"]["point"] == pytest.approx(2.0)


def test_histories_in_another_order_are_aligned_and_pooled_digests_kept() -> None:
    base, new = [1.0, 2.0, 4.0, 8.0], [2.0, 2.0, 2.0, 2.0]
    earlier = _per_position_run({BASE: base}, BASE)
    alone = _per_position_run({"SJ-KVaRN 3/2t": new[:2] + [6.0, 6.0]}, "SJ-KVaRN 3/2t")
    # The same run written with its histories the other way round.
    alone["histories"] = ["prose", "code"]
    alone["arms"]["SJ-KVaRN 3/2t"]["per_position"] = {
        "kl": [6.0, 6.0, 2.0, 2.0],
        "history": [0, 0, 1, 1],
    }
    merged = evaluation.merge_reports([earlier, alone])
    assert merged["arms"]["SJ-KVaRN 3/2t"]["per_position"]["kl"] == [2.0, 2.0, 6.0, 6.0]
    assert merged["arms"]["SJ-KVaRN 3/2t"]["ratio"]["point"] == pytest.approx(16.0 / 15.0)
    # Pooling keeps the digest of every run's history, so a later merge can compare texts.
    runs = [
        _one_history_run("a", {BASE: [1.0, 3.0]}),
        _one_history_run("b", {BASE: [2.0, 2.0]}),
    ]
    runs[0]["environment"]["history_sha256"] = {"a": "1" * 16}
    runs[1]["environment"]["history_sha256"] = {"b": "2" * 16}
    pooled = evaluation.merge_reports(runs)
    assert pooled["environment"]["history_sha256"] == {"a": "1" * 16, "b": "2" * 16}
    # A run without a digest for a history is merged, and the report says it was not compared.
    del alone["environment"]["history_sha256"]["prose"]
    merged = evaluation.merge_reports([earlier, alone])
    assert merged["unchecked_texts"] == ["prose"]
    assert "not compared" in evaluation.render_markdown(merged)
