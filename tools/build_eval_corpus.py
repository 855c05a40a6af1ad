"""Builds the held-out evaluation histories in ``eval/data/`` from permissively licensed text
installed on the build machine (Rust crates from the cargo registry, CPython's headers and
standard library, npm's sources and documentation). The committed files are the product of this
script; it is kept so their provenance can be checked and the set rebuilt.

Each history is one kind of real text, long enough for 30,720 positions of Gemma 3 270M plus
the scored tokens. The defaults are never tuned on these files: they are for final figures.

A second set of eight (``--set second``, written to ``eval/data/second/``) takes other languages
and kinds (Tcl, SQL, asyncio's Python, Perl's diagnostics, crates' READMEs, PostgreSQL's data
tables, tool calls over Python and PyTorch sources), so a figure can be checked on texts that
none of the first set's sources share.

``python tools/build_eval_corpus.py [--set first|second] [--out DIR]``
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import sysconfig
from pathlib import Path

# Characters per history: ~4 characters per Gemma token for code, more for prose; 31,232
# tokens are needed at the longest length.
CHARS = 160_000


def registry() -> Path:
    found = sorted((Path.home() / ".cargo" / "registry" / "src").glob("*"))
    if not found:
        sys.exit("no cargo registry sources here (run a cargo build first)")
    return found[0]


def crate(name: str) -> Path:
    hits = sorted(registry().glob(f"{name}-[0-9]*"))
    if not hits:
        sys.exit(f"crate {name} is not in the cargo registry here")
    return hits[-1]


def gather(files: list[Path], header: str = "// file: {}\n", limit: int = CHARS) -> str:
    parts, size = [], 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(header.format(f.name) + text)
        size += len(text)
        if size >= limit:
            break
    return "\n".join(parts)


def transcript(question: str, files: list[Path], limit: int = CHARS) -> str:
    turns = [
        "<|im_start|>system\nYou are a coding agent with a read_file tool.<|im_end|>\n",
        f"<|im_start|>user\n{question}<|im_end|>\n",
    ]
    size = 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        turns.append(
            f'<|im_start|>assistant\n<tool_call>read_file("{f.name}")</tool_call><|im_end|>\n'
        )
        turns.append(f"<|im_start|>tool\n{text}<|im_end|>\n")
        size += len(text)
        if size >= limit:
            break
    return "".join(turns)


def html_text(path: Path) -> str:
    raw = path.read_text(encoding="utf-8", errors="replace")
    raw = re.sub(r"(?s)<(script|style)[^>]*>.*?</\1>", "", raw)
    raw = re.sub(r"<br\s*/?>|</p>|</h\d>|</li>|</pre>", "\n", raw)
    text = html.unescape(re.sub(r"<[^>]+>", "", raw))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def build() -> dict[str, tuple[str, str, str]]:
    """name -> (kind, source and license, text)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    include = Path(sysconfig.get_paths()["include"])
    npm = Path("/usr/lib/node_modules/npm")
    clap = crate("clap_builder")
    rust_files = sorted((clap / "src").rglob("*.rs"))
    c_files = sorted(include.glob("*.h")) + sorted((include / "cpython").glob("*.h"))
    js_files = sorted((npm / "lib").rglob("*.js"))
    py_files = [stdlib / "email" / n for n in ("message.py", "_header_value_parser.py")] + [
        stdlib / "http" / "client.py"
    ]
    changelogs = [
        p
        for c in sorted(registry().iterdir())
        for p in (c / "CHANGELOG.md", c / "RELEASES.md")
        if p.is_file()
    ]
    docs = sorted((npm / "docs" / "output").rglob("*.html"))
    regex = crate("regex-automata")
    serde_json = crate("serde_json")
    tool_rust = sorted((regex / "src" / "meta").glob("*.rs")) + sorted(
        (serde_json / "src").glob("*.rs")
    )
    tool_js = sorted((npm / "node_modules").glob("*/lib/*.js"))
    return {
        "rust-code": ("code (Rust)", f"{clap.name} src/ (MIT OR Apache-2.0)", gather(rust_files)),
        "c-headers": (
            "code (C)",
            "CPython 3.11 include/ headers (PSF-2.0)",
            gather(c_files, "/* file: {} */\n"),
        ),
        "js-code": ("code (JavaScript)", "npm lib/ (Artistic-2.0)", gather(js_files)),
        "python-email-http": (
            "code (Python)",
            "CPython 3.11 Lib/email/message.py, _header_value_parser.py, http/client.py (PSF-2.0)",
            gather(py_files, "# file: {}\n"),
        ),
        "changelogs": (
            "prose (release notes)",
            "CHANGELOG.md / RELEASES.md of the cargo registry's crates (MIT OR Apache-2.0)",
            gather(changelogs, "# {}\n"),
        ),
        "npm-docs": (
            "reference docs",
            "npm docs/output/*.html as plain text (Artistic-2.0)",
            "\n\n".join(html_text(p) for p in docs)[: 2 * CHARS],
        ),
        "tool-calls-rust": (
            "tool-call transcript (Rust)",
            f"{regex.name} src/meta, {serde_json.name} src (MIT OR Apache-2.0)",
            transcript(
                "How does the meta regex engine pick a strategy, and how does serde_json "
                "parse numbers?",
                tool_rust,
            ),
        ),
        "tool-calls-js": (
            "tool-call transcript (JavaScript)",
            "npm's bundled dependencies, node_modules/*/lib/*.js (MIT / ISC / Artistic-2.0 each)",
            transcript("Find how npm resolves and fetches a package tarball.", tool_js),
        ),
    }


def crate_license(path: Path) -> str:
    manifest = (path / "Cargo.toml").read_text(encoding="utf-8", errors="replace")
    found = re.search(r'(?m)^license\s*=\s*"([^"]+)"', manifest)
    return found.group(1) if found else ""


def build_second() -> dict[str, tuple[str, str, str]]:
    """The second set: name -> (kind, source and license, text)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tcl = Path("/usr/share/tcltk/tcl8.6")
    pg = Path("/usr/share/postgresql/15")
    perldiag = Path("/usr/share/perl/5.36/pod/perldiag.pod")
    for needed in (tcl, pg, perldiag):
        if not needed.exists():
            sys.exit(f"{needed} is not here (Debian's tcl8.6, postgresql-15 and perl-modules)")
    import torch  # the eval extra's torch: its sources, read as text

    tcl_files = sorted(tcl.glob("*.tcl")) + sorted(tcl.glob("*/*.tcl")) + sorted(tcl.rglob("*.tm"))
    sql_files = [
        pg / n for n in ("system_views.sql", "information_schema.sql", "system_functions.sql")
    ]
    asyncio_files = sorted((stdlib / "asyncio").glob("*.py"))
    readmes = [
        c / "README.md"
        for c in sorted(registry().iterdir())
        if (c / "README.md").is_file() and re.search(r"MIT|Apache-2\.0", crate_license(c))
    ]
    tables = [pg / "errcodes.txt", pg / "sql_features.txt"] + sorted(
        (pg / "timezonesets").glob("*.txt")
    )
    tool_py = [
        stdlib / "json" / n for n in ("__init__.py", "decoder.py", "encoder.py", "scanner.py")
    ] + [
        stdlib / "csv.py",
        stdlib / "shlex.py",
        stdlib / "textwrap.py",
        stdlib / "fnmatch.py",
        stdlib / "glob.py",
    ]
    optim = Path(torch.__file__).parent / "optim"
    tool_torch = [optim / n for n in ("optimizer.py", "adamw.py", "sgd.py", "lr_scheduler.py")]
    return {
        "tcl-code": (
            "code (Tcl)",
            "Tcl 8.6 library scripts, /usr/share/tcltk/tcl8.6 (Tcl/Tk license, BSD-style)",
            gather(tcl_files, "# file: {}\n"),
        ),
        "sql-code": (
            "code (SQL)",
            "PostgreSQL 15 system_views.sql, information_schema.sql, system_functions.sql "
            "(PostgreSQL License)",
            gather(sql_files, "-- file: {}\n"),
        ),
        "python-asyncio": (
            "code (Python)",
            "CPython 3.11 Lib/asyncio/ (PSF-2.0)",
            gather(asyncio_files, "# file: {}\n"),
        ),
        "perl-diagnostics": (
            "reference docs (POD)",
            "Perl 5.36 perldiag.pod (Artistic-1.0-Perl OR GPL-1.0-or-later)",
            perldiag.read_text(encoding="utf-8", errors="replace")[:CHARS],
        ),
        "crate-readmes": (
            "prose (project READMEs)",
            "README.md of the cargo registry's MIT or Apache-2.0 crates (each crate's license)",
            gather(readmes, "# {}\n"),
        ),
        "postgres-tables": (
            "data tables",
            "PostgreSQL 15 errcodes.txt, sql_features.txt, timezonesets/ (PostgreSQL License)",
            gather(tables, "# file: {}\n"),
        ),
        "tool-calls-python": (
            "tool-call transcript (Python)",
            "CPython 3.11 Lib/json, csv.py, shlex.py, textwrap.py, fnmatch.py, glob.py (PSF-2.0)",
            transcript("How does json encode floats, and how does csv sniff a dialect?", tool_py),
        ),
        "tool-calls-torch": (
            "tool-call transcript (PyTorch)",
            f"PyTorch {torch.__version__.split('+')[0]} torch/optim/ (BSD-3-Clause)",
            transcript(
                "How does AdamW apply weight decay, and how do LR schedulers step?", tool_torch
            ),
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=["first", "second"], default="first")
    ap.add_argument("--out", default=None, help="eval/data, or eval/data/second for --set second")
    args = ap.parse_args()
    second = args.set == "second"
    out = Path(args.out or ("eval/data/second" if second else "eval/data"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (kind, source, text) in (build_second() if second else build()).items():
        (out / f"{name}.txt").write_text(text, encoding="utf-8")
        rows.append(f"| `{name}.txt` | {kind} | {source} | {len(text):,} |")
    title, glob = (
        ("Held-out evaluation histories, second set", "eval/data/second/*.txt")
        if second
        else ("Held-out evaluation histories", "eval/data/*.txt")
    )
    (out / "SOURCES.md").write_text(
        f"# {title}\n\n"
        "Real text of known license, built by `tools/build_eval_corpus.py`. The defaults are\n"
        "never tuned on these files; they give the final quality figures\n"
        f"(`sjkvarn eval --preset seed --text {glob}`). Each file keeps its source's\n"
        "license; none is part of the sjkvarn package.\n\n"
        "| file | kind | source (license) | characters |\n|---|---|---|---:|\n"
        + "\n".join(rows)
        + "\n"
    )
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
