"""A griffe extension that lets mkdocstrings render the code's Sphinx-flavoured docstrings.

The docstrings are Google style but use a few reStructuredText spellings
(``:class:`x```, ``.. math::``, an ``Example:`` section). Rendered as
Markdown these show up literally, and ``>>>`` lines inside an ``Example:``
admonition are read as Markdown links. This extension rewrites them when
the docs are built; the source is not touched.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|data|mod|attr|exc|obj|math):`(~?)([^`]+)`")
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$")
_MATH = re.compile(r"^(\s*)\.\. math::\s*$")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _math_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _MATH.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group(1)
        i += 1
        body: list[str] = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(indent + " ")):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        while body and not body[0].strip():
            body.pop(0)
        content = [line for line in body if line.strip()]
        margin = min((len(line) - len(line.lstrip()) for line in content), default=0)
        out.append(f"{indent}```text")
        out.extend(indent + line[margin:] if line.strip() else "" for line in body)
        out.append(f"{indent}```")
        out.append("")
    return out


def rewrite(text: str) -> str:
    """Return ``text`` with Sphinx roles, math directives and ``Example:`` made Markdown-friendly."""
    lines = [_EXAMPLE.sub(r"\1Examples:", line) for line in text.splitlines()]
    lines = _math_blocks(lines)
    return _ROLE.sub(_role, "\n".join(lines))


class SphinxMarkup(griffe.Extension):
    """Rewrite each docstring once the object tree is built."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
