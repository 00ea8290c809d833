"""Every code block of README.md and docs/*.md runs under pytest, through Sybil.

Each page is one test module: its ``python`` blocks run in order in one
namespace, its ``bash`` blocks in a shell, both in an empty working directory
of the page's own. A block that cannot run here (it needs your model, a
cluster, or minutes) is marked as a fragment on the line above it::

    <!-- skip: next "fragment: needs your model" -->

and reported as skipped; ``tests/test_docs.py`` still compiles it. A hidden
setup a page needs goes in an ``<!-- invisible-code-block: python -->``
comment. ``docs/plugins.md`` is run by ``tests/test_docs.py``, which first
installs the plugin package its file blocks make up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

#: How long one shell block may run.
_SHELL_TIMEOUT_S = 300


def run_shell_block(example: Example) -> None:
    """Run a ``bash`` block with ``set -e -o pipefail``; its output in the failure if it fails."""
    bin_dir = Path(sys.executable).parent  # the console scripts of this environment
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", str(example.parsed)],
        capture_output=True, text=True, env=env, timeout=_SHELL_TIMEOUT_S,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(
            f"exit code {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )


#: The parsers of a page: fragment marks, Python blocks, shell blocks.
PARSERS = [SkipParser(), PythonCodeBlockParser(), CodeBlockParser("bash", run_shell_block)]


@pytest.fixture(scope="module")
def docs_page() -> Iterator[None]:
    """One page's surroundings: an empty working directory, one thread, fresh plugins.

    Muon iterates in float32 as in the tests (bf16 is 30x slower on a CPU without it), on
    the table's paths (tuning off; a page that turns it on writes into its own directory).
    """
    import tempfile

    import torch

    from hyper_parallel import get_registry
    from hyper_parallel_builtins.muon._options import NS_DTYPE_ENV
    from hyper_parallel_builtins.newton_schulz import CACHE_DIR_ENV, TUNING_ENV

    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as where, pytest.MonkeyPatch.context() as patch:
        patch.chdir(where)
        patch.setenv(NS_DTYPE_ENV, "float32")
        patch.setenv(TUNING_ENV, "off")  # fixed paths, and nothing written to the user's cache
        patch.setenv(CACHE_DIR_ENV, where)
        torch.set_num_threads(1)  # the examples are tiny: a thread pool only adds contention
        get_registry().reset()
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            get_registry().reset()


pytest_collect_file = Sybil(
    parsers=PARSERS,
    patterns=["README.md", "docs/*.md"],
    excludes=["docs/plugins.md"],
    fixtures=["docs_page"],
    name="docs",
).pytest()
