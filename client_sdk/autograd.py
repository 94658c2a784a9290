"""Ties a remote forward into the caller's autograd graph, so loss.backward() reaches the shards."""

from __future__ import annotations

import torch


class RemoteStages(torch.autograd.Function):
    """forward runs every stage remotely; backward sends the outputs' gradients back through them.

    Returns the main output, or (main output, *the model's other outputs) when it has others; those that are not
    floating-point (token ids, masks) are not differentiable, and the model's inputs after the first take no
    gradient."""

    @staticmethod
    def forward(ctx, loop, anchor: torch.Tensor, x: torch.Tensor, inputs: dict):  # noqa: ARG004 - anchor
        # `anchor` is a scalar that requires grad, so the output does too even when x does not.
        ctx.loop = loop  # the model's ScriptLoop (client_sdk/script_loop.py)
        ctx.step = loop.begin_step()
        ctx.input_requires_grad = x.requires_grad
        main, extras = loop.remote_forward(ctx.step, x, inputs, requires_grad=True,
                                           input_requires_grad=x.requires_grad)
        outputs = (main, *extras)
        ctx.differentiable = [_differentiable(t) for t in outputs]
        ctx.mark_non_differentiable(*(t for t, d in zip(outputs, ctx.differentiable) if not d))
        return outputs if extras else main

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor, *output_grads: torch.Tensor):
        # Without an input gradient to return, backward only needs to be sent; with one, it must finish first.
        names = ctx.loop.model._interface.outputs
        grads = {name: grad if differentiable else None
                 for name, grad, differentiable in zip(names, output_grads, ctx.differentiable[1:])}
        grad_input = ctx.loop.remote_backward(ctx.step, grad_output if ctx.differentiable[0] else None,
                                              ctx.input_requires_grad, grads)
        return None, None, grad_input, None


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()
