#!/usr/bin/env python3
"""Generate ``docs/api.md``, the API reference, from the docstrings of the public modules.

    python tools/gen_api_docs.py            # rewrite docs/api.md
    python tools/gen_api_docs.py --check    # exit 1 if docs/api.md is out of date (a test runs this)

The public API of a module is its ``__all__``. For each name the page shows
the signature and the docstring; for a class, also its public methods and
properties defined by the class itself (a ShardTensor's page does not repeat
``torch.Tensor``'s). Names re-exported from torch are listed, not copied.
Modules whose ``FUNCTIONS`` table routes torch functions to them (spatial ops,
attention) list those functions: that table is what makes ``F.conv2d`` work
on a ShardTensor, so it belongs in the reference.

Docstrings are reStructuredText-flavoured Google style; :func:`_markdown`
turns the few constructs they use into Markdown (inline roles, ``Args:``
sections, ``::`` literal blocks, simple tables). The output depends only on
the source, so the committed page can be checked for staleness.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "api.md"

#: (module, one-line summary) in reading order.
MODULES = (
    ("physicsnemo_dp", "ShardTensor, placements, scattering, promotion, collectives counting, the launcher"),
    ("physicsnemo_dp.split", "the one split rule"),
    ("physicsnemo_dp.spatial", "convolution, pooling, interpolation, padding, normalization on sharded grids"),
    ("physicsnemo_dp.attention", "sequence-sharded scaled dot-product attention"),
    ("physicsnemo_dp.distributed", "training on a (ddp, domain) mesh: DDP, FSDP2, capabilities, precision"),
    ("physicsnemo_dp.checkpoint", "distributed, crash-safe checkpoints"),
    ("physicsnemo_dp.random", "random numbers that do not depend on the decomposition: streams, seeding, factories"),
    ("physicsnemo_dp.pipelines", "diffusion (EDM) pipelines of named components under one MeshContext"),
    ("physicsnemo_dp.debug", "debugging aids: the checking mode, collective counting"),
    ("physicsnemo_dp.debug.viz", "pictures of layouts, halo exchanges and decompositions"),
    ("datapipes", "per-rank reading of HDF5, xarray and mesh data into ShardTensors"),
    ("datapipes.synthetic", "synthetic datasets for tests and tutorials"),
)

_SECTION = re.compile(r"^(Args|Arguments|Returns|Raises|Attributes|Keys|Yields|Example|Examples):\s*$")
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`~?([^`]+)`")
_TABLE_RULE = re.compile(r"^\s*=+(\s+=+)+\s*$")


# --------------------------------------------------------------------------- #
# Docstring text -> Markdown
# --------------------------------------------------------------------------- #
def _inline(text: str) -> str:
    """Inline reST: roles become code spans (last dotted component unless written out), ``x`` becomes `x`."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).split('.')[-1] if m.group(0).count('~') else m.group(1)}`", text)
    return text.replace("``", "`")


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def _literal_block(lines: list[str], i: int, outer: int) -> tuple[list[str], int]:
    """The lines from ``i`` indented deeper than ``outer`` (blank lines included), dedented; and the next index."""
    block = []
    while i < len(lines) and (not lines[i].strip() or _indent_of(lines[i]) > outer):
        block.append(lines[i])
        i += 1
    while block and not block[-1].strip():
        block.pop()
        i -= 1
    while block and not block[0].strip():
        block.pop(0)
    base = min((_indent_of(b) for b in block if b.strip()), default=0)
    return [b[base:] for b in block], i


def _markdown(doc: str | None) -> str:
    """A cleaned docstring as Markdown."""
    if not doc:
        return "*(no docstring)*"
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _TABLE_RULE.match(line):  # a reST simple table: keep it verbatim
            block = [line]
            i += 1
            rules = 1
            while i < len(lines) and rules < 3:
                block.append(lines[i])
                rules += bool(_TABLE_RULE.match(lines[i]))
                i += 1
            out += ["```text", *block, "```"]
            continue
        if line.rstrip().endswith("::"):  # a literal block follows, indented deeper than this line
            text = line.rstrip()[:-1]
            if text.strip() != ":":
                out.append(_inline(text))
            block, i = _literal_block(lines, i + 1, _indent_of(line))
            out += ["", "```python", *block, "```", ""]
            continue
        match = _SECTION.match(line)
        if match:
            out += ([] if out and not out[-1] else [""]) + [f"**{match.group(1)}:**", ""]
            i += 1
            while i < len(lines) and (not lines[i].strip() or _indent_of(lines[i]) > 0):
                entry = lines[i].strip()
                i += 1
                if not entry:
                    continue
                while i < len(lines) and lines[i].strip() and _indent_of(lines[i]) > 4:
                    entry += " " + lines[i].strip()
                    i += 1
                name, sep, rest = entry.partition(": ")
                out.append(f"- `{name}`: {_inline(rest)}" if sep and " " not in name.strip("*") else f"- {_inline(entry)}")
            out.append("")
            continue
        out.append(_inline(line))
        i += 1
    return "\n".join(out).strip()


# --------------------------------------------------------------------------- #
# Objects -> entries
# --------------------------------------------------------------------------- #
class _Annotation:
    """An annotation kept as source text (``from __future__ import annotations``), shown unquoted."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    unquote = lambda a: _Annotation(a) if isinstance(a, str) else a  # noqa: E731
    sig = sig.replace(
        parameters=[p.replace(annotation=unquote(p.annotation)) for p in sig.parameters.values()],
        return_annotation=unquote(sig.return_annotation),
    )
    return re.sub(r" at 0x[0-9a-f]+", "", str(sig))


def _is_ours(obj) -> bool:
    module = getattr(obj, "__module__", "") or ""
    return module.split(".")[0] in ("physicsnemo_dp", "datapipes")


def _members(cls) -> list[tuple[str, object]]:
    """Public methods and properties a class defines itself, in source order."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        raw = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if isinstance(raw, property) or inspect.isfunction(raw):
            found.append((name, value))
    return found


def _member_entry(cls, name: str, value) -> list[str]:
    if isinstance(value, property):
        head, doc = f"`{name}` *(property)*", value.__doc__
    else:
        raw = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        kind = " *(static)*" if isinstance(value, staticmethod) else " *(classmethod)*" if isinstance(value, classmethod) else ""
        head, doc = f"`{name}{_signature(getattr(cls, name))}`{kind}", raw.__doc__
    if doc is None:
        return [f"- {head}"]
    first, _, rest = _markdown(doc).partition("\n")
    body = [f"- {head}: {first}"]
    body += [f"  {line}" if line.strip() else "" for line in rest.strip("\n").splitlines()]
    return body


def _code(name: str, obj) -> list[str]:
    return ["```python", f"{name}{_signature(obj)}", "```", ""]


#: Classes built through classmethods; their raw constructor signature is internal.
_NO_SIGNATURE = {"ShardTensor", "ShardTensorSpec"}


def _entry(module_name: str, name: str, obj) -> list[str]:
    if not (callable(obj) or inspect.isclass(obj)):
        return [f"### `{name}`", "", f"Constant: `{obj!r}`.", ""]
    if not _is_ours(obj):
        origin = getattr(obj, "__module__", type(obj).__module__)
        return [f"### `{name}`", "", f"Re-exported from `{origin}`.", ""]
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        members = ", ".join(f"`{m.name}`" for m in obj)
        return [f"### `{name}` *(enum)*", "", _markdown(obj.__doc__), "", f"Members: {members}.", ""]
    if inspect.isclass(obj):
        lines = [f"### `{name}` *(class)*", ""]
        lines += [] if name in _NO_SIGNATURE else _code(name, obj)
        lines += [_markdown(obj.__doc__), ""]
        members = _members(obj)
        if members:
            lines += ["**Members:**", ""]
            for member, value in members:
                lines += _member_entry(obj, member, value)
            lines.append("")
        return lines
    return [f"### `{name}`", "", *_code(name, obj), _markdown(obj.__doc__), ""]


def _handled_functions(module) -> list[str]:
    table = getattr(module, "FUNCTIONS", None)
    if not table:
        return []
    import torch
    import torch.nn.functional as F

    def public_names(f) -> list[str]:  # the names users call it by (F.max_pool2d, torch.conv2d, ...)
        found = [f"F.{n}" for n in dir(F) if not n.startswith("_") and getattr(F, n) is f]
        return found or [f"torch.{n}" for n in dir(torch) if not n.startswith("_") and getattr(torch, n, None) is f]

    names = sorted({n for f in table for n in public_names(f)})
    return ["**Torch functions handled on ShardTensors:** " + ", ".join(f"`{n}`" for n in names), ""]


def _anchor(module_name: str) -> str:
    return module_name.replace(".", "")


def render() -> str:
    """The whole page."""
    lines = [
        "# API reference",
        "",
        "<!-- Generated by tools/gen_api_docs.py from the docstrings; do not edit by hand. -->",
        "",
        "Generated from the docstrings by `python tools/gen_api_docs.py` (a test fails when this page",
        "is out of date). Concepts are explained in [concepts.md](concepts.md), communication in",
        "[communication.md](communication.md), known limitations in [limitations.md](limitations.md).",
        "",
    ]
    lines += [f"- [`{name}`](#{_anchor(name)}): {summary}" for name, summary in MODULES]
    lines.append("")
    for module_name, _ in MODULES:
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", _markdown(module.__doc__), ""]
        lines += _handled_functions(module)
        for name in getattr(module, "__all__", ()):
            lines += _entry(module_name, name, getattr(module, name))
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that docs/api.md is up to date")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run python tools/gen_api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
