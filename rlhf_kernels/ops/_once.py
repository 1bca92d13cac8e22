"""Gradients that are not differentiable again (kernels, collectives), made safe under
``create_graph=True``: a double backward through them raises instead of silently dropping terms.

``torch.autograd.function.once_differentiable`` is not enough: its error node hangs off detached
tensors, so ``torch.autograd.grad(..., inputs=q)`` never reaches it and stays silent.
"""

from __future__ import annotations

import torch


class _NoDoubleBackward(torch.autograd.Function):
    """Identity on one gradient, tied to the tensors it depends on; its backward raises."""

    @staticmethod
    def forward(ctx, what, grad, *depends_on):
        ctx.what = what
        return grad.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.what} is differentiable once: its gradients have no gradient of their own "
            "(double backward / create_graph=True)"
        )


def once_differentiable_grads(what: str, grads, depends_on) -> tuple:
    """``grads`` as they are in a plain backward; under ``create_graph=True`` (grad mode on inside
    a backward) each is tied to the ``depends_on`` tensors that require grad, so differentiating
    it again raises naming ``what``. None entries stay None."""
    if not torch.is_grad_enabled():
        return tuple(grads)
    given = [t for t in depends_on if isinstance(t, torch.Tensor) and t.requires_grad]
    if not given:
        return tuple(grads)
    return tuple(
        None if g is None else _NoDoubleBackward.apply(what, g.detach(), *given) for g in grads
    )
