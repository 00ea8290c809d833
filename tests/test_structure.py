"""The layering: core never reaches into a built-in plugin by module path."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import hyper_parallel

PACKAGE = Path(hyper_parallel.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Modules imported at run time (``if TYPE_CHECKING:`` blocks, which type checkers alone read, skipped)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
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


# Python's own protocols: a module's __getattr__ must raise AttributeError, the testing
# helpers fail a test with AssertionError, the command line exits with SystemExit.
_PROTOCOL_ERRORS = {"AttributeError", "AssertionError", "SystemExit"}


def _builtin_raises(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        name = target.id if isinstance(target, ast.Name) else ""
        builtin = getattr(builtins, name, None)
        is_error = isinstance(builtin, type) and issubclass(builtin, BaseException)
        if is_error and name not in _PROTOCOL_ERRORS:
            found.append(f"{path.name}:{node.lineno} raises {name}")
    return found


def _shipped_sources() -> list[Path]:
    """Every module of the distribution: hyper_parallel and the built-in plugins."""
    import hyper_parallel_builtins

    roots = [PACKAGE, Path(hyper_parallel_builtins.__file__).parent]
    return [path for root in roots for path in sorted(root.rglob("*.py"))]


def test_every_error_raised_is_a_hyper_parallel_error() -> None:
    found = [hit for path in _shipped_sources() for hit in _builtin_raises(path)]
    assert not found, "raise a hyper_parallel.core.errors class instead: " + ", ".join(found)


def test_the_domain_errors_are_hyper_parallel_errors_with_their_old_bases() -> None:
    from hyper_parallel.checkpoint import CheckpointError
    from hyper_parallel.core.errors import HyperParallelError
    from hyper_parallel.train.data import DataError
    from hyper_parallel.train.loop import TrainError

    for error, base in (
        (CheckpointError, RuntimeError),
        (TrainError, ValueError),
        (DataError, ValueError),
    ):
        assert issubclass(error, HyperParallelError) and issubclass(error, base), error


def test_the_guides_import_loads_no_fsdp_or_dtensor() -> None:
    """Loading FSDP and DTensor (and sympy behind them) is most of a slow import."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from hyper_parallel.core.optimizer import get_hyper_lr_scheduler, get_hyper_optimizer\n"
        "from hyper_parallel import get_registry\n"
        "get_registry().entries()\n"
        "heavy = ('torch.distributed.fsdp', 'torch.distributed.tensor', 'sympy')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


PUBLIC_MODULES = [
    "hyper_parallel",
    "hyper_parallel.checkpoint",
    "hyper_parallel.core.compat",
    "hyper_parallel.core.distributed",
    "hyper_parallel.core.distributed.toolkit",
    "hyper_parallel.core.errors",
    "hyper_parallel.core.optimizer",
    "hyper_parallel.core.options",
    "hyper_parallel.core.plugin",
    "hyper_parallel.qk_clip",
    "hyper_parallel.testing",
    "hyper_parallel_builtins.fsdp_backend.cost",
]


def test_every_public_name_is_on_the_api_page() -> None:
    import importlib
    import re

    page = (PACKAGE.parent / "docs" / "api.md").read_text(encoding="utf-8")
    missing = {
        module: [
            n
            for n in importlib.import_module(module).__all__
            if not re.search(rf"\b{re.escape(n)}\b", page)
        ]
        for module in PUBLIC_MODULES
    }
    assert not {m: names for m, names in missing.items() if names}, missing


def test_core_modules_are_public_packages_or_private_implementation() -> None:
    """Users import from the packages; the modules that implement them start with ``_``."""
    public_files = {
        PACKAGE.parent / (module.replace(".", "/") + ".py") for module in PUBLIC_MODULES
    } | {PACKAGE / "core" / "plugin" / "hookspecs.py"}  # the plugin contract, read by authors
    exposed = [
        str(path.relative_to(PACKAGE.parent))
        for path in (PACKAGE / "core").rglob("*.py")
        if path.name != "__init__.py" and not path.name.startswith("_") and path not in public_files
    ]
    assert not exposed, f"implementation modules must be private (_name.py): {exposed}"


def _private_torch_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            private = any(part.startswith("_") for part in (node.module or "").split("."))
            private = private or any(a.name.startswith("_") for a in node.names)
            if private:
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
    return found


def test_private_torch_apis_live_in_one_module() -> None:
    found = [
        hit
        for path in _shipped_sources()
        if path.name != "compat.py"
        for hit in _private_torch_imports(path)
    ]
    assert not found, "import private torch APIs through hyper_parallel.core.compat: " + ", ".join(
        found
    )
    assert _private_torch_imports(PACKAGE / "core" / "compat.py")  # the scan sees them


def _private_names_imported(path: Path) -> list[str]:
    """``hyper_parallel`` modules or names starting with ``_`` that ``path`` imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] == "hyper_parallel"
        ):
            parts = (node.module or "").split(".")
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names):
                found.append(
                    f"{path.name}:{node.lineno} from {node.module} import {', '.join(names)}"
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "hyper_parallel" and any(p.startswith("_") for p in parts):
                    found.append(f"{path.name}:{node.lineno} import {alias.name}")
    return found


def test_builtins_import_only_what_a_third_party_can() -> None:
    import hyper_parallel_builtins

    root = Path(hyper_parallel_builtins.__file__).parent
    found = [hit for path in sorted(root.rglob("*.py")) for hit in _private_names_imported(path)]
    assert not found, "built-in plugins use hyper_parallel's public API only: " + ", ".join(found)
    assert _private_names_imported(PACKAGE / "checkpoint" / "__init__.py")  # the scan sees them


#: The packages of hyper_parallel, lowest layer first: a module imports only from its own
#: layer or lower ones.
LAYERS = (
    ("core.errors", "core.options", "core.compat", "core._grads", "core._cache"),
    ("core.plugin",),
    ("core.distributed",),
    ("core.optimizer", "qk_clip"),
    ("checkpoint",),
    ("train",),
    ("cli", "testing", "__main__"),
)


def _layer(module: str) -> int | None:
    name = module.removeprefix("hyper_parallel.")
    for level, packages in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in packages):
            return level
    return None


def test_layers_point_one_way() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        level = _layer(module.removesuffix(".__init__"))
        if level is None:
            continue
        for imported in _imported_modules(path):
            other = _layer(imported) if imported.startswith("hyper_parallel.") else None
            if other is not None and other > level:
                upward.append(f"{module} imports {imported}")
    assert not upward, "a lower layer imports a higher one: " + ", ".join(upward)
    assert _layer("hyper_parallel.core.distributed._clip_grad") == 2  # the map covers core


def _names_defined_here(paths: list[Path]) -> set[str]:
    """Every name our own code defines: functions, classes, attributes, variables, modules."""
    names = {path.stem for path in paths}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[-1])
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


#: Private-looking attributes that are not torch's private API: torch's documented
#: ``torch._foreach_*`` kernels (torch.optim's own building blocks) and ``os._exit``.
_NOT_TORCH_PRIVATE = re.compile(r"^_foreach_\w+$|^_exit$")


def test_torch_private_attributes_are_used_in_the_compat_module_only() -> None:
    sources = _shipped_sources()
    ours = _names_defined_here(sources)
    found = []
    for path in sources:
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            attr = node.attr
            if attr.startswith("__") or attr in ours or _NOT_TORCH_PRIVATE.match(attr):
                continue
            found.append(f"{path.name}:{node.lineno} .{attr}")
    assert not found, "use torch's private API through hyper_parallel.core.compat: " + ", ".join(
        found
    )


#: What a package's ``__init__.py`` may define beyond re-exports: lazy lookups.
_INIT_HOOKS = {"__getattr__", "__dir__"}


def test_package_init_files_only_re_export() -> None:
    holding = []
    for path in _shipped_sources():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in tree.body:
            defines = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if defines and node.name not in _INIT_HOOKS:
                holding.append(f"{path.relative_to(path.parents[2])}:{node.lineno} {node.name}")
    assert not holding, "implementation belongs in a module, not __init__.py: " + ", ".join(holding)


#: A module longer than this says why at its top, in a docstring line "Long because ...".
_MAX_LINES = 600


def test_long_modules_say_why() -> None:
    unexplained = []
    for path in _shipped_sources():
        text = path.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > _MAX_LINES and "Long because" not in doc:
            unexplained.append(f"{path.name} ({text.count(chr(10))} lines)")
    assert not unexplained, f"split these, or say why they are long: {unexplained}"
