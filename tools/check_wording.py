"""Fails when a shipped file speaks of how the project was developed instead of describing the
software: work-unit names ("stop 12", "an earlier stop's"), "this session", "last time",
"an earlier build". History belongs in CHANGELOG.md (as what changed) and in git.

``python tools/check_wording.py`` from the repository root; exit status 1 lists every hit as
``path:line: text``. Third-party texts (``eval/data``), fuzz inputs and build outputs are skipped.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PATTERNS = [
    re.compile(r"\bstops? \d+\b", re.IGNORECASE),
    re.compile(r"\b(earlier|previous|last|this|next) stop('s)?\b", re.IGNORECASE),
    re.compile(r"\bthis session\b", re.IGNORECASE),
    re.compile(r"\blast time\b", re.IGNORECASE),
    re.compile(r"\b(an )?earlier build('s)?\b", re.IGNORECASE),
]
SKIP_PREFIXES = ("eval/data/", "fuzz/", "docs/figures/", "docs/results/data/")
TEXT_SUFFIXES = {".md", ".rs", ".py", ".toml", ".sh", ".cu", ".cuh", ".txt", ".yml", ".cfg", ""}


def shipped_files(root: Path) -> list[Path]:
    """Tracked files (git), the same set a clean clone holds."""
    out = subprocess.run(
        ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    files = []
    for name in out.splitlines():
        path = root / name
        if name.startswith(SKIP_PREFIXES) or path.suffix not in TEXT_SUFFIXES:
            continue
        if path.is_file():
            files.append(path)
    return files


def hits(path: Path) -> list[tuple[int, str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        if any(p.search(line) for p in PATTERNS)
    ]


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    me = Path(__file__).resolve()
    found = [
        f"{path.relative_to(root)}:{n}: {line}"
        for path in shipped_files(root)
        if path.resolve() != me
        for n, line in hits(path)
    ]
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} line(s) speak of how the project was developed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
