"""The capability table: one table in the core, shown by `sjkvarn.backends()` and by
docs/journal.md, asked by every backend's constructor and by `Config(device=...)`."""

from __future__ import annotations

import pathlib
import re

import pytest

import sjkvarn
from sjkvarn import InvalidInputError

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "journal.md"


def doc_table() -> dict[str, dict[str, list[str]]]:
    """docs/journal.md's table as backend -> setting -> values."""
    text = DOC.read_text()
    body = re.search(r"<!-- capability-table -->\n(.*?)<!-- /capability-table -->", text, re.S)
    assert body, "docs/journal.md has a capability table"
    rows = [line.strip().strip("|").split("|") for line in body.group(1).strip().splitlines()]
    header = [c.strip() for c in rows[0]]
    assert header[0] == "setting"
    table: dict[str, dict[str, list[str]]] = {b: {} for b in header[1:]}
    for row in rows[2:]:
        cells = [c.strip() for c in row]
        setting = cells[0].strip("`")
        for backend, cell in zip(header[1:], cells[1:], strict=True):
            table[backend][setting] = [cell]
    return table


def test_the_docs_table_is_the_cores_table() -> None:
    core = sjkvarn.backends()
    doc = doc_table()
    assert list(doc) == list(core)
    for backend, settings in core.items():
        assert list(doc[backend]) == list(settings), backend
        for setting, values in settings.items():
            assert doc[backend][setting] == [", ".join(values)], (backend, setting)


def test_every_backend_states_every_setting() -> None:
    core = sjkvarn.backends()
    assert set(core) == {"cpu", "cuda", "paged"}
    settings = {tuple(s) for s in (list(v) for v in core.values())}
    assert len(settings) == 1, "every backend has the same settings"
    assert all(values for s in core.values() for values in s.values())


def test_config_takes_the_journal_the_table_gives_its_backend() -> None:
    cpu = sjkvarn.Cache(sjkvarn.Config(layers=1, kv_heads=1, q_heads=2, head_dim=64))
    runs = sjkvarn.backends()["cpu"]
    assert cpu.config.staging in runs["staging"]
    assert cpu.config.staging == "q8_0" and cpu.config.centre_keys is True
    assert (cpu.config.min_tail, cpu.config.max_tail) == (2048, 3072)


def test_a_refusal_names_the_setting_and_what_the_backend_runs() -> None:
    cfg = sjkvarn.Config(layers=1, kv_heads=1, q_heads=2, head_dim=64, sink=256, device="cuda")
    try:
        sjkvarn.Cache(cfg)
    except sjkvarn.CudaUnavailableError:
        pytest.skip("needs a CUDA device to reach the device constructor")
    except InvalidInputError as e:
        assert "`sink=256` is not run by the cuda backend; it runs: 128" in str(e)
    else:
        raise AssertionError("a 256-position sink was accepted by the cuda backend")
