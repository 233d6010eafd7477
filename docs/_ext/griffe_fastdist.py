"""A griffe extension for the API pages: fastdist's docstrings as a reader of the site should see
them.

The docstrings are written for ``help()`` and IDEs, with Sphinx roles (``:func:`~fastdist.psum```)
and doctest examples (``>>>`` lines, which the doctests in CI run). Markdown would show the roles
literally and turn ``>>>`` into nested block quotes, so, at build time only:

- a role becomes inline code (``~`` keeps the last dotted component, as Sphinx does);
- each run of doctest lines (a ``>>>`` line, its ``...`` continuations and its output up to a
  blank line) becomes a fenced ``pycon`` block.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def _role(m: re.Match[str]) -> str:
    target = m.group(2).strip()
    if "<" in target and target.endswith(">"):  # :func:`text <target>`
        return f"`{target.split('<')[0].strip()}`"
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


def _fence_doctests(text: str) -> str:
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if not stripped.startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(stripped)]
        block = []
        # the example and its output, to the next blank line
        while i < len(lines) and lines[i].strip():
            block.append(
                lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip()
            )
            i += 1
        out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```"]
    return "\n".join(out)


def render(text: str) -> str:
    """The docstring text as the site shows it."""
    return _fence_doctests(ROLE.sub(_role, text))


class FastdistDocstrings(griffe.Extension):
    """Rewrites every docstring of the loaded objects with :func:`render`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = render(obj.docstring.value)
