"""Optimizer steps applied ahead of their verdict: kept when every backward succeeded, undone when one failed.

A stage after the first applies a step as soon as its own backwards are over (shard_service/loop.py);
the first stage's backward, which ends last, decides whether the step stands everywhere.
"""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from client_sdk.processes import LocalServices
from shardtrain import errors
from tests.integration.training import regression_batches, train_locally, train_remotely

ADAM = (torch.optim.Adam, {"lr": 0.01})


class NoInputGradient(nn.Module):
    """Passes its input on, plus a term whose derivative torch does not implement (igamma's in its first
    argument): the backward fails, but only when the input itself requires a gradient."""

    def forward(self, x):
        return x + 1e-3 * torch.igamma(x.abs() + 1, torch.ones_like(x))


def failing_first_stage_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(NoInputGradient(), nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1))


def deploy_on_three_stages(cluster: Cluster, net: nn.Module):
    return cluster.deploy(net, optimizer=ADAM, split_points=[2, 3], example_input=torch.randn(4, 3))


@contextlib.contextmanager
def three_shards(step_ahead: str):
    """A cluster of 3 shards started with --step-ahead `step_ahead`."""
    services = LocalServices(3, "cpu", shard_flags=["--step-ahead", step_ahead])
    try:
        with Cluster(services.coordinator_address, services=services) as cluster:
            cluster.wait_for_shards(3, 120.0)
            yield cluster
    finally:
        services.stop()
        shutil.rmtree(services.log_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def stepping_ahead():
    """Shards that apply every step ahead ("auto" would not, for optimizer steps as quick as these)."""
    with three_shards("on") as cluster:
        yield cluster


def test_a_failed_first_stage_backward_undoes_the_steps_applied_ahead(stepping_ahead):
    net = failing_first_stage_net()
    model = deploy_on_three_stages(stepping_ahead, net)
    batches = regression_batches(steps=3, batch=4, features=3)
    train_remotely(model, batches[:2])  # the optimizer has state to undo to
    weights, optimizer_state = model.state_dict(), model.optimizer_state_dict()

    x, y = batches[2]
    pred = model(x.clone().requires_grad_())  # stage 0 will differentiate into its input: its backward fails
    grad = torch.autograd.grad(torch.nn.functional.mse_loss(pred, y), pred)[0]
    model._remote_backward(model._last_step, grad)  # not waited for, so the step lists it
    with pytest.raises(errors.ShardtrainError, match=r"\(stage 0\).*derivative for 'igamma: input' is not implemented"):
        model.step()
        model.synchronize()

    reports = model.describe()
    assert [r.step_ahead for r in reports] == [False, True, True]
    assert [r.steps_undone for r in reports] == [0, 1, 1], "stages 1 and 2 applied the step ahead, then undid it"
    after = model.state_dict()
    assert all(torch.equal(weights[k], after[k]) for k in weights), "a refused step must leave every weight"
    after_state = model.optimizer_state_dict()
    for index, state in optimizer_state["state"].items():
        assert all(torch.equal(value, after_state["state"][index][key]) for key, value in state.items())

    # Nothing was lost: once the failed step's gradients are cleared, training goes on from where the two
    # good steps left off, as in one process.
    model.zero_grad()
    train_remotely(model, batches[2:])
    expected = train_locally(net, batches, ADAM)
    trained = model.state_dict()
    for key, value in expected.items():
        assert torch.allclose(trained[key], value, atol=1e-6, rtol=0), key


@pytest.mark.parametrize("step_ahead", ["on", "off"])
def test_training_is_the_same_with_steps_applied_ahead_or_not(step_ahead, stepping_ahead):
    with contextlib.nullcontext(stepping_ahead) if step_ahead == "on" else three_shards("off") as cluster:
        net = failing_first_stage_net()
        model = deploy_on_three_stages(cluster, net)
        batches = regression_batches(steps=5, batch=4, features=3)
        train_remotely(model, batches)
        assert [r.step_ahead for r in model.describe()] == [False, step_ahead == "on", step_ahead == "on"]
        expected = train_locally(net, batches, ADAM)
        trained = model.state_dict()
        for key, value in expected.items():
            assert torch.allclose(trained[key], value, atol=1e-6, rtol=0), key
