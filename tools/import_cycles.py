"""Finds file-level import circles inside one crate's ``src/``: file A uses a name that file B
defines while B (directly or around a longer loop) uses a name that A defines. Such circles keep
the module tree from being read bottom-up, so the crates keep their files acyclic.

``python tools/import_cycles.py [--crate-root crates/sjkvarn/src] [--graph]`` from the repository
root; with no ``--crate-root`` all three crates are checked. Exit status 1 prints each strongly
connected component once: a circle through it and every edge inside it with one example name.

A use is a ``use`` declaration or a path in code (``crate::a::B``, ``super::c::D::Variant``,
``alias::E`` after ``use crate::a as alias``). Names resolve to the file that defines them,
following ``pub use`` re-exports; a ``pub use`` line is no use by its own file (a facade module
only passes names on) unless that file's code names the alias. Comments, string literals,
``#[cfg(test)] mod name { ... }`` blocks and names from other crates are ignored.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

Mod = tuple[str, ...]
Target = tuple  # ("mod", module path) or ("item", defining file, name)
Edges = dict[tuple[str, str], tuple[int, str]]  # (from, to) -> (offset, example name)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOTS = ["crates/sjkvarn/src", "crates/sjkvarn-py/src", "crates/sjkvarn-cuda-host/src"]
LEXEME = re.compile(  # comments (one nesting level), raw strings, strings, char literals
    r"//[^\n]*|/\*(?:[^*/]|\*(?!/)|/(?!\*)|/\*(?:[^*]|\*(?!/))*\*/)*\*/"
    r'|(?<!\w)b?r(#*)".*?"\1|"(?:\\.|[^"\\])*"|\'(?:\\.[^\']*|[^\\\'])\'',
    re.S,
)
CFG_TEST = re.compile(
    r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([{;])"
)
INLINE_MOD = re.compile(r"\bmod\s+(\w+)\s*\{")
USE = re.compile(r"(?<![\w$])(pub(?:\s*\([^)]*\))?\s+)?use\s+([^;]+);")
DEF = re.compile(
    r"(?<![*'\w])(?:struct|enum|fn|const|static(?:\s+mut)?|trait|type|union)\s+(?:r#)?(\w+)"
    r"|\bmacro_rules!\s*(\w+)"
)
PATH = re.compile(r"(?<![\w:])((?:r#)?[A-Za-z_]\w*(?:\s*::\s*(?:r#)?[A-Za-z_]\w*)+)")
NOT_NAMES = {"fn", "unsafe", "extern", "async", "const", "mut"}


def blank(text: str) -> str:
    """Same length with newlines kept, so offsets into the stripped text stay valid."""
    return re.sub(r"[^\n]", " ", text)


def strip_code(src: str) -> str:
    """Blanks comments (doc comments too), string and char literals; lifetimes stay."""
    return LEXEME.sub(lambda m: blank(m.group(0)), src).replace("$crate", " crate")


def block_end(text: str, open_brace: int) -> int:
    """Index just past the brace matching ``text[open_brace]``."""
    depth = 0
    for j in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return j + 1
    return len(text)


def parse_use_tree(tree: str, prefix: Mod = ()) -> list[tuple[Mod, str, bool]]:
    """``a::{b as c, d::*, self}`` (whitespace squeezed) -> [(path, alias, is_glob)]."""
    if tree.startswith("::"):
        return []  # ::other_crate
    brace = tree.find("{")
    if brace < 0:
        path, _, alias = tree.partition(" as ")
        segs = prefix + tuple(s.removeprefix("r#") for s in path.split("::") if s)
        if segs[-1:] == ("*",):
            return [(segs[:-1], "*", True)]
        segs = segs[:-1] if segs[-1:] == ("self",) else segs
        return [(segs, alias or segs[-1], False)] if segs else []
    head = prefix + tuple(s for s in tree[:brace].split("::") if s)
    out, depth, start = [], 0, brace + 1
    for j in range(brace + 1, len(tree)):
        depth += {"{": 1, "}": -1}.get(tree[j], 0)
        if depth < 0 or (tree[j] == "," and depth == 0):
            out += parse_use_tree(tree[start:j], head) if tree[start:j] else []
            start = j + 1
        if depth < 0:
            break
    return out


class Use(NamedTuple):
    path: Mod
    alias: str
    glob: bool
    pub: bool
    mod: Mod  # the (inline) module the declaration sits in
    pos: int


@dataclass
class SourceFile:
    rel: str
    mod: Mod
    root: Mod  # the crate root module: () for lib.rs, ("bin:x",) for src/bin/x.rs
    code: str = ""  # stripped; test blocks and use declarations blanked
    spans: list[tuple[int, int, str]] = field(default_factory=list)  # inline modules
    uses: list[Use] = field(default_factory=list)
    defs: dict[str, int] = field(default_factory=dict)  # name -> first offset
    idents: set[str] = field(default_factory=set)
    test_mods: list[str] = field(default_factory=list)  # `#[cfg(test)] mod name;`

    def mod_at(self, pos: int) -> Mod:
        """The (inline) module that holds offset ``pos``."""
        return self.mod + tuple(name for s, e, name in self.spans if s <= pos < e)


def scan(path: Path, rel: str, has_lib: bool) -> SourceFile:
    """Reads one file: its module path, definitions, use declarations and code."""
    parts, root = tuple(rel.split("/")), ()
    if parts[0] == "bin":  # each binary is a crate of its own
        root = ("bin:" + parts[1].removesuffix(".rs"),)
        parts = parts[2:] or ("main.rs",)
    elif parts == ("main.rs",) and has_lib:
        root = ("bin:main",)
    stem = parts[-1].removesuffix(".rs")
    tail = () if parts in (("lib.rs",), ("main.rs",)) or stem == "mod" else (stem,)
    f = SourceFile(rel, root + parts[:-1] + tail, root)
    text = strip_code(path.read_text(encoding="utf-8"))
    for m in CFG_TEST.finditer(text):
        if m.group(2) == ";":
            f.test_mods.append(m.group(1))
        elif text[m.start()] == "#":  # not inside a test block blanked already
            end = block_end(text, m.end() - 1)
            text = text[: m.start()] + blank(text[m.start() : end]) + text[end:]
    f.spans = [(m.end(), block_end(text, m.end() - 1), m[1]) for m in INLINE_MOD.finditer(text)]
    for m in USE.finditer(text):
        tree = re.sub(r"\s*([:{},*])\s*", r"\1", " ".join(m.group(2).split()))
        for segs, alias, glob in parse_use_tree(tree):
            f.uses.append(Use(segs, alias, glob, bool(m.group(1)), f.mod_at(m.start()), m.start()))
        text = text[: m.start()] + blank(m.group(0)) + text[m.end() :]
    f.code = text
    for m in DEF.finditer(text):
        if (m.group(1) or m.group(2)) not in NOT_NAMES:
            f.defs.setdefault(m.group(1) or m.group(2), m.start())
    f.idents = set(re.findall(r"\b[A-Za-z_]\w*\b", text))
    return f


class Crate:
    """The module tree of one ``src/`` folder and the file-level edges between its files."""

    def __init__(self, src: Path) -> None:
        has_lib = (src / "lib.rs").exists()
        files = [scan(p, p.relative_to(src).as_posix(), has_lib) for p in sorted(src.rglob("*.rs"))]
        tests = [f.mod + (t,) for f in files for t in f.test_mods]
        files = [f for f in files if not any(f.mod[: len(t)] == t for t in tests)]
        self.files = {f.rel: f for f in files}
        self.mods: dict[Mod, str] = {}
        self.uses: dict[Mod, list[Use]] = {}
        for f in files:
            self.mods.update({f.mod: f.rel} | {f.mod_at(s): f.rel for s, _, _ in f.spans})
            for u in f.uses:
                self.uses.setdefault(u.mod, []).append(u)

    def lookup(self, mod: Mod, name: str, seen: set) -> Target | None:
        """What ``name`` means inside ``mod``: a module, or an item and its defining file."""
        if (mod, name) in seen or mod not in self.mods:
            return None
        seen.add((mod, name))
        if mod + (name,) in self.mods:
            return ("mod", mod + (name,))
        if name in self.files[self.mods[mod]].defs:
            return ("item", self.mods[mod], name)
        for u in self.uses.get(mod, []):
            if not u.glob and u.alias == name:
                return self.resolve(mod, u.path, seen)
        for u in self.uses.get(mod, []):
            t = self.resolve(mod, u.path, seen) if u.glob else None
            found = self.lookup(t[1], name, seen) if t and t[0] == "mod" else None
            if found:
                return found
        return None

    def resolve(self, mod: Mod, segs: Mod, seen: set | None = None) -> Target | None:
        """Follows a path from ``mod``; an item ends it (``Staging::Tq6`` is ``Staging``)."""
        seen = set() if seen is None else seen
        cur = mod
        root = self.files[self.mods[mod]].root if mod in self.mods else ()
        for i, seg in enumerate(segs):
            if seg == "crate" and i == 0:
                cur = root
            elif seg == "super":
                if len(cur) <= len(root):
                    return None
                cur = cur[:-1]
            elif seg != "self":
                t = self.lookup(cur, seg, seen)
                if t is None or t[0] == "item":
                    return t
                cur = t[1]
        return ("mod", cur)

    def glob_items(self, mod: Mod, seen: set) -> list[tuple[str, str]]:
        """(file, name) for what a glob import of ``mod`` brings: its items and re-exports."""
        if mod in seen or mod not in self.mods:
            return []
        seen.add(mod)
        rel = self.mods[mod]
        defs = self.files[rel].defs
        out = [(rel, min(defs, key=defs.__getitem__))] if defs else []
        for u in self.uses.get(mod, []):
            t = self.resolve(mod, u.path) if u.pub else None
            if t and t[0] == "mod" and u.glob:
                out += self.glob_items(t[1], seen)
            elif t and t[0] == "item":
                out.append((t[1], t[2]))
        return out

    def edges(self) -> Edges:
        """Every file-to-file edge with the first (by offset) name that causes it."""
        found: Edges = {}

        def add(src: str, dst: str, pos: int, name: str) -> None:
            if src != dst and ((src, dst) not in found or pos < found[(src, dst)][0]):
                found[(src, dst)] = (pos, name)

        for f in self.files.values():
            for u in f.uses:
                if u.pub and (u.glob or u.alias not in f.idents):
                    continue  # a re-export: the file passes the name on and does not use it
                t = self.resolve(u.mod, u.path)
                if t and t[0] == "mod" and u.glob:
                    for rel, name in self.glob_items(t[1], set()):
                        add(f.rel, rel, u.pos, name)
                elif t and t[0] == "item":
                    add(f.rel, t[1], u.pos, t[2])
            for m in PATH.finditer(f.code):
                segs = tuple(s.strip().removeprefix("r#") for s in m.group(1).split("::"))
                t = self.resolve(f.mod_at(m.start()), segs)
                if t and t[0] == "item":
                    add(f.rel, t[1], m.start(), t[2])
        return found


def components(adj: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components; those of two or more files are circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in adj.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return sorted(out)


def circle(comp: list[str], adj: dict[str, list[str]]) -> list[str]:
    """A shortest circle from the component's first file back to it (breadth first)."""
    start, prev, queue = comp[0], {}, [comp[0]]
    for v in queue:
        for w in adj.get(v, []):
            if w in comp and w not in prev:
                prev[w] = v
                queue.append(w)
    path = [start, prev[start]]
    while path[-1] != start:
        path.append(prev[path[-1]])
    return path[::-1]


def analyse(src: Path) -> tuple[int, Edges, dict[str, list[str]], list[list[str]]]:
    """(file count, edges, adjacency, circles) of one crate's ``src/``."""
    crate = Crate(src)
    found = crate.edges()
    adj: dict[str, list[str]] = {}
    for a, b in sorted(found):
        adj.setdefault(a, []).append(b)
    return len(crate.files), found, adj, components(adj)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crate-root", action="append", help="a crate's src/ (repeatable)")
    parser.add_argument("--graph", action="store_true", help="also print every file edge")
    args = parser.parse_args(argv)
    circles = files = 0
    for root in args.crate_root or [REPO / r for r in DEFAULT_ROOTS]:
        full = Path(root).resolve()
        label = full.relative_to(REPO).as_posix() if full.is_relative_to(REPO) else str(root)
        count, found, adj, comps = analyse(full)
        files, circles = files + count, circles + len(comps)
        edges = [(a, b, f"{a} -> {b} ({name})") for (a, b), (_, name) in sorted(found.items())]
        if args.graph:
            print(f"{label}: {len(found)} edges", *(f"  {e}" for _, _, e in edges), sep="\n")
        for comp in comps:
            print(f"{label}: import circle among {len(comp)} files")
            print("  " + " -> ".join(circle(comp, adj)))
            print(*(f"    {e}" for a, b, e in edges if a in comp and b in comp), sep="\n")
    if circles:
        print(f"{circles} import circle(s) in {files} files")
        return 1
    print(f"no import circles in {files} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
