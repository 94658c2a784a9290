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
        return model._remote_forward(ctx.step, x, requires_grad=True)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        ctx.model._remote_backward(ctx.step, grad_output)
        return None, None, None
