"""Weights tied across stages (a language model's head and its token embedding) stay one parameter: each stage
using it holds a copy, their gradients are summed before every step, and training equals one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2
from tests.integration.training import largest_difference

VOCABULARY, WIDTH = 11, 8


def tied_net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(VOCABULARY, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCABULARY, bias=False))
    net[5].weight = net[0].weight
    return net


def token_batches(steps: int, batch: int = 4, length: int | None = 6):
    """(tokens, next tokens) of `batch` rows of `length` positions (None: one position, no sequence dimension)."""
    generator = torch.Generator().manual_seed(1)
    shape = (batch, length) if length else (batch,)
    return [(torch.randint(0, VOCABULARY, shape, generator=generator),
             torch.randint(0, VOCABULARY, shape, generator=generator)) for _ in range(steps)]


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), targets.flatten())


def adamw(net: nn.Module) -> torch.optim.Optimizer:
    matrices = [p for p in net.parameters() if p.dim() >= 2]
    vectors = [p for p in net.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                             lr=1e-2)


@pytest.mark.parametrize("num_stages", [1, 3])
def test_a_tied_head_and_embedding_train_as_one_parameter_with_clipping(cluster4, num_stages):
    local, batches = tied_net(), token_batches(steps=6)
    remote = copy.deepcopy(local)
    model = cluster4.deploy(remote, optimizer=adamw(remote), example_input=batches[0][0], num_stages=num_stages)
    optimizer = adamw(local)
    for x, y in batches:
        loss_of(model(x), y).backward()
        remote_norm = model.clip_grad_norm_(0.5)
        model.optimizer.step()
        model.optimizer.zero_grad()
        loss_of(local(x), y).backward()
        local_norm = torch.nn.utils.clip_grad_norm_(local.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        assert remote_norm.item() == pytest.approx(local_norm.item(), rel=1e-5)
    state = model.state_dict()
    assert list(state) == list(local.state_dict())
    assert torch.equal(state["0.weight"], state["5.weight"])
    assert largest_difference(state, local.state_dict()) <= 1e-5
    read, expected = model.optimizer_state_dict(), optimizer.state_dict()
    assert [g["params"] for g in read["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert max((read["state"][i][name] - value).abs().max().item()
               for i, entries in expected["state"].items() for name, value in entries.items()
               if torch.is_tensor(value)) <= 1e-5


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_tied_weight_trains_in_pipelined_steps_and_its_optimizer_state_comes_along(cluster4, schedule):
    local, batches = tied_net(), token_batches(steps=4, batch=8, length=None)
    started = adamw(local)  # stepped once here: a deploy of the optimizer instance carries its state
    loss_of(local(batches[0][0]), batches[0][1]).backward()
    started.step()
    started.zero_grad()
    remote = copy.deepcopy(local)
    remote_optimizer = adamw(remote)
    remote_optimizer.load_state_dict(started.state_dict())
    model = cluster4.deploy(remote, optimizer=remote_optimizer, example_input=batches[0][0], num_stages=3)
    for x, y in batches[1:]:
        model.train_step(x, y, "CrossEntropyLoss", microbatches=2, schedule=schedule)
        loss_of(local(x), y).backward()
        started.step()
        started.zero_grad()
    assert largest_difference(model.state_dict(), local.state_dict()) <= 1e-5



@pytest.mark.parametrize("foreach", [None, True])
def test_torch_clip_grad_functions_run_on_the_remote_parameters(cluster4, foreach):
    """torch.nn.utils.clip_grad_norm_ and clip_grad_value_ called as on a local module (over every parameter or
    some, either of torch's code paths) clip the shards' gradients, a tied one once, as they clip local ones."""
    local, batches = tied_net(), token_batches(steps=4)
    remote = copy.deepcopy(local)
    model = cluster4.deploy(remote, optimizer=torch.optim.SGD(remote.parameters(), lr=0.5),
                            example_input=batches[0][0], num_stages=3)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.5)
    assert all(p.grad is None for p in model.parameters())
    for index, (x, y) in enumerate(batches):
        loss_of(model(x), y).backward()
        loss_of(local(x), y).backward()
        norms = []
        for net in (model, local):
            chosen = [p for p in net.parameters() if p.dim() >= 2] if index == 2 else list(net.parameters())
            if index % 2:
                torch.nn.utils.clip_grad_value_(chosen, 0.02, foreach=foreach)
            norms.append(torch.nn.utils.clip_grad_norm_(chosen, 0.3, foreach=foreach).item())
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()], foreach=foreach).item())
        assert norms[:2] == pytest.approx(norms[2:], rel=1e-5)
        model.optimizer.step()
        model.optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert largest_difference(model.state_dict(), local.state_dict()) <= 1e-5


def test_a_remote_gradient_refuses_what_would_need_its_values(cluster4):
    local, batches = tied_net(), token_batches(steps=1)
    model = cluster4.deploy(local, example_input=batches[0][0], num_stages=2)
    loss_of(model(batches[0][0]), batches[0][1]).backward()
    grad = next(model.parameters()).grad
    assert grad.shape == (VOCABULARY, WIDTH) and "RemoteGradient('0.weight'" in repr(grad)
    with pytest.raises(TypeError, match=r"abs on a RemoteParameter's \.grad: the gradient stays on the shards.*"
                                        r"clip_grad_norm_"):
        grad.abs()
    with pytest.raises(TypeError, match="mixes a RemoteParameter's .grad with local tensors"):
        torch._foreach_mul_([grad, torch.ones(2)], 0.5)
    # What another language's client might send: a name the stage does not hold is refused, and changes nothing.
    edit = shard_pb2.GradientEdit(parameter="no.such.weight", scale=0.0)
    with pytest.raises(InvalidArgument, match="stage 0 holds no parameter 'no.such.weight'"):
        model._io.run(model._clients.gradient_norm_answers([], 2.0, 1, {0: [edit]}, {}))
    before = grad.norm().item()
    assert before > 0 and grad.norm(2) == pytest.approx(before)
    model.step()
