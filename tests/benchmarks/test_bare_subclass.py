"""The do-nothing subclass of ``benchmarks._bare_subclass``: the compiled suite's floor must compute what plain torch does.

Its figure is only meaningful if the step it times is the same training step:
the same loss and the same gradients for every parameter, through the
regionally compiled transformer block (``aot_eager``: AOTAutograd's subclass
wrappers, as Inductor runs them, without code generation) and eagerly.
"""

import copy

import pytest
import torch

from benchmarks._bare_subclass import Bare, BareAttention
from benchmarks.compiled import Block


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "regional-aot_eager"])
def test_a_bare_step_has_the_plain_steps_loss_and_gradients(compiled):
    torch.manual_seed(0)
    net = Block(16)
    x = torch.randn(1, 24, 16, dtype=torch.float64)
    net = net.double()
    plain, bare = copy.deepcopy(net), copy.deepcopy(net)
    bare.attend = BareAttention.apply
    if compiled:
        plain.compile_regions("aot_eager")
        bare.compile_regions("aot_eager")
    for _ in range(2):  # the second call runs the compiled regions' cached graphs
        for model in (plain, bare):
            model.zero_grad(set_to_none=True)
        loss = plain.step_loss(x)
        loss.backward()
        wrapped = bare.step_loss(Bare(x.clone()))
        assert type(wrapped) is Bare
        wrapped.backward()
        torch.testing.assert_close(wrapped.inner, loss.detach(), rtol=1e-12, atol=1e-12)
        for (name, p), q in zip(plain.named_parameters(), bare.parameters()):
            g = q.grad.inner if type(q.grad) is Bare else q.grad
            torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_bare_attention_gradients_are_torchs_for_a_strided_output_gradient():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 2, 4, 8, dtype=torch.float64).transpose(-1, -2)  # as a transposing consumer gives it
    torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(grad)
    bq, bk, bv = (Bare(t.detach().clone()).requires_grad_() for t in (q, k, v))
    BareAttention.apply(bq, bk, bv).backward(Bare(grad))
    for mine, ref in zip((bq, bk, bv), (q, k, v)):
        torch.testing.assert_close(mine.grad.inner, ref.grad)
