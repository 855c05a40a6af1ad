"""Default evaluation histories built from real text that exists wherever Python does."""

from __future__ import annotations

import inspect
import pydoc
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class History:
    name: str
    text: str


def _source(*modules: Any) -> str:
    return "\n\n".join(inspect.getsource(m) for m in modules)


def coding() -> History:
    """Standard-library source code."""
    import json.decoder
    import textwrap

    return History("coding", _source(textwrap, json.decoder))


def prose() -> History:
    """pydoc renderings of standard-library modules (documentation prose, lookups)."""
    import collections
    import string

    text = "\n".join(pydoc.render_doc(m, renderer=pydoc.plaintext) for m in (string, collections))
    return History("prose", text)


def agentic() -> History:
    """A transcript of an assistant reading stdlib files through tool calls."""
    import fnmatch
    import glob
    import shlex

    turns = [
        "<|im_start|>system\nYou are a coding agent with a read_file tool.<|im_end|>\n",
        "<|im_start|>user\nExplain how glob patterns are matched in the standard library."
        "<|im_end|>\n",
    ]
    for mod in (glob, fnmatch, shlex):
        path = Path(inspect.getfile(mod)).name
        turns.append(
            f'<|im_start|>assistant\n<tool_call>read_file("{path}")</tool_call><|im_end|>\n'
        )
        turns.append(f"<|im_start|>tool\n{inspect.getsource(mod)}<|im_end|>\n")
    return History("agentic", "".join(turns))


def defaults() -> list[History]:
    return [coding(), prose(), agentic()]


def from_file(path: str | Path) -> History:
    p = Path(path)
    return History(p.stem, p.read_text(encoding="utf-8", errors="replace"))
