"""docs/design.md stays true to the tree: its module table lists every module of ``shardopt/`` and
no other, the layers (setup.cfg's import-linter contract, and design.md's table of them) are the
folders and modules that exist, each in exactly one layer, and the code design.md names exists.

What design.md names, read from the text as written (inline code spans, and the words of its
fenced diagrams), resolved against the source of ``shardopt/`` with ``ast`` (nothing imported):

- a path: a span of path characters that ends in ``.py`` or holds a ``/`` (in a diagram, a word
  that does both). It is a file (a folder when it ends in ``/``) relative to the repository root
  when its first part is ``shardopt``, ``tests``, ``benchmarks``, ``examples``, ``tools``,
  ``docs`` or ``.ci``, else relative to ``shardopt/`` (``group/_intake.py``); a bare ``.py``
  name (``hf.py``) is a file of the root or of shardopt/, tests/, benchmarks/, examples/.
- ``path::name`` (``::name::method``): a function or class of that file; a span that starts with
  ``::`` continues the last file named so.
- a dotted name (``a.b``, ``a.b()``) whose first part is ``shardopt`` or a folder of it
  (``core._layout.bucket_cuts``, ``shardopt.save_checkpoint``): the longest prefix is a module,
  and the next part is bound at its top level (defined or imported); one part more after a class
  is an attribute of that class.
- a dotted name whose first part is a class shardopt defines (``Rounds._to``,
  ``ParamRecord.place``, ``BucketRecord.host``): the class, or a shardopt base of it, has that
  attribute (a method, a class-body name or dataclass field, an enum member, or ``self.x`` set in a
  method). Dotted names that start anywhere else (``torch.*``, ``p.grad``, ``Tensor._version``) are
  torch's or prose, and not checked.
- outside the diagrams, a bare CamelCase name (a capital first, some lower case: ``GradIntake``):
  bound at the top level of some module of shardopt (defined or imported), a Python builtin, or
  one of ``EXTERNAL``, the torch and framework classes design.md names that shardopt does not
  import under that name; an ALL_CAPS name (``MAX_INFLIGHT``, ``WAITING``): a module-level or class-level
  name of shardopt, or a string shardopt holds (an environment variable it reads); a name with one
  leading underscore (``_shadow_step``): a name shardopt binds at a module's top level or in a class.
- ``[Note: title]`` (its title may wrap): a note shardopt defines (``[Note: title]`` at the start
  of a line, or after the ``#`` of a comment line), or design.md itself; when a path in backticks
  comes right before it, or right after it after the word "in", the note is defined in that file.
- in the module table, each CamelCase name of a row is defined or imported in that row's module.

Lower-case bare words (``lag``, ``step``, ``no_sync``) are not checked: they are as often torch's
names or plain words as shardopt's.
"""
from __future__ import annotations

import ast
import builtins
import configparser
import functools
import re
import textwrap
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
        assert m, f"a module row of docs/design.md must name one path relative to shardopt/, like `group/_intake.py`: {cell!r}"
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


# -- the names design.md refers to ------------------------------------------------------------

REPO_DIRS = ("shardopt", "tests", "benchmarks", "examples", "tools", "docs", ".ci")  # a path starting so is from the repo root
# CamelCase names of torch, inductor and the frameworks that design.md names and shardopt neither defines nor
# imports under that name (it reaches them as attributes: dist.ProcessGroupGloo, inductor's cpp module, ...)
EXTERNAL = {"DeviceMesh", "ProcessGroupGloo", "ZeroRedundancyOptimizer", "CppVecOverrides", "CppVecKernel", "Manager",
            "OptimizerWrapper", "LighthouseServer", "FSDPParamGroup",
            "TilingSelect", "VecConvert"}
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_PATH = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?")
_DOTTED = re.compile(rf"({_IDENT}(?:\.{_IDENT})+)(?:\(\))?")
_CAMEL = re.compile(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")  # a capital first, some lower case: not ALL_CAPS
_CAPS = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*")
_PRIVATE = re.compile(r"_[a-z][a-z0-9_]*")  # one leading underscore, not a dunder
_NOTE = re.compile(r"\[Note:\s+([^\]]+)\]")


class _Class:
    """One class of shardopt: its attributes and the names of its bases."""

    def __init__(self) -> None:
        self.attrs: set[str] = set()
        self.bases: list[str] = []


class CodeIndex:
    """What ``shardopt/`` defines, read from its source with ``ast`` (nothing imported): per module
    (dotted name), the names bound at its top level (definitions, assignments, imports) and its
    classes with their attributes (methods, class-body names, enum members, ``self.x`` set in a
    method); every string constant; every ``[Note: ...]`` defined at the start of a line."""

    def __init__(self, package: Path = PACKAGE) -> None:
        self.modules: dict[str, set[str]] = {}
        self.files: dict[str, str] = {}  # dotted module name -> path relative to shardopt/
        self.classes: dict[str, list[_Class]] = {}  # a class name -> every class of that name
        self.strings: set[str] = set()
        self.notes: dict[str, set[str]] = {}  # note title -> the files (relative to shardopt/) that define it
        for path in sorted(package.rglob("*.py")):
            rel = path.relative_to(package).as_posix()
            parts = ["shardopt", *rel[:-3].split("/")]
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            source = path.read_text()
            tree = ast.parse(source)
            self.files[name] = rel
            self.modules[name] = self._top_names(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append(self._class(node))
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    self.strings.add(node.value)
            for line in source.splitlines():
                m = re.match(r"\s*(?:#\s*)?\[Note: ([^\]]+)\](?:\s|$)", line)
                if m:
                    self.notes.setdefault(m.group(1), set()).add(rel)

    @staticmethod
    def _targets(node: ast.AST) -> list[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return [(a.asname or a.name).split(".")[0] for a in node.names]
        return []

    def _top_names(self, tree: ast.Module) -> set[str]:
        names = set()
        for node in ast.walk(tree):  # top level, and inside if/try blocks at the top level
            if node is tree or isinstance(node, (ast.If, ast.Try)):
                for child in ast.iter_child_nodes(node):
                    names.update(self._targets(child))
        return names

    def _class(self, node: ast.ClassDef) -> _Class:
        c = _Class()
        c.bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))]
        for child in node.body:
            c.attrs.update(self._targets(child))
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                    and n.value.id == "self":
                c.attrs.add(n.attr)
        return c

    def defined(self, name: str) -> bool:
        """``name`` is bound at the top level of some module (defined there, or imported)."""
        return any(name in names for names in self.modules.values())

    def in_a_class(self, name: str) -> bool:
        """Some class of shardopt has an attribute ``name`` (an enum member, a method, ...)."""
        return any(name in c.attrs for cs in self.classes.values() for c in cs)

    def class_has(self, cls: str, attr: str, seen: frozenset = frozenset()) -> bool:
        """Some shardopt class ``cls`` (or a shardopt base of it) has ``attr``."""
        for c in self.classes.get(cls, []):
            if attr in c.attrs or any(b not in seen and self.class_has(b, attr, seen | {cls}) for b in c.bases):
                return True
        return False

    def member_of(self, dotted: list[str]) -> str | None:
        """Resolve ``shardopt.a.b.name[.attr]`` or ``a.b.name[.attr]`` (``a`` a folder of shardopt/);
        None when it resolves, else what is missing."""
        parts = dotted if dotted[0] == "shardopt" else ["shardopt", *dotted]
        k = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in self.modules)
        module, rest = ".".join(parts[:k]), parts[k:]
        if not rest:
            return None
        if rest[0] not in self.modules[module]:
            return f"{module} has no {rest[0]}"
        if len(rest) > 1 and rest[0] in self.classes and not self.class_has(rest[0], rest[1]):
            return f"class {rest[0]} has no {rest[1]}"
        return None


def design_spans(text: str) -> list[tuple[str, int, bool]]:
    """(text, line number, inside a fenced block) of every inline code span of design.md, and of
    every word of its fenced blocks."""
    spans, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            spans += [(w.strip("(),:;"), n, True) for w in line.split()]
        else:
            spans += [(m.group(1), n, False) for m in re.finditer(r"`([^`]+)`", line)]
    return spans


def _is_path(span: str, fenced: bool) -> bool:
    """In prose, a span of path characters that ends in ``.py`` or holds a ``/``; in a diagram, a
    word that does both (``inf/NaN`` is no path)."""
    if not _PATH.fullmatch(span):
        return False
    return "/" in span and span.endswith(".py") if fenced else "/" in span or span.endswith(".py")


def _path_problem(span: str) -> str | None:
    """None when ``span`` names a file or folder that exists: relative to the repository root when
    it starts with one of ``REPO_DIRS`` (or is a file of the root), else to ``shardopt/``; a bare
    ``.py`` name may be any module of shardopt/, or a file of tests/, benchmarks/, examples/."""
    path = span.rstrip("/")
    if "/" not in path:
        if (ROOT / path).exists():
            return None
        where = [PACKAGE, *(ROOT / d for d in ("tests", "benchmarks", "examples"))]
        return None if any(next(d.rglob(path), None) for d in where) else f"no file {path}"
    base = ROOT if path.split("/")[0] in REPO_DIRS else PACKAGE
    target = base / path
    return None if (target.is_dir() if span.endswith("/") else target.exists()) else \
        f"no {'folder' if span.endswith('/') else 'file'} {target.relative_to(ROOT)}"


def _test_problem(path: str, names: list[str]) -> str | None:
    """None when ``path::name[::method]`` is a function or class of that file."""
    file = (ROOT / path) if path.split("/")[0] in REPO_DIRS else (PACKAGE / path)
    if not file.exists():
        return f"no file {path}"
    scope: list[ast.stmt] = ast.parse(file.read_text()).body
    for name in names:
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == name), None)
        if node is None:
            return f"{path} has no {name}"
        scope = node.body
    return None


@functools.cache
def code_index() -> CodeIndex:
    return CodeIndex()


def stale_references(text: str) -> list[str]:
    """Every reference of design.md (``text``) to the code that does not resolve, as
    ``"line N: `span`: why"``, by line (the rules are the module's docstring)."""
    index = code_index()
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    problems, last_file = [], ""

    def stale(n: int, span: str, why: str | None) -> None:
        if why:
            problems.append(f"line {n}: `{span}`: {why}")

    for span, n, fenced in design_spans(text):
        if re.fullmatch(r"([\w./-]+\.py)?(::\w+)+", span):  # not C++'s at::vec::cast
            path, *names = span.split("::")
            if path:
                last_file = path
            stale(n, span, _test_problem(path or last_file, names) if (path or last_file) else "no file before ::")
        elif _is_path(span, fenced):
            stale(n, span, _path_problem(span))
        elif _DOTTED.fullmatch(span):
            parts = _DOTTED.fullmatch(span).group(1).split(".")
            if parts[0] == "shardopt" or parts[0] in folders:
                stale(n, span, index.member_of(parts))
            elif parts[0] in index.classes:
                stale(n, span, None if index.class_has(parts[0], parts[1]) else f"class {parts[0]} has no {parts[1]}")
        elif fenced:
            continue
        elif _CAMEL.fullmatch(span):
            known = index.defined(span) or span in EXTERNAL or hasattr(builtins, span)
            stale(n, span, None if known else "shardopt defines no such name (nor is it in EXTERNAL)")
        elif _CAPS.fullmatch(span) and len(span) > 1:
            known = index.defined(span) or index.in_a_class(span) or span in index.strings
            stale(n, span, None if known else "shardopt defines no such constant or enum member, nor reads such a variable")
        elif _PRIVATE.fullmatch(span):
            known = index.defined(span) or index.in_a_class(span)
            stale(n, span, None if known else "shardopt defines no such name")

    own = {m.group(1) for m in re.finditer(r"(?m)^\[Note: ([^\]]+)\]", text)}  # the notes design.md itself holds
    for m in _NOTE.finditer(text):
        title, n = re.sub(r"\s+", " ", m.group(1)), text.count("\n", 0, m.start()) + 1  # a title may wrap
        if title == "...":
            continue
        where = re.search(r"`([\w/]+\.py)`,?\s+$", text[max(0, m.start() - 80):m.start()]) or \
            re.match(r"\s+in\s+`([\w/]+\.py)`", text[m.end():m.end() + 80])
        if where:
            defined_in = index.notes.get(title, set())
            stale(n, f"{where.group(1)} [Note: {title}]", None if where.group(1) in defined_in else
                  f"{where.group(1)} defines no such note" + (f" ({', '.join(sorted(defined_in))} does)" if defined_in else ""))
        elif title not in index.notes and title not in own:
            stale(n, f"[Note: {title}]", "no module of shardopt/ (nor design.md) defines this note")
    return sorted(problems, key=lambda p: int(p.split(":")[0].removeprefix("line ")))


def row_problems(text: str) -> list[str]:
    """Every CamelCase name in a row of the module table that the row's module neither defines
    nor imports (``EXTERNAL`` and builtins aside)."""
    index = code_index()
    by_file = {rel: name for name, rel in index.files.items()}
    problems = []
    for line in _section(text, MODULES_HEADING):
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 3 or "`" not in cells[1]:
            continue
        module = cells[1].strip().strip("`")
        if module not in by_file:
            continue  # a row of a module that does not exist: test_every_row_of_the_design_table_is_a_module_that_exists_once
        names = index.modules[by_file[module]]
        for span in re.findall(r"`([^`]+)`", "|".join(cells[2:])):
            span = span.removesuffix("()")
            if _CAMEL.fullmatch(span) and span not in names \
                    and span not in EXTERNAL and not hasattr(builtins, span):
                problems.append(f"`{module}` row: `{span}` is not defined (or imported) in {module}")
    return problems


def test_design_references_resolve():
    problems = stale_references(DESIGN.read_text())
    assert not problems, "docs/design.md refers to code that does not exist:\n" + "\n".join(problems)


def test_each_module_row_names_what_that_module_defines():
    problems = row_problems(DESIGN.read_text())
    assert not problems, "docs/design.md's module table:\n" + "\n".join(problems)


def test_the_reference_check_flags_stale_names():
    """Each rule can fail: one stale reference of each kind is flagged, by its line, and live ones are not."""
    text = textwrap.dedent("""\
        `group/_intake.py` `group/_gone.py` `tests/test_design.py::test_design_references_resolve`
        `Rounds._to` `Rounds._gone` `ParamRecord.place` `shardopt.save_checkpoint` `shardopt.gone`
        `core._layout.bucket_cuts` `core._layout.gone_chunks` `tests/test_design.py::test_gone`
        `GradIntake` `GoneReducer` `MAX_INFLIGHT` `GONE_CONSTANT` `_shadow_step` `_gone_step`
        `torch.gone` `p.grad` `Tensor._gone` `DeviceMesh` `None` `at::vec::gone` `optimizer.bin`
        ```
          GradIntake.take (group/_intake.py)   GradIntake.gone (group/_gone.py)   inf/NaN
        ```
        `group/_grad_store.py` [Note: accumulating in the shard], `group/_rounds.py` [Note: accumulating in the
        shard], [Note: a note nobody wrote]
        """)
    flagged = [re.match(r"line \d+: (`.*?`): ", p).group(1) for p in stale_references(text)]
    assert flagged == ["`group/_gone.py`", "`Rounds._gone`", "`shardopt.gone`", "`core._layout.gone_chunks`",
                       "`tests/test_design.py::test_gone`", "`GoneReducer`", "`GONE_CONSTANT`", "`_gone_step`",
                       "`GradIntake.gone`", "`group/_gone.py`",
                       "`group/_rounds.py [Note: accumulating in the shard]`",
                       "`[Note: a note nobody wrote]`"], flagged
    rows = textwrap.dedent(f"""\
        {MODULES_HEADING}
        | module | owns |
        |---|---|
        | `group/_grad_store.py` | `FlatGrads` and `ShardGrads`; `FlatGroup` |
        """)
    assert row_problems(rows) == [
        "`group/_grad_store.py` row: `FlatGroup` is not defined (or imported) in group/_grad_store.py"]


def private_protocol_members(sources: dict[str, str]) -> list[str]:
    """``file: Class.member`` for each member with a leading underscore (dunders aside) that a
    ``typing.Protocol`` class names, annotated or defined, in ``sources`` (path -> source)."""
    found = []
    for path, source in sorted(sources.items()):
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases}
            if "Protocol" not in bases:
                continue
            for item in node.body:
                name = item.target.id if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) else \
                    item.name if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
                if name and name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                    found.append(f"{path}: {node.name}.{name}")
    return found


def test_protocols_name_public_members_only():
    """A Protocol is how a lower layer names an object of a higher one (see design.md, "The folders,
    as layers"): it names what is used of that object, and what is used across a layer is public.
    The check can fail: a Protocol naming a private member is found, a dunder and a plain class are not."""
    package = Path(__file__).resolve().parent.parent / "shardopt"
    sources = {str(p.relative_to(package)): p.read_text() for p in package.rglob("*.py")}
    assert private_protocol_members(sources) == []
    planted = textwrap.dedent("""\
        from typing import Protocol
        import typing
        class A(Protocol):
            x: int
            _y: int
            def __call__(self) -> None: ...
            def _z(self) -> None: ...
        class B(typing.Protocol):
            _w: int
        class C:
            _v: int
        """)
    assert private_protocol_members({"planted.py": planted}) == ["planted.py: A._y", "planted.py: A._z",
                                                                   "planted.py: B._w"]
