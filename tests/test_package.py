"""What pip gets: the sdist and the wheel hold what a user of the package needs.

Both are built once, the way ``python -m build`` builds them (the wheel from the
unpacked sdist), from a copy of the working tree in which a developer's usual
leftovers lie (runs, builds, caches, environments):

* both carry the Apache-2.0 LICENSE, and metadata a package index accepts and
  shows: the README as the long description, with no relative link or image,
  the project's URLs, its classifiers, its dependencies and extras;
* the wheel holds both packages, typed, an entry point for every built-in plugin
  and the ``hyper-parallel`` command;
* the sdist is the source tree, leftovers aside, and its own tests run;
* the wheel, in a fresh venv with the core dependencies and no extra, lists its
  plugins, steps an optimizer, and ``hyper-parallel train`` says in one line
  which ``pip install`` it needs, then runs once that is done.
"""

from __future__ import annotations

import configparser
import importlib
import pkgutil
import shlex
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email import message_from_string
from pathlib import Path

import pytest
from installing import (
    NOT_THE_PROJECT,
    Venv,
    build_distributions,
    copy_project,
    fresh_venv,
    unpack_sdist,
)
from packaging.metadata import Metadata
from packaging.specifiers import SpecifierSet
from test_docs import markdown_links

import hyper_parallel
import hyper_parallel_builtins

ROOT = Path(__file__).resolve().parents[1]
VERSION = hyper_parallel.__version__  # the wheel's version must be the one the package reports
#: Each package, and the folder that holds it.
PACKAGES = {"hyper_parallel": ".", "hyper_parallel_builtins": "plugins"}

pytestmark = pytest.mark.skipif(
    not (ROOT / "pyproject.toml").is_file(), reason="builds the package from its source tree"
)

#: What a developer's working tree collects, at the places it collects it.
LEFTOVERS = (
    ".venv/bin/python",
    ".bench-peers/timm/__init__.py",
    ".pytest_cache/v/cache/lastfailed",
    ".mypy_cache/3.11/torch/__init__.data.json",
    ".ruff_cache/content/x",
    "runs/train/metrics.jsonl",
    "build/__editable__.hyper_parallel-0.1.0-py3-none-any/hyper_parallel/cli.py",
    "dist/hyper_parallel-0.0.1.tar.gz",
    "site/index.html",
    "hyper_parallel/__pycache__/cli.cpython-311.pyc",
    "tests/__pycache__/test_docs.cpython-311-pytest-9.0.2.pyc",
    "docs/runs/train/loss_curves.png",
    "examples/custom_plugin/build/lib/hp_lion/lion.py",
    "examples/custom_plugin/src/hp_lion.egg-info/PKG-INFO",
)


@dataclass(frozen=True)
class Built:
    project: Path  # the copy it was built from, leftovers aside
    sdist: Path
    wheel: Path

    def wheel_names(self) -> list[str]:
        with zipfile.ZipFile(self.wheel) as wheel:
            return wheel.namelist()

    def wheel_file(self, name: str) -> bytes:
        with zipfile.ZipFile(self.wheel) as wheel:
            return wheel.read(name)

    def sdist_names(self) -> list[str]:
        """The sdist's files, relative to its top folder."""
        with tarfile.open(self.sdist) as sdist:
            return [m.name.split("/", 1)[1] for m in sdist.getmembers() if m.isfile()]

    def sdist_file(self, name: str) -> bytes:
        with tarfile.open(self.sdist) as sdist:
            member = sdist.extractfile(f"{sdist.getnames()[0].split('/')[0]}/{name}")
            assert member is not None, name
            return member.read()

    def metadata(self) -> str:
        return self.wheel_file(f"hyper_parallel-{VERSION}.dist-info/METADATA").decode()


def _files(tree: Path) -> set[str]:
    return {p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    where = tmp_path_factory.mktemp("package")
    project = copy_project(ROOT, where / "project")
    clean = where / "clean"
    copy_project(ROOT, clean)
    for leftover in LEFTOVERS:
        path = project / leftover
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("a leftover\n", encoding="utf-8")
    sdist, wheel = build_distributions(project, where / "dist")
    return Built(clean, sdist, wheel)


def _builtin_plugin_modules() -> set[str]:
    """The modules of ``hyper_parallel_builtins`` that implement a hook: the built-in plugins."""
    found = set()
    for info in pkgutil.iter_modules(hyper_parallel_builtins.__path__):
        module = importlib.import_module(f"hyper_parallel_builtins.{info.name}")
        if any(hasattr(value, "hyper_parallel_impl") for value in vars(module).values()):
            found.add(module.__name__)
    assert found, "found no built-in plugin module"
    return found


# -- the license --------------------------------------------------------------


def test_the_license_is_apache_2_and_ships_in_wheel_and_sdist(built: Built) -> None:
    license_text = (ROOT / "LICENSE").read_bytes()
    assert b"Apache License\n                           Version 2.0, January 2004" in license_text
    assert b"END OF TERMS AND CONDITIONS" in license_text
    assert built.wheel_file(f"hyper_parallel-{VERSION}.dist-info/licenses/LICENSE") == license_text
    assert built.sdist_file("LICENSE") == license_text


# -- the wheel ----------------------------------------------------------------


def test_the_wheel_holds_both_packages_typed_and_nothing_else(built: Built) -> None:
    expected = {
        f"{package}/{name}"
        for package, parent in PACKAGES.items()
        for name in _files(built.project / parent / package)
        if name.endswith(".py") or name.endswith("py.typed")
    }
    assert {"hyper_parallel/py.typed", "hyper_parallel_builtins/py.typed"} <= expected
    held = {n for n in built.wheel_names() if ".dist-info/" not in n}
    assert held == expected, (
        f"missing from the wheel: {sorted(expected - held)}; not the packages': {sorted(held - expected)}"
    )


def test_the_wheel_declares_every_builtin_plugin_and_the_command(built: Built) -> None:
    entry_points = configparser.ConfigParser(delimiters=("=",))
    entry_points.read_string(
        built.wheel_file(f"hyper_parallel-{VERSION}.dist-info/entry_points.txt").decode()
    )
    declared = {value.strip() for value in entry_points["hyper_parallel"].values()}
    assert declared == _builtin_plugin_modules(), (
        "each hyper_parallel_builtins module with a hook needs an entry point, and only those"
    )
    assert dict(entry_points["console_scripts"]) == {"hyper-parallel": "hyper_parallel.cli:run"}
    assert callable(importlib.import_module("hyper_parallel.cli").run)


# -- the metadata an index reads ----------------------------------------------

URLS = {
    "Homepage": "https://github.com/hyper-parallel/hyper_parallel",
    "Documentation": "https://hyper-parallel.github.io/hyper_parallel/",
    "Repository": "https://github.com/hyper-parallel/hyper_parallel",
    "Issues": "https://github.com/hyper-parallel/hyper_parallel/issues",
    "Changelog": "https://github.com/hyper-parallel/hyper_parallel/blob/main/CHANGELOG.md",
}
CLASSIFIERS = {
    "Development Status :: 4 - Beta",
    "Intended Audience :: Developers",
    "Intended Audience :: Science/Research",
    "Programming Language :: Python :: 3 :: Only",
    "Typing :: Typed",
}


@pytest.mark.parametrize("where", ["wheel METADATA", "sdist PKG-INFO"])
def test_the_metadata_is_valid_and_complete(built: Built, where: str) -> None:
    text = built.metadata() if where.startswith("wheel") else built.sdist_file("PKG-INFO").decode()
    metadata = Metadata.from_email(text, validate=True)  # what an index rejects, raised here
    major, minor = map(int, str(metadata.metadata_version).split("."))
    assert (major, minor) >= (2, 4)  # the version that has License-Expression
    assert (metadata.name, str(metadata.version)) == ("hyper-parallel", VERSION)
    assert metadata.summary and "\n" not in metadata.summary
    assert metadata.license_expression == "Apache-2.0"
    assert [str(p) for p in metadata.license_files or []] == ["LICENSE"]
    assert metadata.description_content_type == "text/markdown"
    assert metadata.description == (ROOT / "README.md").read_text(encoding="utf-8")
    assert metadata.project_urls == URLS

    classifiers = set(metadata.classifiers or [])
    assert classifiers >= CLASSIFIERS
    assert not [c for c in classifiers if c.startswith("License ::")]  # the expression says it
    assert [c for c in classifiers if c.startswith("Operating System ::")]
    assert [c for c in classifiers if c.startswith("Topic ::")]
    supported = SpecifierSet(str(metadata.requires_python))
    versions = {c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Programming Language :: Python :: 3.")}  # fmt: skip
    assert versions == {"3.10", "3.11", "3.12", "3.13"}
    assert all(supported.contains(v) for v in versions) and not supported.contains("3.9")

    requires = {str(r) for r in metadata.requires_dist or []}
    assert {"torch>=2.13", "pluggy>=1.5", "xxhash>=3.4"} <= requires
    assert {'matplotlib>=3.7; extra == "train"', 'tqdm>=4.60; extra == "train"'} <= requires
    assert {"train", "test", "docs", "dev"} <= {str(e) for e in metadata.provides_extra or []}


def test_the_long_description_links_and_shows_images_absolutely(built: Built) -> None:
    """An index shows the README away from the repository: a relative address breaks there."""
    description = message_from_string(built.metadata()).get_payload()
    assert isinstance(description, str)
    links = markdown_links(description)
    assert links and [kind for kind, _ in links].count("image") >= 1
    relative = [target for _, target in links if not target.startswith("https://")]
    assert not relative, f"relative (or non-https) addresses in the long description: {relative}"


# -- the sdist ----------------------------------------------------------------


def test_the_sdist_is_the_source_tree_without_leftovers(built: Built) -> None:
    names = set(built.sdist_names())
    top = {"README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml", "MANIFEST.in", "conftest.py", "mkdocs.yml", ".ci/run"}  # fmt: skip
    folders = ("hyper_parallel/", "plugins/", "tests/", "docs/", "examples/", "benchmarks/")
    wanted = {n for n in _files(built.project) if n in top or n.startswith(folders)}
    assert not wanted - names, f"missing from the sdist: {sorted(wanted - names)}"
    assert top <= names
    for folder in (*folders, "tests/data/", "tests/scripts/", "docs/img/", "benchmarks/profiles/"):
        assert any(n.startswith(folder) for n in names), folder

    leftovers = sorted(names & set(LEFTOVERS))
    leftover_parts = {p.replace("*", "") for p in NOT_THE_PROJECT}
    leftovers += sorted(
        n
        for n in names
        if n.endswith((".pyc", ".pyo"))
        or any(part in leftover_parts or part.endswith(".egg-info") for part in n.split("/")[1:-1])
        or n.split("/")[0] in leftover_parts
    )
    assert not leftovers, f"leftovers in the sdist: {leftovers}"


def test_the_sdists_own_tests_run(built: Built, tmp_path: Path) -> None:
    """The unpacked sdist runs the README's examples and the docs checks, on its own files."""
    tree = unpack_sdist(built.sdist, tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "README.md",
         "tests/test_docs.py", "-k", "not mkdocs and not example_package"],
        cwd=tree, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


# -- the wheel where only its core dependencies are ----------------------------

#: A user's first script, outside any clone.
USER_SCRIPT = """
import torch
from torch import nn

import hyper_parallel

model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
optimizer = hyper_parallel.get_hyper_optimizer(model)
before = [p.detach().clone() for p in model.parameters()]
model(torch.randint(0, 16, (4, 6))).pow(2).mean().backward()
optimizer.step()
moved = sum(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
print(sorted(optimizer.optimizers), moved, len(before))
"""
TRAIN = ["train", "--steps", "5", "--no-progress"]
TRAIN_EXTRA = 'pip install "hyper-parallel[train]"'


def _run(venv: Venv, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=venv.env, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_wheel_without_extras_in_a_fresh_venv(built: Built, tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path / "venv", ["torch", "pluggy", "xxhash", "numpy"])
    for missing in ("matplotlib", "tqdm", "transformers"):
        absent = _run(venv, [str(venv.python), "-c", f"import {missing}"], tmp_path)
        assert absent.returncode == 1, f"{missing} is importable in the fresh venv"
    done = venv.pip("install", str(built.wheel), cwd=tmp_path)  # its dependencies: present
    assert done.returncode == 0, done.stdout + done.stderr
    user = tmp_path / "user"
    user.mkdir()

    plugins = _run(venv, [str(venv.script("hyper-parallel")), "plugins"], user)
    assert plugins.returncode == 0, plugins.stderr
    assert plugins.stderr == "", plugins.stderr  # no warning on a bare install (numpy's, say)
    for module in _builtin_plugin_modules():
        plugin = module.rsplit(".", 1)[1]
        assert f"[{plugin} from hyper-parallel {VERSION}]" in plugins.stdout, plugin

    (user / "first.py").write_text(USER_SCRIPT, encoding="utf-8")
    stepped = _run(venv, [str(venv.python), "first.py"], user)
    assert stepped.returncode == 0, stepped.stderr
    assert stepped.stdout.strip() == "['adamw', 'muon'] 5 5", stepped.stdout  # every param moved

    runs = tmp_path / "runs-here"
    runs.mkdir()
    refused = _run(venv, [str(venv.script("hyper-parallel")), *TRAIN], runs)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "Traceback" not in refused.stderr
    said = [line for line in refused.stderr.splitlines() if "pip install" in line]
    assert len(said) == 1 and said[0].endswith(TRAIN_EXTRA) and "matplotlib" in said[0], said
    assert "tqdm" not in said[0]  # --no-progress needs no progress bar
    assert list(runs.iterdir()) == [], "a refused run left files behind"

    command = shlex.split(said[0].rsplit("install them with: ", 1)[1])
    assert command[:2] == ["pip", "install"], command
    offline = venv.pip(*command[1:], cwd=runs)  # the index is out of reach here: it names them
    assert offline.returncode != 0 and "matplotlib" in offline.stderr, offline.stderr

    venv.add(["matplotlib", "tqdm"], label="train")  # what that pip install would fetch
    satisfied = venv.pip(*command[1:], cwd=runs)
    assert satisfied.returncode == 0, satisfied.stdout + satisfied.stderr
    trained = _run(venv, [str(venv.script("hyper-parallel")), *TRAIN], runs)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    out = runs / "runs" / "train"
    assert {p.name for p in out.iterdir()} >= {"metrics.jsonl", "loss_curves.png", "summary.json"}
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
