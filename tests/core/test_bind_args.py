"""``rule_kit.bind_args`` reads each op's schema once and binds every call as the schema says.

The rules bind ATen calls by argument name (``bind_args``). Its table of
``(name, kwarg_only, default)`` per op is built on an op's first call; later
calls must bind exactly as reading the schema afresh does (checked against a
direct reading, on ops with positional, keyword-only, defaulted and list
arguments), and a default list handed to a rule is its own copy.
"""

from __future__ import annotations

import torch

from physicsnemo_dp import rule_kit

aten = torch.ops.aten


def _bound_from_schema(func, args, kwargs) -> dict:
    """The binding read straight from ``func._schema`` (the definition ``bind_args`` must agree with)."""
    bound, positional = {}, list(args)
    for a in func._schema.arguments:
        if not a.kwarg_only and positional:
            bound[a.name] = positional.pop(0)
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        else:
            bound[a.name] = a.default_value if a.has_default_value() else None
    return bound


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        (x is y) or (not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor) and x == y)
        for x, y in zip(a.values(), b.values())
    )


def test_bind_args_agrees_with_the_schema_on_every_call():
    x = torch.randn(3, 4)
    calls = [
        (aten.mean.dim, (x, [1]), {}),
        (aten.mean.dim, (x, None), {}),
        (aten.mean.dim, (x, [0], True), {"dtype": torch.float64}),
        (aten.sum.dim_IntList, (x, [0, 1]), {"keepdim": True}),
        (aten.cumsum.default, (x, 1), {"dtype": torch.float64}),
        (aten.var.correction, (x,), {"dim": [1], "correction": 0, "keepdim": True}),
        (aten.amax.default, (x,), {}),  # a list default (dim=[])
        (aten.select.int, (x, 0, 2), {}),
        (aten.transpose.int, (x, 0, 1), {}),
    ]
    for _ in range(2):  # the first call of an op fills its table, the second reads it
        for func, args, kwargs in calls:
            assert _same(rule_kit.bind_args(func, args, kwargs), _bound_from_schema(func, args, kwargs)), func
    assert aten.mean.dim in rule_kit._SCHEMA_PARAMS


def test_a_default_list_is_the_callers_own():
    x = torch.randn(3, 4)
    first = rule_kit.bind_args(aten.amax.default, (x,), {})["dim"]
    assert first == [] and type(first) is list
    first.append(0)  # a rule changing what it was handed changes nothing for the next call
    assert rule_kit.bind_args(aten.amax.default, (x,), {})["dim"] == []
