"""A backward split into its input pass and its weight pass gives the gradients of one whole backward."""

import pytest
import torch

from shard_service import split_backward


class Branches(torch.nn.Module):
    """A main path, a weight-only term joining it, a weight used twice, an unused weight and a second output."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.offset = torch.nn.Parameter(torch.randn(6))
        self.unused = torch.nn.Parameter(torch.randn(3))

    def forward(self, x, residual):
        h = torch.tanh(self.first(x)) + self.offset.exp()
        out = self.second(h) + self.second(residual)
        return out, (self.offset * 2).sin() + h.mean(0)


def _model(name):
    if name == "branches":
        return Branches(), 2
    return torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 1


def _run(model, inputs):
    outputs = model(*inputs)
    return list(outputs) if isinstance(outputs, tuple) else [outputs]


@pytest.mark.parametrize("inputs_take_grad", [True, False])
@pytest.mark.parametrize("name", ["branches", "transformer"])
def test_split_equals_whole_backward(name, inputs_take_grad):
    torch.manual_seed(0)
    model, arity = _model(name)
    shape = (4, 6) if arity == 2 else (3, 5, 8)
    inputs = [torch.randn(shape, requires_grad=inputs_take_grad) for _ in range(arity)]
    parameters = list(model.parameters())

    roots = _run(model, inputs)
    seeds = [torch.randn_like(root) for root in roots]
    torch.autograd.backward(roots, seeds)
    expected_inputs = [leaf.grad for leaf in inputs]
    expected = [p.grad.clone() if p.grad is not None else None for p in parameters]
    for tensor in [*parameters, *inputs]:
        tensor.grad = None

    fired = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.append(p)) for p in parameters]
    leaves = [leaf.detach().requires_grad_(inputs_take_grad) for leaf in inputs]
    roots = _run(model, leaves)
    leaf_grads, weight_pass = split_backward.input_pass(roots, seeds, leaves, parameters)
    assert all(p.grad is None for p in parameters), "the input pass must leave the weights' gradients alone"
    for got, want in zip(leaf_grads, expected_inputs):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    weight_pass.run()
    for parameter, want in zip(parameters, expected):
        if want is None:
            assert parameter.grad is None
        else:
            torch.testing.assert_close(parameter.grad, want, rtol=0, atol=1e-6)
    assert len(fired) == sum(want is not None for want in expected)
    for hook in hooks:
        hook.remove()


def test_weight_pass_skips_the_input_path():
    """The weight pass runs only the weights' branches: the nodes between them on the input path run once."""
    model = torch.nn.Sequential(*[layer for _ in range(4) for layer in (torch.nn.Linear(16, 16), torch.nn.Tanh())])
    x = torch.randn(8, 16, requires_grad=True)
    out = model(x)
    runs = []
    node = out.grad_fn
    while node is not None:
        if "Tanh" in node.name():
            node.register_prehook(lambda grads: runs.append(1))
        node = next((child for child, _ in node.next_functions if child is not None and "Accumulate" not in
                     child.name()), None)
    _, weight_pass = split_backward.input_pass([out], [torch.ones_like(out)], [x], list(model.parameters()))
    assert len(runs) == 4
    weight_pass.run()
    assert len(runs) == 4, "the weight pass went through the input path again"
    assert all(p.grad is not None for p in model.parameters())
