"""The built-in real-text corpus: ``python_stdlib_corpus`` and ``--data python-stdlib``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import TINY_TRAIN_ARGS as TINY
from hyper_parallel.cli import main
from hyper_parallel.core.options import CACHE_DIR_ENV
from hyper_parallel.train import corpus
from hyper_parallel.train.corpus import (
    PYTHON_STDLIB,
    python_stdlib_corpus,
    source_files,
    split_by_file,
)
from hyper_parallel.train.data import DataError, TokenizedText

VAL_EVERY = 3
VOCAB = 300
#: A word that no generated module holds: where it stands decides whether the BPE learns it.
RARE = "xyzzy_plugh"


def _module(i: int) -> str:
    return (
        f"def handle_{i}(value, count={i}):\n"
        f'    """Return the value {i} times over: café ☃."""\n'
        f"    total = value * count + {i}\n"
        f"    for index in range(count):\n"
        f"        total += index\n"
        f"    return total\n\n\n"
        f"class Handler{i}:\n"
        f"    limit = {i * 7}\n"
    ) * 4


def _name(i: int) -> str:
    return f"pkg/module_{i}.py"


def _write_root(root: Path, files: int = 12, *, rare_in_val: bool | None = None) -> Path:
    """``files`` small modules; with ``rare_in_val``, :data:`RARE` repeated in one file of that split."""
    for i in range(files):
        path = root / _name(i)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_module(i), encoding="utf-8")
    if rare_in_val is not None:
        i = next(
            i for i in range(files) if corpus.goes_to_validation(_name(i), VAL_EVERY) == rare_in_val
        )
        with (root / _name(i)).open("a", encoding="utf-8") as f:
            f.write(f"{RARE} = 1\n" * 400)
    return root


def _build(root: Path, cache: Path, **kwargs: Any) -> TokenizedText:
    return python_stdlib_corpus(
        vocab_size=VOCAB, val_every=VAL_EVERY, root=root, cache_dir=cache, **kwargs
    )


def _count_training(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch the BPE trainer to count its calls (and still train)."""
    calls: list[int] = []
    real: Callable[..., Any] = corpus.train_byte_level_bpe

    def counted(texts: Any, vocab_size: int) -> Any:
        calls.append(vocab_size)
        return real(texts, vocab_size)

    monkeypatch.setattr(corpus, "train_byte_level_bpe", counted)
    return calls


def test_the_split_is_by_whole_file_and_deterministic(tmp_path: Path) -> None:
    root = _write_root(tmp_path / "src")
    files = source_files(root)
    split = split_by_file(files, VAL_EVERY)
    assert split == split_by_file(list(reversed(files)), VAL_EVERY)  # order given: no matter
    assert split.train and split.val
    assert {f.relative for f in split.train}.isdisjoint(f.relative for f in split.val)
    assert len(split.train) + len(split.val) == len(files) == 12
    data = _build(root, tmp_path / "cache-a")
    # each split is its files' text, whole and in order: no file is cut between the splits
    assert data.decode(data.train.tolist()) == "".join(f.text for f in split.train)
    assert data.decode(data.val.tolist()) == "".join(f.text for f in split.val)
    again = _build(root, tmp_path / "cache-b")  # built again from nothing: the same corpus
    assert again.digest() == data.digest() and again.pieces == data.pieces
    assert data.vocab_size == len(data.pieces or ()) <= VOCAB
    assert int(data.train.max()) < data.vocab_size and len(data.train) < len(
        "".join(f.text for f in split.train).encode()
    )  # merges make fewer tokens than bytes


def test_the_bpe_learns_from_the_training_files_only(tmp_path: Path) -> None:
    held_out = _build(_write_root(tmp_path / "a", rare_in_val=True), tmp_path / "cache")
    assert RARE in held_out.decode(held_out.val.tolist())
    assert not any(b"yzzy" in piece for piece in held_out.pieces or ())
    seen = _build(_write_root(tmp_path / "b", rare_in_val=False), tmp_path / "cache")
    assert any(b"yzzy" in piece for piece in seen.pieces or ())  # the same word, trained on


def test_the_cache_is_written_and_read_back_without_training_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_training(monkeypatch)
    root, cache = _write_root(tmp_path / "src"), tmp_path / "cache"
    first = _build(root, cache)
    entries = list((cache / "corpora").glob("*.pt"))
    assert calls == [VOCAB] and len(entries) == 1
    second = _build(root, cache)
    assert calls == [VOCAB]  # read back: no training
    assert second.digest() == first.digest() and second.source == first.source
    entries[0].write_bytes(b"not a corpus")  # a damaged entry is built again, and replaced
    assert _build(root, cache).digest() == first.digest() and len(calls) == 2
    (root / "pkg" / "module_0.py").write_text("def changed():\n    return 0\n" * 20)
    _build(root, cache)  # other files: another entry
    assert len(calls) == 3 and len(list((cache / "corpora").glob("*.pt"))) == 2


def test_the_cache_follows_the_cache_directory_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "user-cache"))
    python_stdlib_corpus(vocab_size=VOCAB, val_every=VAL_EVERY, root=_write_root(tmp_path / "s"))
    assert list((tmp_path / "user-cache" / "corpora").glob(f"{PYTHON_STDLIB}-*.pt"))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "missing", "is not a folder"),
        (lambda root: root, "holds no readable, non-empty .py file"),
        (lambda root: _only_installed_packages(root), "holds no readable, non-empty .py file"),
    ],
)
def test_a_missing_or_empty_root_is_a_clear_error(
    tmp_path: Path, make: Callable[[Path], Path], message: str
) -> None:
    with pytest.raises(DataError, match=message):
        python_stdlib_corpus(root=make(tmp_path), cache_dir=tmp_path / "cache")


def _only_installed_packages(root: Path) -> Path:
    (root / "site-packages").mkdir()
    (root / "site-packages" / "thing.py").write_text("x = 1\n")
    (root / "empty.py").write_text("")
    return root


def test_a_split_left_empty_or_a_vocabulary_too_small_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "one"
    root.mkdir()
    (root / "only.py").write_text("x = 1\n")
    with pytest.raises(DataError, match="each split needs a file"):
        python_stdlib_corpus(root=root, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="vocab_size must be >= 257"):
        python_stdlib_corpus(vocab_size=256, root=_write_root(tmp_path / "src"))


def test_train_data_python_stdlib_compares_with_adamw_and_plots_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _write_root(tmp_path / "stdlib", files=20)
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["train", "--data", PYTHON_STDLIB, "--compare", "adamw", "--steps", "6"]
    assert main([*argv, "--eval-every", "3", "--out", str(out), *TINY]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"muon+adamw", "adamw"}
    assert all(run["steps"] == 6 for run in summary["runs"].values())
    assert "standard library" in summary["data"] and "byte-level BPE" in summary["data"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {m["run"] for m in metrics if "val_loss" in m} == {"muon+adamw", "adamw"}
    assert (out / "loss_curves.png").stat().st_size > 0


def test_a_tokenizer_flag_with_the_built_in_corpus_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--data", PYTHON_STDLIB, "--tokenizer", "byte", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--data python-stdlib is a built-in corpus with its own tokenizer" in err
