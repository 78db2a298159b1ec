"""Sharding rules of the core op families, one module or package per family.

Each family defines ``RULES`` (ATen op -> rule, for ``__torch_dispatch__``)
and optionally ``FUNCTIONS`` (Python callable -> handler, for
``__torch_function__``); :mod:`physicsnemo_dp.catalog` installs them. Rules
build on :mod:`physicsnemo_dp.rule_kit` only, never on the dispatch hooks.
The spatial (``physicsnemo_dp.spatial``) and attention
(``physicsnemo_dp.attention``) families live beside this package.
"""
