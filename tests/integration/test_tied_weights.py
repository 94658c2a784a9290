"""Weights tied across stages (a language model's head and its token embedding) stay one parameter: each stage
using it holds a copy, their gradients are summed before every step, and training equals one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

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

