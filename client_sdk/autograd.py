"""Ties a remote forward into the caller's autograd graph, so loss.backward() reaches the shards."""

from __future__ import annotations

import torch


class RemoteStages(torch.autograd.Function):
    """forward runs every stage remotely; backward sends the output's gradient back through them."""

    @staticmethod
    def forward(ctx, model, anchor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004 - anchor
        # `anchor` is a scalar that requires grad, so the output does too even when x does not.
        ctx.model = model
        ctx.step = model._begin_step()
        ctx.input_requires_grad = x.requires_grad
        return model._remote_forward(ctx.step, x, requires_grad=True, input_requires_grad=x.requires_grad)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # Without an input gradient to return, backward only needs to be sent; with one, it must finish first.
        grad_input = ctx.model._remote_backward(ctx.step, grad_output, ctx.input_requires_grad)
        return None, None, grad_input
