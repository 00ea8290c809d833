"""The architecture page names only code that exists.

``docs/architecture.md`` walks through the code by name. A name there that the
code no longer has sends a reader looking for nothing, so every code name the
page writes in backticks (inline code, outside fenced blocks) must exist in the
project: ``hyper_parallel/``, ``plugins/hyper_parallel_builtins/``, and
``tests/`` for the checks the page cites. What counts as a code name:

* **A call is its callee.** Every ``(...)`` is dropped (``need()`` is
  ``need``, ``a.f(x).g(y)`` is ``a.f.g``), and a keyword's value too
  (``team_size="auto"`` is the keyword ``team_size``). A leading ``$`` goes.
  What is left must be one identifier, a dotted path of identifiers, or a file
  or folder path; anything else (an expression such as ``A @ B``, a command, a
  flag, a quoted value, a TOML key) is not a code name.
* **A file** (``_plan.py``, ``core/optimizer/_chained.py``) is a ``.py`` file
  of the project whose path ends with it; **a folder** (``muon/``) is a folder
  of the project whose path ends with it; a configuration or text file
  (``pyproject.toml``) is a file at the repository's root.
* **An environment variable** (``HYPER_PARALLEL_...``, with or without ``$``
  or ``=value``) is a string in the shipped code (the tests' strings left out).
* **A keyword** (``name=...``) is a parameter, a keyword argument or an
  assigned name somewhere in the project.
* **A dotted path** starting at ``torch`` or ``dist`` (torch.distributed, as
  the page writes it) is torch's and is not checked. Any other resolves
  strictly: its head is a module (written in full or by its last parts:
  ``hyper_parallel.core.compat``, ``core.compat``, ``toolkit``) or a class of
  the project, and each following part an attribute of the one before (for a
  class: of it or its bases, or an attribute its methods set on ``self``, or
  an annotated field). A lowercase head that does not resolve so is a
  variable of the prose (``optimizer.step()``, ``self._plans``): then each
  following part must be a name defined somewhere in the project. A
  capitalised head that is not a class of the project is torch's or Python's
  if they have it (``Optimizer.__init__``), else missing.
* **One identifier** is checked when it is written as a call, or holds an
  underscore or a capital letter (``ChainedOptimizer``, ``map_prepared_blocks``,
  ``LAYERS``, ``_bucket``). It must be defined in the project (a ``def``, a
  ``class``, an assigned name or attribute, a parameter, a module or package)
  or be a plugin name the registry holds (``torch_muon``). A name the project
  does not define but Python's builtins or torch have (``ValueError``,
  ``Shard``, ``all_gather_object``) is theirs and not checked. A single
  lowercase word that is not called (``muon``, ``auto``, ``train``) is a
  plugin name, an option's value or a command word, and is not checked.

The built-ins table names every module of each built-in package in that
package's row too, so a module added there is described.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

from hyper_parallel import get_registry

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/architecture.md"
#: Where the page's names must be defined: the library, the built-ins, and the tests the page cites.
SOURCE_ROOTS = ("hyper_parallel", "plugins/hyper_parallel_builtins", "tests")
#: Roots of dotted paths that are torch's own.
FOREIGN_ROOTS = frozenset({"torch", "dist"})
#: Where a name the project does not define may be torch's.
TORCH_NAMESPACES = (
    "torch",
    "torch.nn",
    "torch.optim",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.placement_types",
    "torch.distributed.fsdp",
)

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"{_IDENT}(?:\.{_IDENT})*")
_FILE = re.compile(r"(?:[\w.-]+/)*[\w.-]+\.py")
_OTHER_FILE = re.compile(r"[\w.-]+\.(?:toml|cfg|ini|md|txt|json|ya?ml)")
_FOLDER = re.compile(r"(?:[\w.-]+/)+")
_ENV = re.compile(r"HYPER_PARALLEL_[A-Z0-9_]+")
_KEYWORD = re.compile(rf"({_IDENT})=.*", re.DOTALL)
_SPAN = re.compile(r"`([^`]+)`")
_FENCE = re.compile(r"^\s*(```|~~~)")


# -- what the page names ------------------------------------------------------------------


@dataclass(frozen=True)
class Name:
    """One code name of the page: ``kind`` says how it is checked."""

    line: int
    span: str  # as the page writes it
    kind: str  # "file", "repository file", "folder", "env", "keyword", "dotted", "identifier"
    name: str


def _spans(text: str) -> Iterator[tuple[int, str]]:
    """Each inline code span of ``text`` with the line it starts on; fenced blocks left out."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    prose = "\n".join(lines)
    for match in _SPAN.finditer(prose):
        yield prose.count("\n", 0, match.start()) + 1, match.group(1)


def _without_calls(span: str) -> str:
    """``span`` with every parenthesised part removed, innermost first."""
    previous = None
    while previous != span:
        previous, span = span, re.sub(r"\([^()]*\)", "", span)
    return span


def code_names(text: str) -> list[Name]:
    """The code names in ``text``'s backticks, by the rule of this module's docstring."""
    found = []
    for line, span in _spans(text):
        bare = _without_calls(span.strip())
        called = bare != span.strip()
        bare = bare.removeprefix("$")
        keyword = _KEYWORD.fullmatch(bare)
        if _FILE.fullmatch(bare):
            found.append(Name(line, span, "file", bare))
        elif _OTHER_FILE.fullmatch(bare):
            found.append(Name(line, span, "repository file", bare))
        elif _FOLDER.fullmatch(bare):
            found.append(Name(line, span, "folder", bare))
        elif env := _ENV.match(bare):
            found.append(Name(line, span, "env", env.group(0)))
        elif keyword:
            found.append(Name(line, span, "keyword", keyword.group(1)))
        elif not _DOTTED.fullmatch(bare):
            continue  # an expression, a command, a flag, a value: not a name
        elif "." in bare:
            found.append(Name(line, span, "dotted", bare))
        elif called or (re.search(r"[A-Za-z]", bare) and re.search(r"[A-Z_]", bare)):
            found.append(Name(line, span, "identifier", bare))
    return found


# -- what the project defines -------------------------------------------------------------


@dataclass
class Project:
    """What the source trees define, read from their syntax."""

    files: list[str]  # paths relative to the repository root
    folders: list[str]  # likewise, each ending in "/"
    modules: list[str]  # importable dotted names (tests and __main__ modules left out)
    defined: set[str]  # def, class, assigned names and attributes, parameters, modules
    keywords: set[str]  # parameters, keyword arguments, assigned names
    strings: set[str]  # every string constant of the shipped code (the tests' left out)
    classes: dict[str, set[str]]  # class name -> modules that define it at top level
    self_attrs: dict[tuple[str, str], set[str]]  # (module, class) -> attributes set on self


def _module_name(path: Path) -> str | None:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "tests" or parts[-1] == "__main__":
        return None
    if parts[0] == "plugins":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _targets(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.Tuple | ast.List):
        for element in node.elts:
            yield from _targets(element)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


def _read(path: Path, project: Project, module: str | None, shipped: bool) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            project.defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.NamedExpr):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                project.defined.update(_targets(target))
        elif isinstance(node, ast.arguments):
            every = [*node.posonlyargs, *node.args, *node.kwonlyargs, node.vararg, node.kwarg]
            project.keywords.update(a.arg for a in every if a is not None)
        elif isinstance(node, ast.keyword) and node.arg:
            project.keywords.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and shipped:
            project.strings.add(node.value)
    if module is None:
        return
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        project.classes.setdefault(node.name, set()).add(module)
        on_self = project.self_attrs.setdefault((module, node.name), set())
        for inner in ast.walk(node):
            if not (isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store)):
                continue
            if isinstance(inner.value, ast.Name) and inner.value.id == "self":
                on_self.add(inner.attr)


@cache
def project() -> Project:
    found = Project([], [], [], set(), set(), set(), {}, {})
    for root in SOURCE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            relative = path.relative_to(ROOT)
            found.files.append(relative.as_posix())
            module = _module_name(path)
            if module is not None:
                found.modules.append(module)
            found.defined.add(path.stem)
            found.defined.add(path.parent.name)
            for folder in relative.parents[:-1]:
                if f"{folder.as_posix()}/" not in found.folders:
                    found.folders.append(f"{folder.as_posix()}/")
            _read(path, found, module, shipped=root != "tests")
    found.keywords |= found.defined
    return found


@cache
def registered_names() -> frozenset[str]:
    """Every plugin's and every registered object's name."""
    entries = get_registry().entries()
    return frozenset({e.name for e in entries} | {e.plugin for e in entries})


def _foreign(name: str) -> bool:
    """Whether Python's builtins or one of :data:`TORCH_NAMESPACES` has ``name``."""
    if hasattr(builtins, name):
        return True
    return any(hasattr(importlib.import_module(ns), name) for ns in TORCH_NAMESPACES)


def _member(owner: object, part: str) -> object | None:
    """``owner``'s attribute ``part``, a submodule, or (for a class) a name its code sets."""
    if isinstance(owner, ModuleType):
        if hasattr(owner, part):
            found: object = getattr(owner, part)
            return found
        try:
            return importlib.import_module(f"{owner.__name__}.{part}")
        except ImportError:
            return None
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if part in vars(klass):
                member: object = vars(klass)[part]
                return member
            if part in vars(klass).get("__annotations__", {}):
                return object()  # a field: an instance's value, not checked further
            if part in project().self_attrs.get((klass.__module__, klass.__name__), ()):
                return object()
    return None


def _walk(owner: object, parts: list[str]) -> bool:
    for part in parts:
        member = _member(owner, part)
        if member is None:
            return False
        owner = member
    return True


def _resolves(parts: list[str]) -> bool:
    """Whether ``parts`` resolve from a module of the project (by its full name or last parts)."""
    modules = project().modules
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        for module in modules:
            named = module == head or module.endswith(f".{head}")
            if named and _walk(importlib.import_module(module), parts[cut:]):
                return True
    for module in project().classes.get(parts[0], ()):
        if _walk(getattr(importlib.import_module(module), parts[0]), parts[1:]):
            return True
    return False


def missing(name: Name) -> str | None:
    """Why ``name`` names nothing in the project, or ``None`` where it exists (or is not ours)."""
    known = project()
    if name.kind == "file":
        if not any(f == name.name or f.endswith(f"/{name.name}") for f in known.files):
            return "no such file in the project"
    elif name.kind == "repository file":
        if not (ROOT / name.name).is_file():
            return "no such file at the repository's root"
    elif name.kind == "folder":
        if not any(f == name.name or f.endswith(f"/{name.name}") for f in known.folders):
            return "no such folder in the project"
    elif name.kind == "env":
        if name.name not in known.strings:
            return "no environment variable of that name is read"
    elif name.kind == "keyword":
        if name.name not in known.keywords:
            return "no parameter or keyword of that name"
    elif name.kind == "dotted":
        parts = name.name.split(".")
        if parts[0] in FOREIGN_ROOTS or _resolves(parts):
            return None
        if parts[0] in known.classes:
            return f"{parts[0]} has no such attribute"
        if parts[0][0].isupper():
            return None if _foreign(parts[0]) else f"no class {parts[0]} in the project"
        gone = [p for p in parts[1:] if p not in known.defined]
        if gone:
            return f"nothing defines {', '.join(gone)}"
    elif name.name not in known.defined | registered_names() and not _foreign(name.name):
        return "defined nowhere in the project"
    return None


def _report(text: str, page: str) -> list[str]:
    return [
        f"{page}:{n.line}: `{n.span}`: {why}"
        for n in code_names(text)
        if (why := missing(n)) is not None
    ]


# -- the tests ----------------------------------------------------------------------------


def test_every_code_name_on_the_architecture_page_exists() -> None:
    text = (ROOT / PAGE).read_text(encoding="utf-8")
    assert len(code_names(text)) > 50  # the page was read
    gone = _report(text, PAGE)
    assert not gone, (
        f"{PAGE} names code that does not exist (rule: tests/test_architecture_doc.py):\n"
        + "\n".join(gone)
    )


@pytest.mark.parametrize(
    ("span", "found"),
    [
        ("`ChainedOptimizer`", None),
        ("`NoSuchOptimizer`", "NoSuchOptimizer"),
        ("`map_prepared_blocks(fn, cost=...)`", None),
        ("`map_no_such_blocks`", "map_no_such_blocks"),
        ("`hyper_parallel.core.optimizer._chained`", None),
        ("`hyper_parallel.core.optimizer._no_such`", "hyper_parallel.core.optimizer._no_such"),
        ("`core.compat`", None),
        ("`toolkit.map_held_blocks`", None),
        ("`toolkit.no_such_function`", "toolkit.no_such_function"),
        ("`ChainedOptimizer.step`", None),
        ("`ChainedOptimizer.no_such_method`", "ChainedOptimizer.no_such_method"),
        ("`Workspace.take`", None),
        ("`_plan.py`", None),
        ("`_no_such_module.py`", "_no_such_module.py"),
        ("`newton_schulz/_paths.py`", None),
        ("`muon/_paths.py`", "muon/_paths.py"),
        ("`pyproject.toml`", None),
        ("`setup.cfg`", "setup.cfg"),
        ("`newton_schulz/`", None),
        ("`no_such_package/`", "no_such_package/"),
        ("`$HYPER_PARALLEL_SHARDING`", None),
        ("`HYPER_PARALLEL_NO_SUCH_SWITCH=1`", "HYPER_PARALLEL_NO_SUCH_SWITCH"),
        ('`team_size="auto"`', None),
        ("`no_such_keyword=1`", "no_such_keyword"),
        ("`torch_muon`", None),  # a registered plugin name
        ("`optimizer.step()`", None),  # a variable of the prose
        ("`optimizer.no_such_step()`", "optimizer.no_such_step"),
        # not the project's, or not names
        ("`torch.distributed`", None),
        ("`dist.all_to_all_single`", None),
        ("`Shard`", None),
        ("`ValueError`", None),
        ("`Optimizer.__init__`", None),
        ("`--threads`", None),
        ('`"muon"`', None),
        ("`muon`", None),
        ("`python -m benchmarks --cases paths`", None),
        ("`A @ B.mT`", None),
        ("`[project.entry-points.hyper_parallel]`", None),
    ],
)
def test_the_rule_finds_what_is_gone_and_only_that(span: str, found: str | None) -> None:
    reported = [n for n in code_names(f"A line.\n\nSay {span} here.\n") if missing(n)]
    assert [n.name for n in reported] == ([] if found is None else [found])
    assert all(n.line == 3 for n in reported)


def test_a_fenced_block_is_not_read_for_names() -> None:
    text = "```python\nx = `NoSuchName`\n```\n\nThen `AlsoNoSuchName`.\n"
    assert [(n.line, n.name) for n in code_names(text)] == [(5, "AlsoNoSuchName")]


def _builtin_rows(text: str) -> dict[str, tuple[int, str]]:
    """Each row of the built-ins table that describes a package (``| `name/` | ...``), by package."""
    rows = {}
    for number, line in enumerate(text.split("\n"), start=1):
        row = re.match(r"\| `(\w+)/` \|", line)
        if row:
            rows[row.group(1)] = (number, line)
    return rows


def test_each_builtin_package_row_names_every_module_of_the_package() -> None:
    text = (ROOT / PAGE).read_text(encoding="utf-8")
    rows = _builtin_rows(text)
    packages = ROOT / "plugins" / "hyper_parallel_builtins"
    expected = sorted(p.parent.name for p in packages.glob("*/__init__.py"))
    assert sorted(rows) == expected, f"{PAGE}'s built-ins table: a row per package {expected}"
    left_out = defaultdict(list)
    for package, (line, row) in rows.items():
        named = set(re.findall(r"`([^`]+\.py)`", row))
        for module in sorted((packages / package).glob("*.py")):
            described = {module.name, f"{package}/{module.name}"} & named
            if module.name != "__init__.py" and not described:
                left_out[f"{PAGE}:{line}: `{package}/`"].append(module.name)
    assert not left_out, f"rows that leave modules of their package out: {dict(left_out)}"
