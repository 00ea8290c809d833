"""The layering: core never reaches into a built-in plugin by module path."""

from __future__ import annotations

import ast
from pathlib import Path

import hyper_parallel

PACKAGE = Path(hyper_parallel.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_no_hyper_parallel_module_imports_a_builtin_plugin() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            m for m in _imported_modules(path) if m.split(".")[0] == "hyper_parallel_builtins"
        )
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    offenders = {path: mods for path, mods in offenders.items() if mods}
    assert not offenders, f"these modules import built-in plugins by path: {offenders}"
    assert len(list(PACKAGE.rglob("*.py"))) > 20  # the scan saw the package
