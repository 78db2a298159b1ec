"""MkDocs hook: render the Sphinx-style roles of our docstrings as code.

Docstrings are Google style with reST roles (``:func:`scatter_tensor```,
``:class:`~datapipes.pipe.DataPipe```), which read well in ``help()`` and in
editors. mkdocstrings renders the role name literally; this hook turns each
role into plain inline code, keeping only the last dotted component when the
target starts with ``~`` (Sphinx's convention). Registered in ``mkdocs.yml``.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _code(match: re.Match) -> str:
    target = match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if match.group(1) else target}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub(_code, html)
