"""tools/import_cycles.py on a small fake crate: it must find exactly the circles written into it,
attribute re-exported names to their defining files, and stay quiet about facades, tests,
comments and string literals."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "import_cycles.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("import_cycles", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_cycles"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


tool = load_tool()

FAKE_CRATE = {
    "lib.rs": "pub mod two; pub mod three; pub mod facade; pub mod plain; pub mod hub;\n"
    "pub mod quiet;\n",
    # (a) two files through `use crate::...` (nested braces and a rename).
    "two/mod.rs": "pub mod a;\npub mod b;\n",
    "two/a.rs": "use crate::two::b::Beta;\npub struct Alpha(pub Beta);\n",
    "two/b.rs": "use crate::two::{a::{Alpha as A}};\npub struct Beta;\npub fn f(_: A) {}\n",
    # (b) three files through fully qualified paths in code, one through a module alias.
    "three/mod.rs": "pub mod x;\npub mod y;\npub mod z;\n",
    "three/x.rs": "pub fn ex() -> u32 {\n    crate::three::y::Why::One as u32\n}\n",
    "three/y.rs": "pub enum Why {\n    One,\n}\npub fn why() -> usize {\n    super::z::zed()\n}\n",
    "three/z.rs": "use crate::three;\npub fn zed() -> usize {\n    three::x::ex() as usize\n}\n",
    # (c) a circle that only runs through the facade's re-exports.
    "facade/mod.rs": "mod inner;\nmod other;\npub use inner::Inner;\n"
    "pub(crate) use other::{Other as Renamed};\n",
    "facade/inner.rs": "use super::Renamed;\npub struct Inner(pub Renamed);\n",
    "facade/other.rs": "pub struct Other;\npub fn take(_: crate::facade::Inner) {}\n",
    # (d) a facade that only re-exports (one a glob): no circle through mod.rs.
    "plain/mod.rs": "mod leaf;\nmod twig;\npub use leaf::Leaf;\npub use twig::*;\n",
    "plain/leaf.rs": "use super::Twig;\npub struct Leaf(pub Twig);\n",
    "plain/twig.rs": "pub struct Twig;\n",
    # A mod.rs that defines items and uses its child's name is a participant.
    "hub/mod.rs": "mod spoke;\npub use spoke::Spoke;\npub struct Hub;\n"
    "pub fn make() -> Spoke {\n    Spoke\n}\n",
    "hub/spoke.rs": "use super::Hub;\npub struct Spoke(pub Option<Hub>);\n",
    # (e) uses in a test block, comments and strings do not count; q -> p is the only edge.
    "quiet/mod.rs": "pub mod p;\npub mod q;\n",
    "quiet/p.rs": """pub struct P;
// use crate::quiet::q::Q;
/* crate::quiet::q::Q */
/// crate::quiet::q::Q
pub const S: &str = "crate::quiet::q::Q";
pub const R: &str = r#"use crate::quiet::q::Q; "#;
pub const C: char = '{';
pub fn first<'a>(x: &'a [u8]) -> &'a u8 {
    &x[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quiet::q::Q;

    #[test]
    fn t() {
        let _ = crate::quiet::q::Q;
        let _ = '}';
    }
}
""",
    "quiet/q.rs": "use super::p::P;\npub struct Q(pub P);\n",
}


@pytest.fixture
def fake_crate(tmp_path: Path) -> Path:
    for rel, text in FAKE_CRATE.items():
        path = tmp_path / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path / "src"


def test_finds_exactly_the_written_circles(fake_crate: Path) -> None:
    count, _, _, comps = tool.analyse(fake_crate)
    assert count == len(FAKE_CRATE)
    assert comps == [
        ["facade/inner.rs", "facade/other.rs"],
        ["hub/mod.rs", "hub/spoke.rs"],
        ["three/x.rs", "three/y.rs", "three/z.rs"],
        ["two/a.rs", "two/b.rs"],
    ]


def test_edges_name_the_defining_files(fake_crate: Path) -> None:
    _, found, _, _ = tool.analyse(fake_crate)
    names = {edge: name for edge, (_, name) in found.items()}
    assert names[("two/a.rs", "two/b.rs")] == "Beta"
    assert names[("two/b.rs", "two/a.rs")] == "Alpha"
    assert names[("three/x.rs", "three/y.rs")] == "Why"
    assert names[("three/y.rs", "three/z.rs")] == "zed"
    assert names[("three/z.rs", "three/x.rs")] == "ex"
    assert names[("facade/inner.rs", "facade/other.rs")] == "Other"
    assert names[("facade/other.rs", "facade/inner.rs")] == "Inner"
    assert names[("plain/leaf.rs", "plain/twig.rs")] == "Twig"
    assert names[("hub/mod.rs", "hub/spoke.rs")] == "Spoke"
    assert names[("quiet/q.rs", "quiet/p.rs")] == "P"
    assert not any(a.endswith("mod.rs") for a, _ in found if not a.startswith("hub/"))
    assert ("quiet/p.rs", "quiet/q.rs") not in found


def test_exit_status_and_output(fake_crate: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tool.main(["--crate-root", str(fake_crate)]) == 1
    out = capsys.readouterr().out
    assert "  two/a.rs -> two/b.rs -> two/a.rs\n" in out
    assert "    facade/inner.rs -> facade/other.rs (Other)\n" in out
    assert "4 import circle(s) in" in out

    for rel in ("two/b.rs", "three/z.rs", "facade/other.rs", "hub/spoke.rs"):
        (fake_crate / rel).write_text("pub struct Cut;\n", encoding="utf-8")
    assert tool.main(["--crate-root", str(fake_crate)]) == 0
    assert capsys.readouterr().out == f"no import circles in {len(FAKE_CRATE)} files\n"


CRATES = Path(__file__).resolve().parents[1] / "crates"


@pytest.mark.parametrize("crate", ["sjkvarn", "sjkvarn-py", "sjkvarn-cuda-host"])
def test_the_crates_have_no_import_circles(crate: str) -> None:
    files, _, _, circles = tool.analyse(CRATES / crate / "src")
    assert files > 0
    assert circles == [], f"import circles in {crate}: {circles}"


def test_no_source_file_is_over_700_lines() -> None:
    long = {
        str(p.relative_to(CRATES)): n
        for p in CRATES.glob("*/src/**/*.rs")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 700
    }
    assert long == {}
