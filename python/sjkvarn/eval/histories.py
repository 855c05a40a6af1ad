"""Default evaluation histories built from real text that exists wherever Python does."""

from __future__ import annotations

import inspect
import pydoc
import re
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


def _render_docs(modules: tuple[Any, ...]) -> str:
    """The plain-text ``pydoc`` pages of ``modules``. Default values that are plain objects
    render with their address (``OrderedDict.pop``'s sentinel: ``<object object at 0x7f...>``),
    which changes from process to process; it is cut out, so the text, and every figure scored
    on it, is the same in every run."""
    text = "\n".join(pydoc.render_doc(m, renderer=pydoc.plaintext) for m in modules)
    return re.sub(r" at 0x[0-9a-f]+>", ">", text)


def prose() -> History:
    """pydoc renderings of standard-library modules (documentation prose, lookups)."""
    import collections
    import string

    return History("prose", _render_docs((string, collections)))


def _transcript(question: str, modules: tuple[Any, ...]) -> str:
    """An assistant answering ``question`` by reading ``modules`` through tool calls."""
    turns = [
        "<|im_start|>system\nYou are a coding agent with a read_file tool.<|im_end|>\n",
        f"<|im_start|>user\n{question}<|im_end|>\n",
    ]
    for mod in modules:
        path = Path(inspect.getfile(mod)).name
        turns.append(
            f'<|im_start|>assistant\n<tool_call>read_file("{path}")</tool_call><|im_end|>\n'
        )
        turns.append(f"<|im_start|>tool\n{inspect.getsource(mod)}<|im_end|>\n")
    return "".join(turns)


def agentic() -> History:
    """A transcript of an assistant reading stdlib files through tool calls."""
    import fnmatch
    import glob
    import shlex

    question = "Explain how glob patterns are matched in the standard library."
    return History("agentic", _transcript(question, (glob, fnmatch, shlex)))


def defaults() -> list[History]:
    return [coding(), prose(), agentic()]


# Seed-scale histories (`sjkvarn eval --preset seed`): each holds well over 16K tokens of one
# kind of real text (about 4 characters per token for code, 4.5 for prose).


def long_coding() -> History:
    """Standard-library source code: argparse, dataclasses and configparser (~55K tokens)."""
    import argparse
    import configparser
    import dataclasses

    return History("code", _source(argparse, dataclasses, configparser))


def long_prose() -> History:
    """The Python language reference's prose, as ``pydoc`` ships it (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    return History("prose", "\n\n".join(topics[k] for k in sorted(topics)))


def long_docs() -> History:
    """``pydoc`` renderings of standard-library modules: signatures, docstrings, tables."""
    import collections
    import functools
    import itertools
    import pathlib
    import string

    return History("docs", _render_docs((collections, pathlib, functools, itertools, string)))


def long_agentic() -> History:
    """A tool-call transcript: an assistant reading logging, shlex, glob and fnmatch."""
    import fnmatch
    import glob
    import logging
    import shlex

    question = "Find out how logging handlers are configured and how shell words are split."
    return History("tool-calls", _transcript(question, (logging, shlex, glob, fnmatch)))


def seed_scale() -> list[History]:
    """The four histories of the seed-scale run: code, prose, docs and a tool-call transcript."""
    return [long_coding(), long_prose(), long_docs(), long_agentic()]


def main_job() -> list[History]:
    """The main job's histories (`sjkvarn`, `--preset main`): code and a tool-call transcript,
    the two kinds of context a serving engineer's long prompts are made of."""
    return [long_coding(), long_agentic()]


def from_file(path: str | Path) -> History:
    p = Path(path)
    return History(p.stem, p.read_text(encoding="utf-8", errors="replace"))
