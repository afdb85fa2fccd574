"""docs/design.md stays true to the tree: its module table lists every module of ``shardopt/`` and
no other, and the layers (setup.cfg's import-linter contract, and design.md's table of them) are
the folders and modules that exist, each in exactly one layer."""
from __future__ import annotations

import configparser
import re
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shardopt"
DESIGN = ROOT / "docs" / "design.md"
MODULES_HEADING = "## Every module"
LAYERS_HEADING = "## The folders, as layers"
OUTSIDE_LAYERS = {"__init__.py", "_version.py"}  # the package's own face and its version: no layer


def _section(text: str, heading: str) -> list[str]:
    """The lines of design.md's section under ``heading`` (up to the next ``## `` heading)."""
    lines = text.splitlines()
    assert heading in lines, f"docs/design.md has no {heading!r} section"
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _first_cells(text: str, heading: str) -> list[str]:
    """The first cell of every body row of the tables in that section (header and rule rows left out)."""
    rows = [line for line in _section(text, heading) if line.startswith("|")]
    cells = [row.split("|")[1].strip() for row in rows]
    return [c for c in cells if "`" in c]  # a header cell ("module", "layer") and the |---| rule have none


def table_modules(text: str) -> list[str]:
    """The modules design.md's module table names, as written: paths relative to ``shardopt/``."""
    names = []
    for cell in _first_cells(text, MODULES_HEADING):
        m = re.fullmatch(r"`([A-Za-z0-9_/]+\.py)`", cell)
        assert m, f"a module row of docs/design.md must name one path relative to shardopt/, like `reduce/_reducer.py`: {cell!r}"
        names.append(m.group(1))
    return names


def tree_modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def contract_layers() -> list[list[str]]:
    """setup.cfg's layers contract, top to bottom: the names on each layer's line."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in cfg["importlinter:contract:layers"]["layers"].splitlines() if line.strip()]
    return [[name.strip() for name in re.split(r"[|:]", line)] for line in lines]


def top_level_entries() -> set[str]:
    """What sits directly in ``shardopt/``: its packages and its modules (without ``.py``), the package's
    own ``__init__.py`` and ``_version.py`` left out."""
    entries = set()
    for p in PACKAGE.iterdir():
        if p.is_dir() and (p / "__init__.py").exists():
            entries.add(p.name)
        elif p.suffix == ".py" and p.name not in OUTSIDE_LAYERS:
            entries.add(p.stem)
    return entries


def test_every_module_has_a_row_in_the_design_table():
    missing = sorted(tree_modules() - set(table_modules(DESIGN.read_text())))
    assert not missing, f"docs/design.md ({MODULES_HEADING!r}) lacks a row for: {missing}"


def test_every_row_of_the_design_table_is_a_module_that_exists_once():
    named = table_modules(DESIGN.read_text())
    stale = sorted(set(named) - tree_modules())
    assert not stale, f"docs/design.md ({MODULES_HEADING!r}) names modules that do not exist: {stale}"
    twice = sorted(n for n, k in Counter(named).items() if k > 1)
    assert not twice, f"docs/design.md ({MODULES_HEADING!r}) names these modules twice: {twice}"


def test_every_top_level_folder_and_module_is_in_exactly_one_layer():
    named = Counter(name for layer in contract_layers() for name in layer)
    twice = sorted(n for n, k in named.items() if k > 1)
    assert not twice, f"setup.cfg's layers contract names these in more than one layer: {twice}"
    entries = top_level_entries()
    assert not entries - set(named), f"in no layer of setup.cfg's contract: {sorted(entries - set(named))}"
    assert not set(named) - entries, f"layers of setup.cfg's contract that do not exist: {sorted(set(named) - entries)}"


def test_the_design_layers_table_is_the_contract_in_its_order():
    written = [re.findall(r"`([^`]+)`", cell) for cell in _first_cells(DESIGN.read_text(), LAYERS_HEADING)]
    assert [sorted(layer) for layer in written] == [sorted(layer) for layer in contract_layers()], (
        f"docs/design.md ({LAYERS_HEADING!r}) must list setup.cfg's layers, top to bottom")
