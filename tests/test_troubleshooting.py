"""docs/troubleshooting.md has an entry for every error and warning message shardopt gives.

The collector reads every module under ``shardopt/`` with :mod:`ast` (nothing is imported) and
finds each ``raise X(msg, ...)``, each ``warnings.warn(msg, ...)`` (also ``warn`` imported from
:mod:`warnings`), each warning or error on a logger, and each ``print(msg, file=sys.stderr)``.
It also finds the problems that a rank reports to be raised later on every rank (see
``REPORTERS``). ``msg`` is resolved to a pattern: string constants, f-strings (each placeholder
becomes a marker), ``+`` and ``%`` on them, ``.format(...)`` (a field becomes a marker unless its
keyword argument is a known string), conditional expressions (each branch is a message of its
own), module-level constants (also imported from another shardopt module), calls of shardopt
functions that return such strings, and local variables assigned such strings (``+=`` suffixes
included).

A raise or warning whose message cannot be resolved (a re-raise, a message built at run time)
must be listed in ``UNRESOLVED`` with where its text comes from; an entry there that matches
nothing is stale. A message is on the page when its key (its longest literal fragment, or the
whole pattern with ``…`` for each placeholder when that fragment is shorter than 12 characters)
occurs in the page, both with whitespace collapsed.
"""
from __future__ import annotations

import ast
import itertools
import pathlib
import re
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shardopt"
PAGE = ROOT / "docs" / "troubleshooting.md"
HOLE = "\x00"  # a placeholder in a pattern
ELLIPSIS = "…"  # how the page writes a placeholder
MIN_KEY = 12
MAX_ALTERNATIVES = 64  # a guard against combinatorial growth of conditional messages

# Errors found on one rank are raised at the next step on every rank: a message goes into a list
# named ``*problems`` (``.append(msg)``), or through these methods (position of the message among
# the call's arguments), and is raised as a RuntimeError later.
REPORTERS = {"_refuse": 1, "fail": 0}

# (file under the repository root, enclosing function's qualified name, exception class or warning
# category; "raise" for a bare re-raise, the expression for ``raise e`` and ``raise kind(...)``)
# -> where the text of a raise or report that the collector cannot resolve comes from.
UNRESOLVED: dict[tuple[str, str, str], str] = {
    ("shardopt/checkpoint/_torch_state.py", "ParamStateView._write_back", "RuntimeError"):
        "the ValueError of ParamStateView._write (_step_count and _piece_of in _torch_state.py), collected there, "
        "for a value written in place; raised at the next step on every rank",
    ("shardopt/checkpoint/_rank_state.py", "rank_state_dict", "RuntimeError"):
        "the first of ParamStateView.take_writes()'s problems: the ValueError of ParamStateView._write, collected there",
    ("shardopt/step/_agreement.py", "raise_first_difference", "kind"):
        "a construction error of some rank (trainable_params in _config.py, collected there), raised on every "
        "rank, with 'on rank …:' in front on the others",
    ("shardopt/step/_agreement.py", "agree_on_building", "error"):
        "re-raises this rank's own TypeError or ValueError from building its flat buffers (build_buffers and what "
        "it calls: _flat_group.py, _muon_packing.py, _layout.py), whose message is collected where it is "
        "raised; the other ranks raise it with 'on rank …:' in front",
    ("shardopt/checkpoint/_files.py", "agree", "error"):
        "re-raises this rank's own exception, whose message is collected where its caller raised it "
        "(checkpoint.py, _checkpoint_files.py, _checkpoint_adamw.py, _rank_state.py)",
    ("shardopt/comm/_pending.py", "Pending.wait_landed", "raise"):
        "re-raises torch's own error from Work.wait() when it is not a timeout",
    ("shardopt/comm/_pending.py", "Pending.wait_landed", "TimeoutError"):
        "Comm.timed_out's text, collected where Comm.control_failed raises it",
    ("shardopt/comm/_collectives.py", "Comm._control", "RuntimeError"):
        "the text given to Comm.give_up: Comm.control_failed's or _messages.enter's error, collected there",
    ("shardopt/checkpoint/_adamw.py", "settle", "RuntimeError"):
        "rounds.fail(str(e)) with the text of _messages.enter's error (check_calls in comm/_messages.py, or its "
        "TimeoutError), collected there",
    ("shardopt/checkpoint/_files.py", "commit", "raise"):
        "re-raises the OSError of a rename that failed for another reason than another process having made it",
    ("shardopt/comm/_control.py", "control_group", "raise"):
        "re-raises torch's own error from making the gloo group when it is not a timeout",
    ("shardopt/checkpoint/_adamw.py", "settle", "raise"):
        "re-raises _messages.enter's RuntimeError (check_calls, comm/_messages.py) or TimeoutError, collected there",
    ("shardopt/group/_intake.py", "GradIntake._refuse", "RuntimeError"):
        "the message its callers pass (GradIntake.take, GradIntake._late), collected at those calls, "
        "plus '; the step was not taken'",
    ("shardopt/group/_rounds.py", "Rounds.settle", "RuntimeError"):
        "why_broken, the text given to Rounds.fail: a check_calls message (comm/_messages.py) or 'a round of "
        "gradient reductions failed on this rank: …' (Rounds.finish_round), both collected",
    ("shardopt/group/_rounds.py", "Rounds._wait_tag", "RuntimeError"):
        "fail(str(e)) with the text of check_calls's RuntimeError, collected in comm/_messages.py",
    ("shardopt/group/_rounds.py", "Rounds._wait_tag", "raise"):
        "re-raises check_calls's RuntimeError, collected in comm/_messages.py",
    ("shardopt/group/_rounds.py", "Rounds.finish_round", "raise"):
        "re-raises what a bucket's collective raised: the TimeoutError of _collectives.py, check_calls's "
        "RuntimeError (comm/_messages.py), or torch's own error",
    ("shardopt/step/_step_agreement.py", "StepAgreement.exchange", "RuntimeError"):
        "rounds.fail(str(e)) with the text of check_calls's RuntimeError, collected in comm/_messages.py",
    ("shardopt/step/_step_agreement.py", "StepAgreement.exchange", "raise"):
        "re-raises check_calls's RuntimeError, collected in comm/_messages.py",
    ("shardopt/step/_usage_checks.py", "UsageChecks._raise_if", "RuntimeError"):
        "the first problem of some rank, collected where it is reported (_usage_checks.py, _binding.py, "
        "_intake.py, _flat_group.py), with 'on rank …:' in front on the others",
    ("shardopt/step/_usage_checks.py", "UsageChecks.refresh_local", "RuntimeError"):
        "problems[0] from ParamBinding.changes, collected in _binding.py",
    ("shardopt/checkpoint/__init__.py", "_write", "raise"):
        "re-raises write_blocks's error (_dcp.py _reraise's, listed below) or agree's (_files.py), on every rank",
    ("shardopt/checkpoint/_files.py", "agree", "restated"):
        "another rank's error as 'on rank …: …: …' (its class's name and message), of the class _files.restated "
        "gives it: the entry 'An error that names another rank'",
    ("shardopt/checkpoint/_dcp.py", "_reraise", "restated"):
        "DCP's failures as 'writing checkpoint … failed: rank …: …: …' or 'reading checkpoint …', of the class "
        "_files.restated gives the first OSError among them (else the first): the entry 'Writing or reading "
        "the checkpoint failed'",
    ("shardopt/checkpoint/_dcp.py", "write_blocks", "raise"):
        "re-raises this rank's own torch.OutOfMemoryError from DCP outside its steps (not a collective's failure)",
    ("shardopt/checkpoint/_dcp.py", "write_blocks", "CollectiveFailed"):
        "torch's own error from a collective of DCP's, restated by Comm.collective_failed (collected there)",
    ("shardopt/checkpoint/_dcp.py", "read_blocks", "CollectiveFailed"):
        "torch's own error from a collective of DCP's, restated by Comm.collective_failed (collected there)",
    ("shardopt/checkpoint/_dcp.py", "read_blocks", "raise"):
        "re-raises this rank's own torch.OutOfMemoryError from DCP outside its steps, or torch's own error from "
        "DCP in the converter, which runs without ranks (no collectives)",
    ("shardopt/integrations/accelerate.py", "ShardedAcceleratedOptimizer.__getattr__", "AttributeError"):
        "the attribute name only, as Python's own AttributeError for a missing attribute",
    ("shardopt/kernels/fused.py", "with_fallback.run", "raise"):
        "re-raises the compiled kernel's own error with a note from _ran_and_failed (its entry: 'An error "
        "raised by the fused kernel while it ran')",
    ("shardopt/step/_copies.py", "DeclaredCopies.check_once", "ValueError"):
        "the problems DeclaredCopies._compare found on this rank (its two messages, collected there), joined",
    ("shardopt/kernels/__init__.py", "Kernels._compile_failed", "error"):
        "with SHARDOPT_KERNEL=fused, re-raises torch.compile's own error (from a fused function's first call, "
        "fused.with_fallback, or from the self-check at construction)",
}


@dataclass(frozen=True)
class Message:
    file: str  # relative to the repository root
    function: str  # enclosing qualified name, "<module>" at module level
    kind: str  # exception class, warning category, "log.warning" or "stderr"
    pattern: str  # literal text with HOLE for each placeholder

    @property
    def text(self) -> str:
        return normalise(self.pattern.replace(HOLE, ELLIPSIS))

    @property
    def key(self) -> str:
        fragments = [normalise(f) for f in self.pattern.split(HOLE)]
        longest = max(fragments, key=len)
        return longest if len(longest) >= MIN_KEY else self.text

    def __str__(self) -> str:
        return f"{self.file}:{self.function}: {self.text}"


@dataclass(frozen=True)
class Unresolved:
    file: str
    function: str
    kind: str
    line: int
    source: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.file, self.function, self.kind)


def normalise(text: str) -> str:
    return " ".join(text.split())


def page_text(markdown: str) -> str:
    """The page's text for matching: blockquote markers dropped, whitespace collapsed."""
    lines = [re.sub(r"^\s*(>\s?)+", "", line) for line in markdown.splitlines()]
    return normalise("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# The collector


class Module:
    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.rel = path.relative_to(ROOT).as_posix()
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        self.name = ".".join(parts)
        self.package = self.name if path.name == "__init__.py" else self.name.rpartition(".")[0]
        self.tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        self.constants: dict[str, list[ast.expr]] = {}  # module-level name -> assigned values
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}  # "f", "Class.method"
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module, name there)
        self.modules: dict[str, str] = {}  # local name -> module
        self.loggers: set[str] = set()
        self.warn_names: set[str] = set()  # names bound to warnings.warn
        for node in self.tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        self.constants.setdefault(t.id, []).append(node.value)
                        if _is_get_logger(node.value):
                            self.loggers.add(t.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.functions[f"{node.name}.{item.name}"] = item
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.modules[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node)
                for a in node.names:
                    local = a.asname or a.name
                    if base == "warnings" and a.name == "warn":
                        self.warn_names.add(local)
                    self.imports[local] = (base, a.name)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package.split(".")
        if node.level > 1:
            base = base[: len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))


def _receiver(f: ast.Attribute) -> str:
    v = f.value
    return v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else ""


def _is_get_logger(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "logging")


def _format_holes(pattern: str, known: dict[str, str] | None = None) -> str:
    """str.format on a pattern: a field whose keyword argument is a known string takes its text,
    every other replacement field becomes a placeholder."""
    known = known or {}

    def field(m: re.Match) -> str:
        text = m.group()
        if text in ("{{", "}}"):
            return text[0]
        return known.get(text[1:-1], HOLE)
    return re.sub(r"\{\{|\}\}|\{[^{}]*\}", field, pattern)


def _percent_holes(pattern: str) -> str:
    """%-formatting on a pattern: each conversion becomes a placeholder."""
    return re.sub(r"%%|%(?:\([^)]*\))?[-#0 +]*(?:\d+|\*)?(?:\.\d+)?[diouxXeEfFgGcrsa]",
                  lambda m: "%" if m.group() == "%%" else HOLE, pattern)


def _combine(*alternatives: list[str] | None) -> list[str] | None:
    if any(a is None for a in alternatives):
        return None
    out = ["".join(parts) for parts in itertools.product(*alternatives)]  # type: ignore[arg-type]
    return out[:MAX_ALTERNATIVES]


class Collector:
    def __init__(self, root: pathlib.Path = PACKAGE) -> None:
        self.modules = {m.name: m for m in (Module(p) for p in sorted(root.rglob("*.py")))}
        self.messages: list[Message] = []
        self.unresolved: list[Unresolved] = []
        for m in self.modules.values():
            self._visit(m, m.tree, [], [])

    # -- walking: keeps the stack of enclosing classes/functions ---------------------------------
    def _visit(self, mod: Module, node: ast.AST, names: list[str], scopes: list[ast.AST]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                self._visit(mod, child, names + [child.name], scopes)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                name = child.name if not isinstance(child, ast.Lambda) else "<lambda>"
                self._visit(mod, child, names + [name], scopes + [child])
            else:
                if isinstance(child, ast.Raise):
                    self._raise(mod, child, names, scopes)
                elif isinstance(child, ast.Call):
                    self._call(mod, child, names, scopes)
                self._visit(mod, child, names, scopes)

    def _raise(self, mod: Module, node: ast.Raise, names: list[str], scopes: list[ast.AST]) -> None:
        exc = node.exc
        if isinstance(exc, ast.Call):
            f = exc.func
            kind = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ast.unparse(f)
            arg = exc.args[0] if exc.args else None
        else:
            kind = "raise" if exc is None else ast.unparse(exc)
            arg = None
        self._record(mod, node, names, scopes, kind, arg)

    def _call(self, mod: Module, node: ast.Call, names: list[str], scopes: list[ast.AST]) -> None:
        f = node.func
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if ((isinstance(f, ast.Attribute) and f.attr == "warn" and isinstance(f.value, ast.Name)
             and f.value.id == "warnings") or (isinstance(f, ast.Name) and f.id in mod.warn_names)):
            arg = node.args[0] if node.args else kw.get("message")
            cat = node.args[1] if len(node.args) > 1 else kw.get("category")
            kind = ("UserWarning" if cat is None else cat.id if isinstance(cat, ast.Name)
                    else cat.attr if isinstance(cat, ast.Attribute) else ast.unparse(cat))
            self._record(mod, node, names, scopes, kind, arg, percent=False)
        elif (isinstance(f, ast.Attribute) and f.attr in ("warning", "warn", "error", "critical", "exception")
              and isinstance(f.value, ast.Name) and (f.value.id in mod.loggers or f.value.id == "logging")):
            arg = node.args[0] if node.args else kw.get("msg")
            self._record(mod, node, names, scopes, f"log.{f.attr}", arg, percent=True)
        elif isinstance(f, ast.Attribute) and (f.attr in REPORTERS or (f.attr == "append" and _receiver(f).endswith(
                "problems"))):
            at = REPORTERS.get(f.attr, 0)
            self._record(mod, node, names, scopes, "RuntimeError", node.args[at] if len(node.args) > at else None)
        elif (isinstance(f, ast.Name) and f.id == "print" and "file" in kw
              and ast.unparse(kw["file"]) == "sys.stderr"):
            self._record(mod, node, names, scopes, "stderr", node.args[0] if node.args else None)

    def _record(self, mod: Module, node: ast.AST, names: list[str], scopes: list[ast.AST], kind: str,
                arg: ast.expr | None, percent: bool = False) -> None:
        """One message site: each resolved alternative is a message; a site with an alternative that
        cannot be resolved, or that has no literal text, is (also) unresolved."""
        function = ".".join(names) or "<module>"
        patterns: list[str] = []
        failed = False
        for branch in _branches(arg):  # a conditional message: each branch on its own
            resolved = None if branch is None else self.resolve(mod, branch, scopes, set())
            failed |= resolved is None
            patterns += resolved or []
        if percent:
            patterns = [_percent_holes(p) for p in patterns]
        literal = [p for p in patterns if p.replace(HOLE, "").strip()]
        self.messages += [Message(mod.rel, function, kind, p) for p in literal]
        if failed or len(literal) < len(patterns):
            self.unresolved.append(Unresolved(mod.rel, function, kind, node.lineno, ast.unparse(node)[:120]))

    # -- resolving an expression to string patterns ----------------------------------------------
    def resolve(self, mod: Module, node: ast.expr, scopes: list[ast.AST], seen: set) -> list[str] | None:
        if isinstance(node, ast.Constant):
            return [node.value] if isinstance(node.value, str) else None
        if isinstance(node, ast.JoinedStr):
            parts: list[list[str] | None] = []
            for v in node.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    parts.append([v.value])
                else:
                    parts.append([HOLE])
            return _combine(*parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return _combine(self.resolve(mod, node.left, scopes, seen), self.resolve(mod, node.right, scopes, seen))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            left = self.resolve(mod, node.left, scopes, seen)
            return None if left is None else [_percent_holes(p) for p in left]
        if isinstance(node, ast.IfExp):
            a, b = self.resolve(mod, node.body, scopes, seen), self.resolve(mod, node.orelse, scopes, seen)
            return None if a is None or b is None else (a + b)[:MAX_ALTERNATIVES]
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "format":
                base = self.resolve(mod, f.value, scopes, seen)
                known = {}
                for k in node.keywords:
                    value = self.resolve(mod, k.value, scopes, seen) if k.arg else None
                    if value is not None and len(value) == 1 and HOLE not in value[0]:
                        known[k.arg] = value[0]
                return None if base is None else [_format_holes(p, known) for p in base]
            target = self._function(mod, f, scopes)
            if target is not None:
                return self._returns(*target, seen)
            return None
        if isinstance(node, ast.Name):
            return self._name(mod, node.id, scopes, seen)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            other = self._module_named(mod, node.value.id)
            if other is not None:
                return self._name(other, node.attr, [], seen)
        return None

    def _module_named(self, mod: Module, local: str) -> Module | None:
        if local in mod.modules:
            return self.modules.get(mod.modules[local])
        if local in mod.imports:
            base, name = mod.imports[local]
            return self.modules.get(f"{base}.{name}")
        return None

    def _name(self, mod: Module, name: str, scopes: list[ast.AST], seen: set) -> list[str] | None:
        for scope in reversed(scopes):
            bound = _local_assignments(scope, name)
            if bound is None:
                return None  # bound in a way that is not simple (a parameter, a loop, unpacking)
            values, additions = bound
            if values:
                token = (mod.name, id(scope), name)
                bases = self._union(mod, values, [scope], seen, token)
                if bases is None or not additions:
                    return bases
                extra = self._union(mod, additions, [scope], seen, token)
                return None if extra is None else (bases + [b + e for b in bases for e in extra])[:MAX_ALTERNATIVES]
        if name in mod.constants:
            return self._union(mod, mod.constants[name], [], seen, (mod.name, name))
        if name in mod.imports:
            base, there = mod.imports[name]
            other = self.modules.get(base)
            if other is not None and there in other.constants:
                return self._name(other, there, [], seen)
        return None

    def _union(self, mod: Module, values: list[ast.expr], scopes: list[ast.AST], seen: set,
               token: tuple) -> list[str] | None:
        if token in seen:
            return None
        seen = seen | {token}
        out: list[str] = []
        for v in values:
            r = self.resolve(mod, v, scopes, seen)
            if r is None:
                return None
            out += [p for p in r if p not in out]
        return out[:MAX_ALTERNATIVES]

    def _function(self, mod: Module, f: ast.expr, scopes: list[ast.AST]) -> tuple | None:
        if isinstance(f, ast.Name):
            if f.id in mod.functions:
                return mod, mod.functions[f.id]
            if f.id in mod.imports:
                base, there = mod.imports[f.id]
                other = self.modules.get(base)
                if other is not None and there in other.functions:
                    return other, other.functions[there]
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            other = self._module_named(mod, f.value.id)
            if other is not None and f.attr in other.functions:
                return other, other.functions[f.attr]
            if f.value.id in ("self", "cls"):  # a method of this module's classes, when the name is unique
                methods = [fn for qual, fn in mod.functions.items() if qual.endswith("." + f.attr)]
                if len(methods) == 1:
                    return mod, methods[0]
        return None

    def _returns(self, mod: Module, fn: ast.AST, seen: set) -> list[str] | None:
        returns = [n.value for n in _own_nodes(fn) if isinstance(n, ast.Return)]
        if not returns or any(v is None for v in returns):
            return None
        return self._union(mod, returns, [fn], seen, (mod.name, "return", id(fn)))


def _branches(node: ast.expr | None) -> list[ast.expr | None]:
    if isinstance(node, ast.IfExp):
        return _branches(node.body) + _branches(node.orelse)
    return [node]


def _own_nodes(fn: ast.AST):
    """The nodes of a function's body, not those of functions or classes nested in it."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(n))


def _local_assignments(scope: ast.AST, name: str) -> tuple[list[ast.expr], list[ast.expr]] | None:
    """How ``name`` is bound in ``scope``: the values of its plain assignments and the right-hand
    sides of its ``+=`` (each taken as one optional suffix of any assigned value: the ``msg = ...;
    if a: msg += ...; elif b: msg += ...`` idiom); ([], []) if it is not bound there, None if it is
    bound otherwise (a parameter, a loop target, unpacking, an ``as`` name)."""
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        params = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
        if any(p.arg == name for p in params):
            return None
    values: list[ast.expr] = []
    additions: list[ast.expr] = []
    for n in _own_nodes(scope):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name) and t.id == name:
                    values.append(n.value)
                elif any(isinstance(x, ast.Name) and x.id == name for x in ast.walk(t)):
                    return None
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
            if n.value is not None:
                values.append(n.value)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
            if not isinstance(n.op, ast.Add):
                return None
            additions.append(n.value)
        elif isinstance(n, ast.ExceptHandler):
            if n.name == name:
                return None
        elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension, ast.NamedExpr, ast.With, ast.AsyncWith)):
            targets = [i.optional_vars for i in n.items if i.optional_vars] if hasattr(n, "items") else [n.target]
            if any(isinstance(x, ast.Name) and x.id == name for t in targets for x in ast.walk(t)):
                return None
    return values, additions


# ---------------------------------------------------------------------------------------------
# The check


def missing(messages: list[Message], text: str) -> list[str]:
    """``file:function: pattern`` for each message whose key is not in ``text`` (the page's text)."""
    page = page_text(text)
    return [str(m) for m in messages if m.key not in page]


_COLLECTED: Collector | None = None


def collected() -> Collector:
    global _COLLECTED
    if _COLLECTED is None:
        _COLLECTED = Collector()
    return _COLLECTED


def test_every_message_is_on_the_page() -> None:
    gone = missing(collected().messages, PAGE.read_text(encoding="utf-8"))
    assert not gone, f"{len(gone)} messages have no entry in docs/troubleshooting.md:\n" + "\n".join(gone)


def test_every_unresolved_message_is_accounted_for() -> None:
    unlisted = [u for u in collected().unresolved if u.key not in UNRESOLVED]
    assert not unlisted, ("raises/warnings whose message the collector cannot resolve; add them to UNRESOLVED "
                          "with where their text comes from:\n"
                          + "\n".join(f"{u.key} line {u.line}: {u.source}" for u in unlisted))


def test_unresolved_has_no_stale_entries() -> None:
    present = {u.key for u in collected().unresolved}
    stale = [k for k in UNRESOLVED if k not in present]
    assert not stale, f"UNRESOLVED entries that match no unresolved raise or warning: {stale}"


def _find(messages: list[Message], file: str, kind: str, fragment: str) -> Message:
    hits = [m for m in messages if m.file == file and m.kind == kind and fragment in m.text]
    assert hits, f"the collector missed the {kind} in {file} that says {fragment!r}"
    return hits[0]


def test_the_collector_is_not_vacuous() -> None:
    messages = collected().messages
    assert len(messages) >= 120, len(messages)
    sparse = _find(messages, "shardopt/group/_intake.py", "TypeError", "got a sparse gradient; shardopt needs dense")
    _find(messages, "shardopt/checkpoint/_files.py", "ValueError", "is corrupt: … does not match the checksum")
    # a module-level constant through .format(), both branches of a conditional
    _find(messages, "shardopt/group/_grad_placeholder.py", "RuntimeError", "so p.grad holds no values (it was read by …)")
    _find(messages, "shardopt/group/_grad_placeholder.py", "RuntimeError", "is being summed in fp32 by the optimizer under")
    # a warning; a constant formatted with a known keyword; a problem reported at the next step
    _find(messages, "shardopt/step/_usage_checks.py", "UserWarning", "loss.backward() ran without the loss scale")
    _find(messages, "shardopt/step/_usage_checks.py", "RuntimeError", "a second time, into gradients that stage 2 keeps")
    _find(messages, "shardopt/step/_usage_checks.py", "RuntimeError", "was replaced by a tensor after backward")
    # a helper's return value (missing_checkpoint_message), with its local += suffixes
    files = "shardopt/checkpoint/_files.py"
    _find(messages, files, "FileNotFoundError", "no checkpoint at …: the directory does not exist")
    _find(messages, files, "FileNotFoundError", "an overwrite was interrupted and left")
    _find(messages, "shardopt/estimate/__main__.py", "stderr", "error: --world-size must be >= 1")

    # the same check, on the page with the sparse-gradient entry removed, reports that message
    page = PAGE.read_text(encoding="utf-8")
    entries = re.split(r"(?m)^(?=#{2,3} )", page)
    assert page_text(page).count(sparse.key) == 1
    cut = "".join(e for e in entries if sparse.key not in page_text(e))
    assert len(cut) < len(page)
    assert str(sparse) in missing(messages, cut)
    assert str(sparse) not in missing(messages, page)


def test_keys() -> None:
    short = Message("f.py", "f", "ValueError", f"on rank {HOLE}: {HOLE}")
    assert short.key == "on rank …: …"
    long = Message("f.py", "f", "ValueError", f"unknown  moments={HOLE};\n choose one of {HOLE}")
    assert long.key == "unknown moments="
    assert _format_holes("a {x} {{b}} {0:>3}") == f"a {HOLE} {{b}} {HOLE}"
    assert _format_holes("a {x} {y}", {"x": "X"}) == f"a X {HOLE}"
    assert _percent_holes("step %d at %g, 100%%") == f"step {HOLE} at {HOLE}, 100%"
    assert page_text("> `a\n> b`  c") == "`a b` c"


def _anchors(markdown: str) -> set[str]:
    """The anchors MkDocs (Python-Markdown's toc) gives the headings of a page, outside code fences
    (its slugify, restated: the test tier does not install the docs' packages)."""
    import unicodedata

    def slugify(value: str, sep: str) -> str:
        value = unicodedata.normalize("NFKD", value).encode("ascii", "ignore").decode("ascii")
        return re.sub(rf"[{sep}\s]+", sep, re.sub(r"[^\w\s-]", "", value).strip().lower())

    text = re.sub(r"(?ms)^```.*?^```", "", markdown)
    return {slugify(re.sub(r"[`*]", "", h).strip(), "-") for h in re.findall(r"(?m)^#{1,6} (.+)$", text)}


def test_links_on_the_page_point_at_existing_headings() -> None:
    page = PAGE.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]*)\)", page)
    assert links
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        assert not target.startswith(("/", "..")) and "://" not in link, link  # pages in docs/ only
        text = page if not target else (PAGE.parent / target).read_text(encoding="utf-8")
        if anchor and anchor not in _anchors(text):
            broken.append(link)
    assert not broken, broken
    headings = re.findall(r"(?m)^#{2,3} (.+)$", page)
    assert len(headings) == len(set(headings)), "duplicate headings get unstable anchors"
