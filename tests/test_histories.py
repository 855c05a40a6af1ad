"""The evaluation's histories are the same text in every process."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

DIGESTS = (
    "import hashlib, sys\n"
    "from sjkvarn.eval import histories\n"
    "if sys.argv[1] == 'torch':\n"
    "    import torch, transformers  # other imports must not change the texts\n"
    "for h in histories.seed_scale() + histories.defaults():\n"
    "    print(h.name, hashlib.sha256(h.text.encode()).hexdigest())\n"
)


def test_histories_do_not_change_between_processes() -> None:
    # Each process lays out its objects at other addresses (the docs history once carried
    # one, from a default value's repr), and may import other modules first.
    runs = [
        subprocess.run(
            [sys.executable, "-c", DIGESTS, arg], capture_output=True, text=True, check=True
        ).stdout
        for arg in ("plain", "torch", "plain")
    ]
    assert runs[0].count("\n") >= 7
    assert runs[0] == runs[1] == runs[2]
