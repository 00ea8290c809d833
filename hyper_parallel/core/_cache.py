"""The per-user cache directory: what HyperParallel measures or builds once and keeps.

Newton-Schulz's tuned paths and ``hyper-parallel train``'s built-in corpora
are kept here, so a later run on the same machine reads them instead of
doing the work again.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "default_cache_dir"]

#: Environment variable: the directory HyperParallel caches in (:func:`default_cache_dir`).
CACHE_DIR_ENV = "HYPER_PARALLEL_CACHE_DIR"


def default_cache_dir() -> Path:
    """:data:`CACHE_DIR_ENV`, else the platform's per-user cache directory + ``hyper_parallel``.

    Linux and other Unix: ``$XDG_CACHE_HOME`` or ``~/.cache``; macOS:
    ``~/Library/Caches``; Windows: ``%LOCALAPPDATA%\\hyper_parallel\\Cache``.
    """
    given = os.environ.get(CACHE_DIR_ENV, "").strip()
    if given:
        return Path(given).expanduser()
    home = Path.home()
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA", "").strip()
        return (Path(local) if local else home / "AppData" / "Local") / "hyper_parallel" / "Cache"
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "hyper_parallel"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else home / ".cache") / "hyper_parallel"
