"""mkdocs hook: the guides link into the API reference.

In every page outside ``api/``, the first inline-code mention of a public fastdist name on the
page (`` `psum` ``, `` `fd.psum` ``, `` `fastdist.nn.parallelize(...)` ``, `` `fastdist.connect` ``)
becomes a cross-reference to its entry in the reference. Code blocks, headings and code that is
already a link are left alone.

The links are mkdocs-autorefs' optional references: one whose target the reference does not show
stays plain code instead of failing the build. ``tests/test_docs_site.py`` checks that the
guides' links resolve, page by page.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

# The modules whose ``__all__`` is the public API, as the reference pages show it.
MODULES = (
    "fastdist",
    "fastdist.nn",
    "fastdist.nn.moe",
    "fastdist.nn.plans",
    "fastdist.checkpoint",
    "fastdist.train",
    "fastdist.train.schedules",
    "fastdist.serving",
    "fastdist.profile",
    "fastdist.comm",
    "fastdist.comm.native",
    "fastdist.testing",
)
# Plans are named after model families (`llama`, `qwen2_moe`), which the guides also name as
# models: linked only when written with their module (`fd.nn.plans.plan`).
PLANS = ("fastdist.nn.plans",)
# Bare names that read as ordinary words or name other libraries' things too: linked only when
# written with their module (`fd.nn.plans.plan`, `fastdist.checkpoint.save`).
NOT_BARE = {
    "P", "nn", "mq", "profile", "train", "plans", "moe", "load", "save", "plan", "trace", "record",
    "route", "dispatch", "combine", "send", "recv", "barrier", "broadcast", "axes", "meshes",
    "sharded", "predict", "layouts", "Record", "Profile", "Plan", "Link", "Network", "Layout",
    "Style", "Function", "NCCL", "HCCL", "SPECS", "BACKENDS", "llama", "gpt2", "mixtral",
    "report", "auto", "verify", "schedule", "NAMES",
}  # fmt: skip

CODE = re.compile(r"(?<![`\w])(`+)(?!`)(.+?)(?<!`)\1(?!`)")
NAME = re.compile(r"(?:fd|fastdist)?\.?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?:\(.*\))?")
FENCE = re.compile(r"^\s*(```|~~~)")


def bare_names() -> dict[str, str]:
    """Each public name to its identifier in the reference (the deepest module exporting the
    object: ``MoEError`` -> ``fastdist.nn.moe.MoEError``); names of different objects in two
    modules (``Layout``) are left out."""
    found: dict[str, dict[int, str]] = {}
    for modname in MODULES:
        if modname in PLANS:
            continue
        module = importlib.import_module(modname)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if type(obj).__name__ == "module" or name in NOT_BARE:
                continue
            ids = found.setdefault(name, {})
            old = ids.get(id(obj))
            if old is None or old.count(".") < modname.count(".") + 1:
                ids[id(obj)] = f"{modname}.{name}"
    return {name: next(iter(ids.values())) for name, ids in found.items() if len(ids) == 1}


def exists(target: str) -> bool:
    """Whether ``target`` (``fastdist.x.y``) names a public object of fastdist."""
    parts = target.split(".")
    if any(p.startswith("_") for p in parts):
        return False
    obj: Any = importlib.import_module("fastdist")
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            return False
    return True


def identifier(code: str, bare: dict[str, str]) -> str | None:
    """The reference identifier ``code`` names, or None."""
    m = NAME.fullmatch(code.strip())
    if m is None:
        return None
    dotted = m.group(1)
    head, _, rest = dotted.partition(".")
    subpackages = ("nn", "serving", "train", "profile", "testing")
    if code.startswith(("fd.", "fastdist.")) or head in subpackages:
        target = f"fastdist.{dotted}"
    elif head in bare:
        target = bare[head] + (f".{rest}" if rest else "")
    else:
        return None
    return target if exists(target) else None


def link_page(markdown: str, bare: dict[str, str]) -> str:
    """``markdown`` with the first mention of each API name linked."""
    seen: set[str] = set()
    out = []
    fence: str | None = None
    for line in markdown.split("\n"):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1) == fence:
                fence = None
            out.append(line)
            continue
        if m:
            fence = m.group(1)
            out.append(line)
            continue
        if line.lstrip().startswith("#"):
            out.append(line)
            continue

        def link(m: re.Match[str]) -> str:
            start, end = m.span()
            text = m.string
            if text[start - 1 : start] == "[" or text[end : end + 1] in ("]", "("):
                return m.group(0)  # already a link's text
            target = identifier(m.group(2), bare)
            if target is None or target in seen:
                return m.group(0)
            seen.add(target)
            return f'<autoref identifier="{target}" optional>{m.group(0)}</autoref>'

        out.append(CODE.sub(link, line))
    return "\n".join(out)


def on_config(config: Any) -> Any:
    config["extra"]["_fastdist_bare_names"] = bare_names()
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri.startswith("api/") or page.file.src_uri == "api.md":
        return markdown
    return link_page(markdown, config["extra"]["_fastdist_bare_names"])
