"""The pluggy markers of the ``hyper_parallel`` project.

``hookimpl`` marks a plugin's hook implementations; ``hookspec`` marks the
specifications in :mod:`hyper_parallel.core.plugin.hookspecs`.
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]

#: The pluggy project name, which is also the entry-point group plugins are found in.
PROJECT_NAME = "hyper_parallel"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
