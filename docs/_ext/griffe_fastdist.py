"""A griffe extension for the API pages: fastdist's docstrings as a reader of the site should see
them.

The docstrings are written for ``help()`` and IDEs, with Sphinx roles (``:func:`~fastdist.psum```)
and doctest examples (``>>>`` lines, which the doctests in CI run). Markdown would show the roles
literally and turn ``>>>`` into nested block quotes, so, at build time only:

- a role becomes inline code (``~`` keeps the last dotted component, as Sphinx does);
- a reStructuredText literal block (``Example::`` and an indented block) becomes a fenced
  ``python`` block;
- each run of doctest lines (a ``>>>`` line, its ``...`` continuations and its output up to a
  blank line) becomes a fenced ``pycon`` block;
- a module constant documented by ``#:`` comments above it gets them as its docstring;
- a public function, method or class whose docstring has no ``Args:`` section gets a parameters
  table built from its signature (name, type, default; a parameter named like an entry of the
  docstring's ``Attributes:`` gets that description; the prose above describes the others), so
  every callable of the reference shows its typed parameters. Docstrings that document their
  parameters (``Args:``) keep their own table.
"""

from __future__ import annotations

import re
from functools import cached_property
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


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _fence_literal_blocks(text: str) -> str:
    """reStructuredText's literal block (a paragraph ending in ``::``, then an indented block) as
    a fenced Python block under the paragraph, which ends in ``:``."""
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if not line.rstrip().endswith("::") or line.lstrip().startswith(">>>"):
            continue
        j = i
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or _indent(lines[j]) <= _indent(line):
            continue
        head = line.rstrip()[:-1]  # "Example::" reads "Example:"; a lone "::" goes
        out[-1] = head if head.strip() != ":" else ""
        block, k = [], j
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > _indent(line)):
            block.append(lines[k])
            k += 1
        while block and not block[-1].strip():
            block.pop()
        cut = min(_indent(b) for b in block if b.strip())
        pad = " " * _indent(line)
        out += ["", f"{pad}```python", *(pad + b[cut:] if b.strip() else "" for b in block)]
        out += [f"{pad}```", ""]
        i = k
    return "\n".join(out)


def render(text: str) -> str:
    """The docstring text as the site shows it."""
    return _fence_doctests(_fence_literal_blocks(ROLE.sub(_role, text)))


def _comment_docstring(attr: griffe.Attribute) -> None:
    """A module constant documented by ``#:`` comment lines right above it (the Sphinx
    convention, which ``help()`` cannot show) gets them as its docstring."""
    if attr.lineno is None or attr.filepath is None or isinstance(attr.filepath, list):
        return
    try:
        lines = attr.lines_collection[attr.filepath]
    except KeyError:
        return
    doc: list[str] = []
    i = attr.lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#:"):
        doc.insert(0, lines[i].lstrip()[2:].strip())
        i -= 1
    if doc:
        attr.docstring = griffe.Docstring("\n".join(doc), lineno=i + 2, parent=attr)


def _signature_parameters(
    params: griffe.Parameters, described: dict[str, str]
) -> griffe.DocstringSectionParameters | None:
    """A parameters section with one row per parameter of the signature (``self``/``cls`` left
    out; a parameter named like a documented attribute gets its description), or None when
    there is none to list."""
    rows = []
    for p in params:
        if p.name in ("self", "cls"):
            continue
        stars = {"var_positional": "*", "var_keyword": "**"}.get(p.kind.name, "")
        rows.append(
            griffe.DocstringParameter(
                stars + p.name,
                description=described.get(p.name, ""),
                annotation=p.annotation,
                value=p.default,
            )
        )
    return griffe.DocstringSectionParameters(rows) if rows else None


def _attribute_descriptions(sections: list[griffe.DocstringSection]) -> dict[str, str]:
    """The ``Attributes:`` entries of a docstring by name (``op, axis: ...`` names both)."""
    out: dict[str, str] = {}
    for section in sections:
        if section.kind is griffe.DocstringSectionKind.attributes:
            for attr in section.value:
                for name in attr.name.split(","):
                    out[name.strip()] = attr.description
    return out


def _prose_returns(sections: list[griffe.DocstringSection], obj: Any) -> None:
    """A ``Returns:`` paragraph whose first line has a colon in its prose (``the sum: one per
    rank``) is one description, not a type (the text before the colon) and a description: the
    type is the signature's return annotation."""
    for section in sections:
        if section.kind is not griffe.DocstringSectionKind.returns:
            continue
        for item in section.value:
            if isinstance(item.annotation, str) and item.annotation.strip():
                item.description = f"{item.annotation}: {item.description}"
                item.annotation = obj.returns if isinstance(obj, griffe.Function) else None


def _has_parameters(sections: list[griffe.DocstringSection]) -> bool:
    return any(s.kind is griffe.DocstringSectionKind.parameters for s in sections)


class _SignatureDocstring(griffe.Docstring):
    """A docstring whose parsed sections end with a parameters table from its object's signature
    when it has none. Parsed when the page renders, after every extension (dataclasses' fields
    included) has completed the signature."""

    @cached_property
    def parsed(self) -> list[griffe.DocstringSection]:
        sections = self.parse()
        obj = self.parent
        _prose_returns(sections, obj)
        if _has_parameters(sections) or not isinstance(obj, (griffe.Function, griffe.Class)):
            return sections
        if isinstance(obj, griffe.Class):
            init = obj.members.get("__init__")
            if (
                init is not None
                and not init.is_alias
                and init.docstring is not None
                and _has_parameters(init.docstring.parsed)
            ):
                return sections
        section = _signature_parameters(obj.parameters, _attribute_descriptions(sections))
        return sections if section is None else [*sections, section]


def _add_parameters(obj: griffe.Function | griffe.Class) -> None:
    """Make ``obj``'s docstring one that shows its signature's parameters if it documents none."""
    if obj.docstring is None:
        obj.docstring = griffe.Docstring("", parent=obj)
    obj.docstring.__class__ = _SignatureDocstring


def _walk(obj: griffe.Object) -> None:
    for name, member in obj.members.items():
        if member.is_alias or (name.startswith("_") and not name.endswith("__")):
            continue
        if name == "__init__":  # its class's table lists the parameters
            continue
        if isinstance(member, (griffe.Function, griffe.Class)):
            _add_parameters(member)
        if isinstance(member, (griffe.Module, griffe.Class)):
            _walk(member)


class FastdistDocstrings(griffe.Extension):
    """Rewrites every docstring of the loaded objects with :func:`render`, then gives each public
    callable without an ``Args:`` section a parameters table from its signature."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None and isinstance(obj, griffe.Attribute):
            _comment_docstring(obj)
        if obj.docstring is not None:
            obj.docstring.value = render(obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _walk(pkg)
