"""Install a distribution the way a user's pip would, into a private directory or environment.

* :func:`pip_install_into`: a project, pip-installed into a directory of its own;
* :func:`copy_project` and :func:`build_distributions`: this project's sdist and wheel,
  built from a copy of the working tree with setuptools' PEP 517 hooks;
* :func:`fresh_venv`: a virtual environment without system site-packages in which
  exactly the named distributions (and what they require) are importable, linked from
  this environment instead of downloaded, so a package left out is truly missing.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

__all__ = [
    "Venv",
    "build_distributions",
    "copy_project",
    "fresh_venv",
    "pip_install_into",
    "unpack_sdist",
]

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


#: What a working tree holds besides the project: environments, VCS, caches, runs, builds.
NOT_THE_PROJECT = (
    ".git", ".venv", "build", "dist", "*.egg-info", ".eggs", "__pycache__", ".pytest_cache",
    ".mypy_cache", ".ruff_cache", "runs", "site", ".bench-peers",
)  # fmt: skip


def copy_project(source: Path, dest: Path) -> Path:
    """Copy the project at ``source`` to ``dest`` without what :data:`NOT_THE_PROJECT` names."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(*NOT_THE_PROJECT), symlinks=True)
    return dest


def build_distributions(project: Path, out: Path) -> tuple[Path, Path]:
    """The sdist of ``project`` and the wheel built from that sdist, into ``out``: ``(sdist, wheel)``.

    As ``python -m build`` does: the wheel is built from the unpacked sdist, so a
    file the sdist lacks is missing from the wheel too. setuptools' PEP 517 hooks
    run in a subprocess, with this environment's setuptools (no build isolation);
    they write ``build/`` and ``*.egg-info`` into ``project``: pass a copy.
    """
    out.mkdir(parents=True, exist_ok=True)
    sdist = out / _build_hook(project, "build_sdist", out)
    unpacked = unpack_sdist(sdist, out / "unpacked")
    wheel = out / _build_hook(unpacked, "build_wheel", out)
    return sdist, wheel


def unpack_sdist(sdist: Path, where: Path) -> Path:
    """Unpack ``sdist`` into ``where``; the source tree it holds."""
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):  # Python 3.12, and 3.10.12 and 3.11.4 on
            archive.extractall(where, filter="data")
        else:
            archive.extractall(where)
    (tree,) = where.iterdir()
    return tree


def _build_hook(project: Path, hook: str, out: Path) -> str:
    """Run setuptools' PEP 517 ``hook`` in ``project``; the name of the file it wrote in ``out``."""
    script = (
        f"import sys\nfrom setuptools import build_meta\nprint(build_meta.{hook}(sys.argv[1]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        cwd=project, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(
            f"{hook} in {project} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return done.stdout.strip().splitlines()[-1]


def _requirement_closure(names: Iterable[str]) -> list[importlib.metadata.Distribution]:
    """The distributions named and everything they require (their extras aside), from here."""
    todo = [canonicalize_name(n) for n in names]
    found: dict[str, importlib.metadata.Distribution] = {}
    while todo:
        name = todo.pop()
        if name in found:
            continue
        dist = importlib.metadata.distribution(name)
        found[name] = dist
        for line in dist.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return list(found.values())


def _link_distributions(names: Iterable[str], into: Path) -> None:
    """Symlink the top-level files of ``names`` and of what they require into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    for dist in _requirement_closure(names):
        site = Path(str(dist.locate_file("")))
        if dist.files is None:
            raise RuntimeError(
                f"{dist.metadata['Name']} lists no files (no RECORD): cannot link it"
            )
        tops = {f.parts[0] for f in dist.files if f.parts and f.parts[0] != ".."}
        for top in sorted(tops):
            link = into / top
            if not link.exists() and (site / top).exists():
                link.symlink_to(site / top)


@dataclass(frozen=True)
class Venv:
    """A virtual environment: its interpreter and its console scripts."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def script(self, name: str) -> Path:
        return self.root / "bin" / name

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process run in this venv, as an activated shell gives it.

        pip reads no configuration file or ``PIP_*`` variable of this machine: it
        installs from what it is given, offline.
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
        env.pop("VIRTUAL_ENV", None)
        return {
            **env,
            "VIRTUAL_ENV": str(self.root),
            "PATH": f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1",
            "PIP_NO_INDEX": "1",
        }

    def pip(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        """This environment's ``pip ARGS`` (pip itself runs from here, on the venv's interpreter)."""
        return subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(self.python), *args],
            cwd=cwd, env=self.env, capture_output=True, text=True, check=False,
        )  # fmt: skip

    def add(self, distributions: Iterable[str], *, label: str) -> None:
        """Make ``distributions`` and what they require importable here, as ``label``.pth."""
        linked = self.root / f"linked-{label}"
        _link_distributions(distributions, linked)
        (_site_packages(self.python) / f"{label}.pth").write_text(f"{linked}\n", encoding="utf-8")


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(out.stdout.strip())


def fresh_venv(where: Path, distributions: Iterable[str]) -> Venv:
    """A venv at ``where`` (no system site-packages, no pip) that imports exactly ``distributions``.

    The distributions and what they require are linked from this environment,
    one symlink per top-level file, through a ``.pth`` file: nothing else this
    environment holds is importable there. pip runs from here, through
    :meth:`Venv.pip`.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    venv = Venv(where)
    venv.add(distributions, label="core")
    return venv
