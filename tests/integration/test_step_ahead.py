"""Optimizer steps applied ahead of their verdict: kept when every backward succeeded, undone when one failed.

A stage after the first applies a step as soon as its own backwards are over (shard_service/loop.py);
the first stage's backward, which ends last, decides whether the step stands everywhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from client_sdk.processes import LocalServices
from shardtrain import errors, optim
from shardtrain.v1 import shard_pb2
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
def three_shards(step_ahead: str, local_links: str = "on"):
    """A cluster of 3 shards started with --step-ahead `step_ahead` (and --local-links `local_links`)."""
    services = LocalServices(3, "cpu", shard_flags=["--step-ahead", step_ahead, "--local-links", local_links])
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
    # Stages 1 and 2 applied the step ahead and then undid it; or a stage's lowest-priority thread got its core only
    # after the refusal had come, and then it applied nothing (Stage.step_ahead).
    assert [r.steps_undone for r in reports] in ([0, 1, 1], [0, 0, 1], [0, 1, 0], [0, 0, 0])
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


def stage_state(model, index: int) -> tuple[shard_pb2.DescribeResponse, dict, optim.KeyedState]:
    """Stage `index`'s shard's own report, weights and optimizer state, asked of that shard alone."""
    clients = model._clients

    async def read():
        report = await clients.stages[index].call("Describe", shard_pb2.DescribeRequest())
        return report, await clients.stage_state(index), await clients.stage_optimizer_state(index)
    return model._io.run(read())


@pytest.mark.parametrize("local_links", ["on", "off"])
def test_steps_applied_ahead_are_undone_on_every_later_stage_when_the_first_stage_goes_away(local_links):
    # Stage 0 passes the step's notice down, stages 1 and 2 apply the step ahead, then stage 0 dies before
    # its verdict. Stage 1 sees its link from stage 0 break; stage 2 does not (stage 1 is still there), so
    # unless stage 1 withdraws the step from it, stage 2 would keep a step that stage 1 undid.
    # With the links on gRPC streams only (as between hosts), the killed stage's stream may end at stage 1 just
    # as a closed one does: stage 1 takes either for the stage going away (LinkedLoop.closed).
    with three_shards("on", local_links) as cluster:
        torch.manual_seed(0)
        model = cluster.deploy(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1)), optimizer=ADAM,
                               split_points=[1, 2])
        batches = regression_batches(steps=3, batch=4, features=3)
        train_remotely(model, batches[:2])
        model.synchronize()  # the last step settled on every stage: a shard's read does not wait for it
        before = [stage_state(model, index) for index in (1, 2)]
        process = {s.address: s.process for s in cluster._services.services}
        first, last = (process[model.placements[i].shard_address] for i in (0, 2))

        x, y = batches[2]
        pred = model(x)
        os.kill(last.pid, signal.SIGSTOP)  # holds every backward of the step back, and with them the verdict
        try:
            torch.nn.functional.mse_loss(pred, y).backward()  # its gradient waits in stage 2's socket
            model.step()  # stage 0 passes the notice on at once; its own backward waits for stage 2's
            time.sleep(1.0)
            os.kill(first.pid, signal.SIGSTOP)  # after the notice, before the verdict: it cannot come now
        finally:
            os.kill(last.pid, signal.SIGCONT)
        time.sleep(2.0)  # stage 2's backward, then stage 1's, and each one's step applied ahead
        first.kill()
        first.wait()

        deadline = time.monotonic() + 30
        while True:
            after = [stage_state(model, index) for index in (1, 2)]
            if all(report.steps_undone for report, _, _ in after) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [report.steps_undone for report, _, _ in after] == [1, 1], \
            "stages 1 and 2 applied the step ahead, then undid it when stage 0 went away before its verdict"
        for (_, weights, state), (_, weights_after, state_after) in zip(before, after):
            assert all(torch.equal(value, weights_after[key]) for key, value in weights.items())
            assert state.values == state_after.values
            assert all(torch.equal(value, state_after.tensors[key]) for key, value in state.tensors.items())
        with pytest.raises(errors.ShardtrainError):
            model.synchronize()
