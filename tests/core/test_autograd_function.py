"""The library's autograd Function base (``_torch_compat.Function``) behaves like torch's.

Its ``apply`` skips torch's per-call argument binding only where binding
changes nothing; a call that relies on ``forward``'s defaults or passes
keywords must still see them in ``setup_context``. ``non_differentiable``
keeps autograd from zero-filling the gradients of outputs that carry none.
"""

import torch

from physicsnemo_dp._torch_compat import Function, non_differentiable


class _Scale(Function):
    @staticmethod
    def forward(x, factor=3.0):
        return x * factor, x.sign()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[1]  # present only if defaults were bound
        non_differentiable(ctx, output[1])

    @staticmethod
    def backward(ctx, grad, sign_grad):
        ctx.seen = sign_grad
        _Scale.last = ctx
        return grad * ctx.factor, None


def _run(*args, **kwargs):
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    y, sign = _Scale.apply(x, *args, **kwargs)
    assert not sign.requires_grad
    y.sum().backward()
    return x.grad, _Scale.last


def test_all_arguments_positional():
    grad, ctx = _run(2.0)
    assert torch.equal(grad, torch.tensor([2.0, 2.0]))
    assert ctx.seen is None  # the non-differentiable output's gradient is not zero-filled


def test_defaults_and_keywords_still_reach_setup_context():
    grad, _ = _run()
    assert torch.equal(grad, torch.tensor([3.0, 3.0]))
    grad, _ = _run(factor=5.0)
    assert torch.equal(grad, torch.tensor([5.0, 5.0]))


def test_without_non_differentiable_autograd_would_zero_fill():
    """The control: plain mark_non_differentiable hands backward a zero tensor."""

    class Plain(_Scale):
        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.factor = inputs[1]
            ctx.mark_non_differentiable(output[1])

    x = torch.tensor([1.0, -2.0], requires_grad=True)
    Plain.apply(x, 2.0)[0].sum().backward()
    assert torch.equal(_Scale.last.seen, torch.zeros(2))
