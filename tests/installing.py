"""Install a distribution the way a user's pip would, into a private directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["pip_install_into"]


def pip_install_into(source: Path, target: Path, *, cwd: Path) -> Path:
    """``pip install`` the project at ``source`` into ``target`` (offline, no deps); returns ``target``.

    ``cwd`` is where pip may leave build files, so none land in the repository.
    """
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(source)],
        check=True,
        cwd=cwd,
    )  # fmt: skip
    return target
