"""Parsing an einsum equation string into per-dim labels (:class:`.contract.Equation`).

Follows torch.einsum: spaces are ignored, ``...`` stands for the broadcast
dims (right-aligned across operands), and without ``->`` the output is the
ellipsis dims followed by the labels that occur once, in alphabetical order
(upper case first).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from .contract import Equation


@lru_cache(maxsize=1024)
def parse_einsum(equation: str, ndims: tuple) -> Equation:
    """The :class:`.contract.Equation` of ``equation`` on operands of ``ndims`` dims (memoised: parsing is pure)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise RuntimeError(
            f"einsum(): the equation {equation!r} names {len(terms)} operands but {len(ndims)} were given"
        )
    for t in terms + ([rhs] if arrow else []):
        letters = t.replace("...", "", 1)
        if not all(c.isascii() and c.isalpha() for c in letters):
            raise RuntimeError(f"einsum(): invalid subscript {t!r} in {equation!r} (use letters and at most one '...')")
    n_ell = max((n - len(t.replace("...", "")) for t, n in zip(terms, ndims) if "..." in t), default=0)
    ellipsis = tuple(("...", i) for i in range(n_ell))
    operands = tuple(_term(t, n, ellipsis, equation) for t, n in zip(terms, ndims))
    for labs in operands:
        repeated = [lab for lab, c in Counter(labs).items() if c > 1]
        if repeated:
            raise NotImplementedError(
                f"einsum(): {equation!r} repeats the label {repeated[0]!r} within one operand (a diagonal); "
                "ShardTensor does not support that: take the diagonal with torch.diagonal first"
            )
    if arrow:
        out = _term(rhs, None, ellipsis, equation)
        if len(set(out)) != len(out):
            raise RuntimeError(f"einsum(): output subscript of {equation!r} repeats a label")
        known = {lab for labs in operands for lab in labs} | set(ellipsis)
        if any(lab not in known for lab in out):
            raise RuntimeError(f"einsum(): output subscript of {equation!r} has a label that no operand has")
    else:
        counts = Counter(lab for labs in operands for lab in labs if isinstance(lab, str))
        out = ellipsis + tuple(sorted(lab for lab, c in counts.items() if c == 1))
    return Equation(operands, out)


def _term(term: str, ndim, ellipsis, equation) -> tuple:
    before, sep, after = term.partition("...")
    if not sep:
        if ndim is not None and len(term) != ndim:
            raise RuntimeError(
                f"einsum(): subscript {term!r} of {equation!r} has {len(term)} labels for a {ndim}-D operand"
            )
        return tuple(term)
    k = len(ellipsis) if ndim is None else ndim - len(before) - len(after)
    if k < 0:
        raise RuntimeError(f"einsum(): subscript {term!r} of {equation!r} has more labels than its operand has dims")
    return tuple(before) + ellipsis[len(ellipsis) - k :] + tuple(after)
