"""Gradients that are not differentiable again (kernels, collectives), made safe under
``create_graph=True``: a double backward through them raises instead of silently dropping terms
(:func:`once_differentiable_grads`), or ``create_graph=True`` itself raises
(:func:`first_order_only`).

``torch.autograd.function.once_differentiable`` is not enough: its error node hangs off detached
tensors, so ``torch.autograd.grad(..., inputs=q)`` never reaches it and stays silent.
"""

from __future__ import annotations

import functools

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


def first_order_only(backward):
    """An ``autograd.Function.backward`` that refuses ``create_graph=True`` (a second derivative)
    with a clear error before any work: for the log-prob ops, whose gradients come from ``out=``
    passes or were made in the forward (nothing to tie them to, as
    :func:`once_differentiable_grads` does)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():  # the engine runs backward in grad mode only for create_graph
            raise RuntimeError(
                "rlhf_kernels' log-prob ops have no second derivative: backward (or "
                "torch.autograd.grad) with create_graph=True is not supported"
            )
        return backward(ctx, *grads)

    return wrapper
