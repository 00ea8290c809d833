"""The documentation site states the code's contract and its examples run.

* every hook's signature, rendered from ``hookspecs`` itself, is in the plugin guide;
* every built-in the registry holds is documented on the built-ins page, and every
  built-in sharding backend is listed wherever the README and the docs list backends;
* both user guides name the guide's API;
* every Python block of README.md and the docs compiles, fragments included (the
  root ``conftest.py`` runs every page's blocks through Sybil);
* the plugin guide's example package, written out from its titled blocks,
  installs and passes its own tests, and the guide's blocks run against it;
* ``mkdocs build --strict`` passes (when mkdocs is installed);
* the README, which is the package index's page too, links and shows images by
  absolute addresses only, and every one into the repository names a file that exists;
* the README's quick start is what CI runs, and every editable install the pages
  and CI make is the strict one that type checkers read.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import unittest
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from installing import pip_install_into
from sybil import Document
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

from hyper_parallel import PluginKind, get_registry
from hyper_parallel.core.plugin import hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PROJECT = "hyper-parallel"

#: README.md and every page of the docs, relative to the repository root.
PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md")))
GUIDE_API = ("get_hyper_optimizer", "get_hyper_lr_scheduler", "ChainedOptimizer", "Muon", "AdamW")
#: The line above a block that cannot run here (Sybil's skip directive).
FRAGMENT = re.compile(r'<!-- skip: next "fragment: [^"]+" -->\n$')
_TITLE = re.compile(r'title="([^"]+)"')


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page, as Sybil's Markdown lexer reads it."""

    page: str
    line: int
    lang: str
    title: str | None
    fragment: bool  # marked as a fragment: compiled, never run
    source: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text(encoding="utf-8")
    document = Document(text, str(ROOT / page))
    blocks = []
    for region in FencedCodeBlockLexer(language=r".+")(document):
        info = str(region.lexemes["language"])
        title = _TITLE.search(info)
        blocks.append(
            Block(
                page=page,
                line=text.count("\n", 0, region.start) + 2,
                lang=info.split()[0],
                title=title.group(1) if title else None,
                fragment=bool(FRAGMENT.search(text[: region.start])),
                source=str(region.lexemes["source"]),
            )
        )
    return blocks


def _python_blocks(page: str) -> list[Block]:
    return [b for b in _blocks(page) if b.lang == "python"]


# -- the plugin contract ------------------------------------------------------


class _Annotation:
    """An annotation that prints as written (``from __future__ import annotations`` strings)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _as_written(annotation: Any) -> Any:
    if annotation is inspect.Parameter.empty:
        return annotation
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return _Annotation(text)


def rendered_signature(fn: Any) -> str:
    """``name(arg: Type, ...) -> Ret``, exactly as the function is declared."""
    sig = inspect.signature(fn)
    sig = sig.replace(
        parameters=[
            p.replace(annotation=_as_written(p.annotation)) for p in sig.parameters.values()
        ],
        return_annotation=_as_written(sig.return_annotation),
    )
    return f"{fn.__name__}{sig}"


def _hooks() -> list[Any]:
    return [getattr(hookspecs, name) for name in hookspecs.__all__]


def test_hook_list_is_the_registrys() -> None:
    assert {fn.__name__ for fn in _hooks()} == {kind.hook_name for kind in PluginKind}


def test_rendered_signature_reads_the_code() -> None:
    def example(register: Any, *, strict: bool = False) -> None: ...

    assert rendered_signature(example) == "example(register: Any, *, strict: bool = False) -> None"


@pytest.mark.parametrize("hook", _hooks(), ids=lambda fn: fn.__name__)
def test_every_hook_signature_is_in_the_plugin_guide(hook: Any) -> None:
    signature = rendered_signature(hook)
    assert signature in (DOCS / "plugins.md").read_text(encoding="utf-8"), (
        f"docs/plugins.md does not show the hook's exact signature {signature!r}"
    )


def test_plugin_guide_shows_the_register_callback() -> None:
    text = (DOCS / "plugins.md").read_text(encoding="utf-8")
    assert 'register(name, obj, *, description="", aliases=(), requires=())' in text
    import inspect

    from hyper_parallel.core.plugin import RegisterFn
    from hyper_parallel.core.plugin._entries import OPTIMIZER_REQUIREMENTS

    keywords = [p for p in inspect.signature(RegisterFn.__call__).parameters if p != "self"]
    assert keywords == ["name", "obj", "description", "aliases", "requires"]  # as the page shows
    words = ("HYPER_PARALLEL_STRICT_PLUGINS", "HYPER_PARALLEL_DISABLE_PLUGINS", "matrix_only")
    for word in (*words, *(f'"{r}"' for r in OPTIMIZER_REQUIREMENTS)):
        assert word in text


# -- the built-ins ------------------------------------------------------------


def _is_builtin(distribution: str | None) -> bool:
    # "hyper-parallel 0.1.0", not "hyper-parallel-lion 0.1.0"
    return distribution is not None and distribution.rsplit(" ", 1)[0] == PROJECT


def test_every_builtin_is_documented() -> None:
    entries = [e for e in get_registry().entries() if _is_builtin(e.distribution)]
    assert entries, f"the registry holds no entry from {PROJECT}; is it installed?"
    text = (DOCS / "builtins.md").read_text(encoding="utf-8")
    listed = "\n".join(line for line in text.splitlines() if line.startswith(("#", "|")))
    missing = [f"{e.kind.value} {e.name!r}" for e in entries if f"`{e.name}`" not in listed]
    missing += [
        f"alias {alias!r} of {e.kind.value} {e.name!r}"
        for e in entries
        for alias in e.aliases
        if f"`{alias}`" not in text
    ]
    assert not missing, "docs/builtins.md has no heading or table row for: " + ", ".join(missing)


#: The pages that list the sharding backends, relative to the repository root.
BACKEND_PAGES = ("README.md", "docs/quickstart.md", "docs/distributed.md")


def _builtin_sharding_backends() -> list[str]:
    """The sharding backends registered by this project's own entry points."""
    own = {
        ep.name
        for ep in importlib.metadata.distribution(PROJECT).entry_points
        if ep.group == "hyper_parallel"
    }
    names = sorted(
        e.name
        for e in get_registry().entries()
        if e.kind is PluginKind.SHARDING_BACKEND and _is_builtin(e.distribution) and e.plugin in own
    )
    assert names, f"the registry holds no sharding backend from {PROJECT}; is it installed?"
    return names


def _listed_names(text: str) -> set[str]:
    """Names in backticks, and names that start a line of ``hyper-parallel plugins`` output."""
    return set(re.findall(r"`([\w.-]+)`", text)) | set(re.findall(r"^ {2}([\w-]+) {2}", text, re.M))


def test_listed_names_reads_prose_and_plugin_tables() -> None:
    text = (
        "backends `local` (no sharding) and\n```text\n  fsdp   DTensor params  [fsdp_backend]\n```"
    )
    assert {"local", "fsdp"} <= _listed_names(text)
    assert "DTensor" not in _listed_names(text)


@pytest.mark.parametrize("page", BACKEND_PAGES)
def test_every_builtin_sharding_backend_is_listed(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    missing = [name for name in _builtin_sharding_backends() if name not in _listed_names(text)]
    assert not missing, (
        f"{page} lists sharding backends but not the built-in one(s) {missing}; "
        "name each one there with a few words on what it takes"
    )


# -- the user guides ----------------------------------------------------------


@pytest.mark.parametrize("page", ["user-guide.md", "user-guide.zh.md"])
def test_user_guides_name_the_guides_api(page: str) -> None:
    text = (DOCS / page).read_text(encoding="utf-8")
    assert [name for name in GUIDE_API if f"`{name}`" not in text] == []


# -- code examples ------------------------------------------------------------


@pytest.mark.parametrize(
    "block", [b for page in PAGES for b in _python_blocks(page)], ids=lambda b: b.where
)
def test_python_block_compiles(block: Block) -> None:
    compile(block.source, block.where, "exec")


def test_toml_blocks_parse() -> None:
    tomllib = pytest.importorskip("tomllib")
    blocks = [b for page in PAGES for b in _blocks(page) if b.lang == "toml"]
    assert blocks
    for block in blocks:
        tomllib.loads(block.source)


def test_blocks_are_read_as_sybil_reads_them() -> None:
    blocks = _python_blocks("docs/plugins.md")
    assert any(b.fragment for b in blocks) and any(not b.fragment for b in blocks)
    assert any(b.title for b in blocks)
    first = blocks[0]
    lines = (ROOT / first.page).read_text(encoding="utf-8").splitlines()
    assert lines[first.line - 2].startswith("```python")  # the block's first line follows
    assert first.source.startswith(lines[first.line - 1])


@pytest.mark.parametrize("page", ["docs/quickstart.md", "docs/user-guide.md", "docs/plugins.md"])
def test_main_pages_have_running_examples(page: str) -> None:
    assert any(not b.fragment and b.title is None for b in _python_blocks(page))


@pytest.fixture
def example_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Write the plugin guide's titled blocks out as files and pip-install the package."""
    files = [b for b in _blocks("docs/plugins.md") if b.title is not None]
    assert files, "docs/plugins.md has no titled file blocks"
    for block in files:
        path = tmp_path / "src" / block.title
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.source, encoding="utf-8")
    projects = {Path(b.title).parts[0] for b in files}
    assert len(projects) == 1, f"expected one example package, got {sorted(projects)}"
    target = tmp_path / "site"
    pip_install_into(tmp_path / "src" / projects.pop(), target, cwd=tmp_path)
    monkeypatch.syspath_prepend(str(target))
    importlib.invalidate_caches()
    get_registry().reset()
    return tmp_path / "src"


@pytest.mark.usefixtures("fresh_registry")
def test_plugin_guide_examples_and_example_package(
    example_package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(example_package)  # a block that writes by a relative path writes here
    blocks = _python_blocks("docs/plugins.md")
    modules = {Path(b.title).stem for b in blocks if b.title and "/tests/" not in b.title}
    try:
        _run_with_sybil(ROOT / "docs" / "plugins.md")
        tests = [b for b in blocks if b.title and "/tests/" in b.title]
        assert tests, "the example package has no tests block"
        for block in tests:
            namespace: dict[str, Any] = {"__name__": "docs_example_tests"}
            exec(compile(block.source, block.where, "exec"), namespace)
            test_functions = [v for k, v in namespace.items() if k.startswith("test_")]
            assert test_functions, f"{block.where} defines no test functions"
            for test_function in test_functions:
                test_function()
    finally:
        for module in modules:
            monkeypatch.delitem(sys.modules, module, raising=False)


def _run_with_sybil(page: Path) -> None:
    """Run a page's blocks in order, as the root conftest.py does for the other pages."""
    document = Document.parse(str(page), SkipParser(), PythonCodeBlockParser())
    ran = 0
    for example in document.examples():
        try:
            example.evaluate()
        except unittest.SkipTest:
            continue  # a fragment
        ran += 1
    assert ran, f"{page} ran no block"


# -- the site -------------------------------------------------------------------


_HAVE_MKDOCS = all(
    importlib.util.find_spec(name) is not None for name in ("mkdocs", "mkdocstrings", "material")
)


@pytest.mark.skipif(not _HAVE_MKDOCS, reason="mkdocs, mkdocstrings or mkdocs-material missing")
def test_mkdocs_build_is_strict_clean(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,  # mkdocs.yml names its griffe extension by a path relative to the root
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    for page in (
        "index.html",
        "user-guide.zh/index.html",
        "api/index.html",
        "benchmarks/index.html",
    ):
        assert (site / page).is_file(), page


def _quick_start_commands() -> list[str]:
    """The command lines of the README's quick start: its bash blocks, comments dropped."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def test_ci_runs_the_readme_quick_start_verbatim_and_in_order() -> None:
    commands = _quick_start_commands()
    assert any("hyper-parallel train" in c for c in commands)
    assert any("pytest" in c for c in commands)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    positions = [ci.find(command) for command in commands]
    assert all(p >= 0 for p in positions), [
        c for c, p in zip(commands, positions, strict=True) if p < 0
    ]
    assert positions == sorted(positions), "the quick start's commands run in the README's order"
    assert ci.find(commands[-1]) < ci.find("ruff check")  # the user's commands come first


# -- the README on a package index ---------------------------------------------

REPOSITORY = "https://github.com/hyper-parallel/hyper_parallel"
#: A link into the repository: a file (blob), a folder (tree), a file's bytes (raw).
_REPOSITORY_LINK = re.compile(
    r"(?:https://github\.com/hyper-parallel/hyper_parallel/(?P<kind>blob|tree)/main/"
    r"|https://raw\.githubusercontent\.com/hyper-parallel/hyper_parallel/main/)"
    r"(?P<path>[^#?]+)(?:[#?].*)?"
)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
_INLINE = re.compile(r"(!?)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HTML = re.compile(r"<(img|a)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']+)", re.I)


def markdown_links(markdown: str) -> list[tuple[str, str]]:
    """``(kind, target)`` of every link (``link``) and image (``image``) of a Markdown page.

    Code (fenced blocks and spans) and HTML comments are not read: a link there
    is text, not a link.
    """
    text = _CODE_SPAN.sub("", _FENCE.sub("", _COMMENT.sub("", markdown)))
    found = [("image" if bang else "link", target) for bang, target in _INLINE.findall(text)]
    found += [("link", target) for target in _REFERENCE.findall(text)]
    found += [("image" if tag.lower() == "img" else "link", t) for tag, t in _HTML.findall(text)]
    return found


def test_links_reads_links_images_and_skips_code() -> None:
    page = (
        "See [the guide](docs/user-guide.md) and [`api`](https://x.org/a#b).\n"
        '![a plot](docs/img/p.png "title")\n'
        "[ref]: docs/ref.md\n"
        '<img src="img/b.png" alt="b">\n'
        "`[not a link](nowhere.md)`\n"
        "```python\nx = '[not a link](nowhere.md)'\n```\n"
        "<!-- [hidden](nowhere.md) -->\n"
    )
    assert sorted(markdown_links(page)) == sorted(
        [
            ("link", "docs/user-guide.md"),
            ("link", "https://x.org/a#b"),
            ("image", "docs/img/p.png"),
            ("link", "docs/ref.md"),
            ("image", "img/b.png"),
        ]
    )


def test_readme_links_and_images_are_absolute() -> None:
    """On a package index the README is read away from the repository: a relative link breaks."""
    links = markdown_links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert links, "found no link in README.md"
    relative = [target for _, target in links if not target.startswith("https://")]
    assert not relative, f"README.md links by relative (or non-https) address: {relative}"
    images = [target for kind, target in links if kind == "image"]
    assert images, "README.md shows no image"
    not_raw = [t for t in images if not t.startswith("https://raw.githubusercontent.com/")]
    assert not not_raw, f"README.md shows images that are not raw files: {not_raw}"


def test_readme_repository_links_name_files_that_exist() -> None:
    links = [t for _, t in markdown_links((ROOT / "README.md").read_text(encoding="utf-8"))]
    into = [t for t in links if t.startswith((REPOSITORY, "https://raw.githubusercontent.com/"))]
    assert into, "README.md has no link into the repository"
    broken = []
    for target in into:
        if target.rstrip("/") in (REPOSITORY, f"{REPOSITORY}/issues"):
            continue
        match = _REPOSITORY_LINK.fullmatch(target)
        if match is None:
            broken.append(f"{target} (not a file or folder on main)")
            continue
        path = ROOT / match["path"].rstrip("/")
        exists = path.is_dir() if match["kind"] == "tree" else path.is_file()
        if not exists:
            broken.append(
                f"{target} ({match['path']} is no {'folder' if match['kind'] == 'tree' else 'file'} here)"
            )
    assert not broken, "README.md links to what the repository does not hold: " + ", ".join(broken)


# -- installs -----------------------------------------------------------------

#: An editable install of this project: ``-e .`` or ``-e ".[extra,...]"``.
_EDITABLE_HERE = re.compile(r"""-e\s+(["']?)\.(\[[\w,-]+\])?\1(?=\s|$)""")


@pytest.mark.parametrize("page", [*PAGES, ".ci/run"])
def test_every_editable_install_is_strict(page: str) -> None:
    """A plain ``pip install -e .`` replaces the strict install that mypy and pyright read."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    plain = [
        f"{page}:{number}: {line.strip()}"
        for number, line in enumerate(lines, 1)
        if "pip install" in line
        and _EDITABLE_HERE.search(line)
        and "--config-settings editable_mode=strict" not in line
    ]
    assert not plain, "editable installs without editable_mode=strict:\n" + "\n".join(plain)
