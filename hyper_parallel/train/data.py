"""Training data for ``hyper-parallel train``: a built-in synthetic language, or a text file.

(:mod:`hyper_parallel.train.corpus` holds the built-in corpora of real text.)

The built-in corpus is generated deterministically at run time (nothing is
downloaded). It mixes two kinds of lines:

* sentences of a small grammar with subject-verb agreement that reaches
  across relative clauses ("the old foxes that chase a bird sleep ."), so a
  model must track number over a distance;
* two-digit addition facts ("47 + 18 = 65 ."), whose answers have to be
  computed, not memorised: some sums (every pair whose first operand is
  congruent to 3 mod 7) appear only in the validation split.

Text is tokenized per character, over a fixed alphabet for the built-in
data, or per byte / per character for a user's file; :class:`TokenizedText`
also holds a byte-level BPE's vocabulary.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hyper_parallel.core.errors import HyperParallelValueError

__all__ = [
    "SYNTHETIC_ALPHABET",
    "DataError",
    "TokenizedText",
    "batches",
    "load_text_file",
    "synthetic_corpus",
]

_NOUNS = (
    ("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("fox", "foxes"),
    ("child", "children"), ("teacher", "teachers"), ("robot", "robots"),
    ("farmer", "farmers"), ("horse", "horses"), ("student", "students"),
)  # fmt: skip
_TRANSITIVE = (
    ("sees", "see"), ("chases", "chase"), ("likes", "like"), ("helps", "help"),
    ("finds", "find"), ("follows", "follow"), ("watches", "watch"),
)  # fmt: skip
_INTRANSITIVE = (("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait"))
_ADJECTIVES = ("big", "small", "red", "quiet", "happy", "old", "young", "clever")
_DETERMINERS = (("the", "a", "this", "every"), ("the", "some", "these", "many"))
_PREPOSITIONS = ("near", "behind", "under", "with")

#: The built-in corpus's alphabet (index = token id).
SYNTHETIC_ALPHABET = "\n +.=0123456789abcdefghijklmnopqrstuvwxyz"

_HELD_OUT_MOD = 7
_HELD_OUT_REMAINDER = 3


class DataError(HyperParallelValueError):
    """The training data cannot be used (missing, empty or binary file)."""


def _noun_phrase(rng: random.Random, plural: int) -> str:
    words = [rng.choice(_DETERMINERS[plural])]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS)[plural])
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    plural = rng.randrange(2)
    subject = _noun_phrase(rng, plural)
    if rng.random() < 0.4:  # a relative clause with its own number between subject and verb
        inner = rng.randrange(2)
        subject += f" that {rng.choice(_TRANSITIVE)[plural]} {_noun_phrase(rng, inner)}"
    if rng.random() < 0.3:
        predicate = rng.choice(_INTRANSITIVE)[plural]
    else:
        predicate = f"{rng.choice(_TRANSITIVE)[plural]} {_noun_phrase(rng, rng.randrange(2))}"
        if rng.random() < 0.3:
            predicate += f" {rng.choice(_PREPOSITIONS)} {_noun_phrase(rng, rng.randrange(2))}"
    return f"{subject} {predicate} ."


def _addition(rng: random.Random, held_out: bool) -> str:
    while True:
        a, b = rng.randrange(100), rng.randrange(100)
        if (a % _HELD_OUT_MOD == _HELD_OUT_REMAINDER) == held_out:
            return f"{a} + {b} = {a + b} ."


def _lines(seed: int, held_out_sums: bool) -> Iterator[str]:
    rng = random.Random(seed)
    while True:
        yield _addition(rng, held_out_sums) if rng.random() < 0.35 else _sentence(rng)


@dataclass(frozen=True)
class TokenizedText:
    """Token ids of a train and a validation split, and how to decode them.

    One of three vocabularies: ``alphabet`` (one character per token),
    ``pieces`` (the bytes each token stands for, as a byte-level BPE has), or
    neither (one byte per token, vocab 256).
    """

    train: torch.Tensor
    val: torch.Tensor
    alphabet: str | None  # None with no pieces: byte-level (vocab 256)
    source: str
    pieces: tuple[bytes, ...] | None = None  # token id -> its bytes

    def __post_init__(self) -> None:
        if self.alphabet is not None and self.pieces is not None:
            raise HyperParallelValueError(
                "TokenizedText: give an alphabet or pieces, not both (one vocabulary per text)"
            )

    @property
    def vocab_size(self) -> int:
        """How many token ids there are: the model's embedding rows."""
        if self.pieces is not None:
            return len(self.pieces)
        return 256 if self.alphabet is None else len(self.alphabet)

    def digest(self) -> str:
        """A SHA-256 of both splits' token ids and the vocabulary: the same data gives the same digest."""
        h = hashlib.sha256((self.alphabet or "").encode("utf-8"))
        for piece in self.pieces or ():
            h.update(len(piece).to_bytes(4, "little") + piece)
        for ids in (self.train, self.val):
            flat = ids.to(torch.int64).contiguous()  # its bytes, read without numpy
            h.update(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()))
        return h.hexdigest()

    def decode(self, ids: list[int]) -> str:
        """The text of token ``ids``; bytes that are no UTF-8 read as U+FFFD."""
        if self.pieces is not None:
            return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
        if self.alphabet is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return "".join(self.alphabet[i] for i in ids)


def _encode(text: str, alphabet: str) -> torch.Tensor:
    table = {ch: i for i, ch in enumerate(alphabet)}
    return torch.tensor([table[ch] for ch in text], dtype=torch.long)


def synthetic_corpus(
    *, train_chars: int = 1_000_000, val_chars: int = 50_000, seed: int = 0
) -> TokenizedText:
    """The built-in corpus: grammar sentences and addition facts, with a held-out split.

    The validation split comes from another seed, and its addition facts are
    the held-out pairs the train split never shows.
    """

    def take(lines: Iterator[str], n: int) -> str:
        parts: list[str] = []
        size = 0
        while size < n:
            line = next(lines) + "\n"
            parts.append(line)
            size += len(line)
        return "".join(parts)

    train = take(_lines(seed, held_out_sums=False), train_chars)
    val = take(_lines(seed + 1_000_003, held_out_sums=True), val_chars)
    return TokenizedText(
        train=_encode(train, SYNTHETIC_ALPHABET),
        val=_encode(val, SYNTHETIC_ALPHABET),
        alphabet=SYNTHETIC_ALPHABET,
        source="built-in synthetic language (grammar + two-digit addition)",
    )


def load_text_file(
    path: str | Path, *, tokenizer: str = "char", seq_len: int = 128, val_fraction: float = 0.1
) -> TokenizedText:
    """Tokenize a text file; the last ``val_fraction`` of it is the validation split.

    ``"char"`` reads UTF-8 text, one token per character; ``"byte"`` reads any
    file, one token per byte.

    Raises:
        DataError: the file is missing, not a file, unreadable, empty, not UTF-8 text
            (``"char"``), or too short for two splits of ``seq_len + 2`` tokens.
    """
    p = Path(path)
    if tokenizer not in ("char", "byte"):
        raise DataError(f"--tokenizer {tokenizer!r}: use 'char' or 'byte'")
    if not p.exists():
        raise DataError(f"--data {path}: no such file")
    if not p.is_file():
        raise DataError(f"--data {path}: not a regular file")
    try:
        raw = p.read_bytes()
    except OSError as exc:  # permission, an I/O error, a FIFO whose writer went away
        raise DataError(
            f"--data {path}: cannot be read ({exc.strerror or exc}); check that the file is "
            "readable by this user"
        ) from None
    if not raw:
        raise DataError(f"--data {path}: the file is empty")
    if tokenizer == "byte":
        ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        alphabet = None
    else:
        text = _utf8_text(raw, path)
        alphabet = "".join(sorted(set(text)))
        ids = _encode(text, alphabet)
    _check_length(len(ids), path, tokenizer, seq_len, val_fraction)
    split = int(len(ids) * (1 - val_fraction))
    return TokenizedText(train=ids[:split], val=ids[split:], alphabet=alphabet, source=str(p))


def _utf8_text(raw: bytes, path: str | Path) -> str:
    hint = "; --tokenizer byte reads any file"
    if not raw.strip():
        raise DataError(f"--data {path}: the file holds only whitespace")
    if b"\x00" in raw:
        raise DataError(f"--data {path}: looks binary (contains NUL bytes){hint}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"--data {path}: not UTF-8 text ({exc.reason} at byte {exc.start}){hint}"
        ) from exc


def min_tokens(seq_len: int, val_fraction: float = 0.1) -> int:
    """The fewest tokens a file needs: each split holds at least one window of ``seq_len + 2``."""
    window = seq_len + 2
    return max(math.ceil(window / val_fraction), math.ceil(window / (1 - val_fraction))) + 1


def _check_length(
    count: int, path: str | Path, tokenizer: str, seq_len: int, val_fraction: float
) -> None:
    unit = "bytes" if tokenizer == "byte" else "characters"
    need = min_tokens(seq_len, val_fraction)
    if count < need:
        raise DataError(
            f"--data {path}: the file has {count:,} {unit}; --seq-len {seq_len} needs at least "
            f"{need:,} (a tenth is held out for validation, and each split needs --seq-len + 2); "
            "give a longer file or a smaller --seq-len"
        )


def batches(
    ids: torch.Tensor, *, batch_size: int, seq_len: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Endless random windows of ``seq_len + 1`` tokens, ``batch_size`` at a time."""
    if len(ids) <= seq_len + 1:
        raise DataError(f"the data has {len(ids)} tokens, fewer than --seq-len + 2 = {seq_len + 2}")
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size, 1), generator=generator)
        yield ids[starts + offsets]
