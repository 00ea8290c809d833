"""Built-in corpora of real text for ``hyper-parallel train``, built offline on any machine.

``python-stdlib`` is the running Python's standard library: its ``.py`` files
(the installed packages under ``site-packages``/``dist-packages`` and the
test suites, which some installs leave out, are skipped), split by file into
training and validation, and tokenized by a byte-level BPE trained on the
training files only. Nothing is downloaded: the files are already on disk,
and the BPE is trained here (with Hugging Face ``tokenizers``, the ``text``
extra). The tokenized splits are cached in :func:`default_cache_dir`, keyed
by the Python version, the files' digest, the vocabulary size and the split,
so a second call reads them back instead of training the BPE again.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hyper_parallel.core.options import CACHE_DIR_ENV, default_cache_dir
from hyper_parallel.train.data import DataError, TokenizedText

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "BUILT_IN_CORPORA",
    "PYTHON_STDLIB",
    "CorpusSplit",
    "SourceFile",
    "built_in_corpus",
    "goes_to_validation",
    "python_stdlib_corpus",
    "source_files",
    "split_by_file",
    "stdlib_root",
    "train_byte_level_bpe",
]

#: ``--data``'s name for :func:`python_stdlib_corpus`.
PYTHON_STDLIB = "python-stdlib"

#: Folders whose files are not the standard library's own code, or not on every install.
_SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})

#: Bumped when the cached entry's layout or the tokenization changes.
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class SourceFile:
    """One ``.py`` file of the corpus: its path relative to the root (``/``-separated), its text."""

    relative: str
    text: str


@dataclass(frozen=True)
class CorpusSplit:
    """The files of each split, each in the order of their relative paths."""

    train: tuple[SourceFile, ...]
    val: tuple[SourceFile, ...]

    def digest(self) -> str:
        """A SHA-256 of every file's relative path and text, and which split it is in."""
        h = hashlib.sha256()
        for name, files in (("train", self.train), ("val", self.val)):
            for f in files:
                for part in (name, f.relative, f.text):
                    raw = part.encode("utf-8")
                    h.update(len(raw).to_bytes(8, "little") + raw)
        return h.hexdigest()


def stdlib_root() -> Path:
    """The running Python's standard library folder (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: str | Path) -> list[SourceFile]:
    """Every UTF-8 ``.py`` file under ``root``, sorted by relative path, skipped folders left out.

    Raises:
        DataError: ``root`` is not a folder, or holds no ``.py`` file.
    """
    base = Path(root)
    if not base.is_dir():
        raise DataError(
            f"--data {PYTHON_STDLIB}: {base} is not a folder; give a folder of .py files"
        )
    found = []
    for path in sorted(base.rglob("*.py"), key=lambda p: p.relative_to(base).as_posix()):
        relative = path.relative_to(base)
        if _SKIPPED_FOLDERS & set(relative.parts[:-1]) or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):  # unreadable, or another encoding: left out
            continue
        if text:
            found.append(SourceFile(relative.as_posix(), text))
    if not found:
        raise DataError(
            f"--data {PYTHON_STDLIB}: {base} holds no readable, non-empty .py file (outside "
            f"{', '.join(sorted(_SKIPPED_FOLDERS))}); give a folder of Python sources"
        )
    return found


def goes_to_validation(relative: str, val_every: int) -> bool:
    """Whether a file is held out: a stable hash of its relative path, about 1 in ``val_every``."""
    digest = hashlib.sha256(relative.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % val_every == 0


def split_by_file(files: Sequence[SourceFile], val_every: int) -> CorpusSplit:
    """Each whole file to training or validation by :func:`goes_to_validation`.

    Raises:
        DataError: ``val_every`` is below 2, or a split is left with no file.
    """
    if val_every < 2:
        raise DataError(
            f"val_every must be >= 2 (1 in val_every files is held out), got {val_every}"
        )
    ordered = sorted(files, key=lambda f: f.relative)
    val = tuple(f for f in ordered if goes_to_validation(f.relative, val_every))
    train = tuple(f for f in ordered if not goes_to_validation(f.relative, val_every))
    if not train or not val:
        raise DataError(
            f"--data {PYTHON_STDLIB}: {len(ordered)} .py files give {len(train)} for training "
            f"and {len(val)} for validation (1 in {val_every} held out); each split needs a "
            "file: give more files or another val_every"
        )
    return CorpusSplit(train=train, val=val)


def train_byte_level_bpe(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens (the 256 bytes and the merges) on ``texts``.

    Raises:
        DataError: the ``tokenizers`` package is not installed.
    """
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError:
        raise DataError(
            f"--data {PYTHON_STDLIB} trains its tokenizer with the 'tokenizers' package, which "
            "is not installed; pip install 'hyper-parallel[text]'"
        ) from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _char_to_byte() -> dict[str, int]:
    """The byte-level pre-tokenizer's map back: printable bytes are their own character,
    the others are ``chr(256 + n)`` for the n-th of them in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


def _pieces(tokenizer: Tokenizer) -> tuple[bytes, ...]:
    """Each token id's bytes, in id order."""
    to_byte = _char_to_byte()
    by_id = sorted((i, token) for token, i in tokenizer.get_vocab().items())
    if [i for i, _ in by_id] != list(range(len(by_id))):
        raise DataError("the trained BPE's token ids are not 0..n-1; cannot build its vocabulary")
    return tuple(bytes(to_byte[c] for c in token) for _, token in by_id)


def _encode(tokenizer: Tokenizer, files: Sequence[SourceFile]) -> torch.Tensor:
    """The files' token ids, one file after another in order."""
    encoded = tokenizer.encode_batch([f.text for f in files])
    return torch.cat([torch.tensor(e.ids, dtype=torch.long) for e in encoded])


def _describe(split: CorpusSplit, vocab_size: int) -> str:
    """What a run's summary and plot title say the data was (short: the title is one line)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (
        f"Python {version} standard library .py files ({len(split.train)} train / "
        f"{len(split.val)} validation), byte-level BPE of {vocab_size} tokens"
    )


def _cache_file(cache_dir: Path, split: CorpusSplit, vocab_size: int) -> Path:
    """Where this Python's corpus of these files at this vocabulary size is cached."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    key = hashlib.sha256(f"{_CACHE_FORMAT}|{sys.version}|{vocab_size}|".encode())
    key.update(split.digest().encode())
    return (
        cache_dir
        / "corpora"
        / f"{PYTHON_STDLIB}-py{version}-v{vocab_size}-{key.hexdigest()[:24]}.pt"
    )


def _read_cache(path: Path) -> TokenizedText | None:
    """The cached corpus, or ``None`` where there is none or it cannot be read (it is rebuilt)."""
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, weights_only=True)
        return TokenizedText(
            train=entry["train"].long(),
            val=entry["val"].long(),
            alphabet=None,
            source=str(entry["source"]),
            pieces=tuple(bytes(p) for p in entry["pieces"]),
        )
    except Exception:  # a truncated or foreign file (any unpickling error): build it again
        return None


def _write_cache(path: Path, data: TokenizedText) -> None:
    """Write the entry atomically; a folder that cannot be written costs a rebuild next time."""
    entry = {
        "format": _CACHE_FORMAT,
        "train": data.train.to(torch.int32),
        "val": data.val.to(torch.int32),
        "pieces": list(data.pieces or ()),
        "source": data.source,
    }
    buffer = io.BytesIO()
    torch.save(entry, buffer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".corpus-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(buffer.getvalue())
            os.replace(temporary, path)
        finally:
            Path(temporary).unlink(missing_ok=True)
    except OSError as exc:
        warnings.warn(
            f"the {PYTHON_STDLIB} corpus could not be cached in {path.parent} "
            f"({exc.strerror or exc}); it is built again on the next run. Set {CACHE_DIR_ENV} "
            "to a writable folder to keep it",
            stacklevel=3,
        )


def python_stdlib_corpus(
    *,
    vocab_size: int = 2048,
    val_every: int = 20,
    root: str | Path | None = None,
    cache_dir: Path | None = None,
) -> TokenizedText:
    """The running Python's standard library sources, split by file and BPE-tokenized.

    Args:
        vocab_size: The BPE's tokens: the 256 bytes and up to ``vocab_size - 256`` merges,
            learned from the training files only.
        val_every: About 1 in ``val_every`` files is held out for validation, chosen by a
            stable hash of its relative path (the default: 95/5).
        root: The folder of ``.py`` files; default :func:`stdlib_root`.
        cache_dir: Where the tokenized splits are cached; default :func:`default_cache_dir`.

    Raises:
        DataError: ``vocab_size`` below 257, ``root`` missing or without ``.py`` files, a split
            left empty, or ``tokenizers`` not installed (needed only when nothing is cached).
    """
    if vocab_size < 257:
        raise DataError(
            f"vocab_size must be >= 257 (the 256 bytes and at least one merge), got {vocab_size}"
        )
    base = Path(root) if root is not None else stdlib_root()
    split = split_by_file(source_files(base), val_every)
    cached_at = _cache_file(
        cache_dir if cache_dir is not None else default_cache_dir(), split, vocab_size
    )
    if (cached := _read_cache(cached_at)) is not None:
        return cached
    tokenizer = train_byte_level_bpe([f.text for f in split.train], vocab_size)
    pieces = _pieces(tokenizer)  # fewer than vocab_size where the text runs out of pairs
    data = TokenizedText(
        train=_encode(tokenizer, split.train),
        val=_encode(tokenizer, split.val),
        alphabet=None,
        source=_describe(split, len(pieces)),
        pieces=pieces,
    )
    _write_cache(cached_at, data)
    return data


#: ``--data``'s names of the built-in corpora, each with what builds it at its defaults.
BUILT_IN_CORPORA: dict[str, Callable[[], TokenizedText]] = {PYTHON_STDLIB: python_stdlib_corpus}


def built_in_corpus(data: str | Path) -> TokenizedText | None:
    """The built-in corpus ``--data`` names (built, or read from the cache); ``None`` for a path."""
    build = BUILT_IN_CORPORA.get(str(data))
    return build() if build is not None else None
