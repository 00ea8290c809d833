"""Install a distribution the way a user's pip would, into a private directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["pip_install_into"]

#: What an earlier in-tree build may have left in a source tree; never copied.
_BUILD_LEFTOVERS = shutil.ignore_patterns(
    "build", "dist", "*.egg-info", ".eggs", "__pycache__", ".pytest_cache"
)


def pip_install_into(source: Path, target: Path, *, cwd: Path) -> Path:
    """``pip install`` the project at ``source`` into ``target`` (offline, no deps); returns ``target``.

    pip builds a local project in its own tree (setuptools writes ``build/`` and
    ``*.egg-info`` there), so the project is copied under ``cwd`` first and built
    from the copy: nothing is written into ``source``, which may be in the repository.
    """
    with tempfile.TemporaryDirectory(dir=cwd, prefix="pip-build-") as scratch:
        copy = Path(scratch) / Path(source).name
        shutil.copytree(source, copy, ignore=_BUILD_LEFTOVERS)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
             "--no-index", "--target", str(target), str(copy)],
            check=True,
            cwd=cwd,
        )  # fmt: skip
    return target
