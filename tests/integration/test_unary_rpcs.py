"""The one-call-per-operation RPCs train like one process too: a client in another language that drives
the loop with Forward, FetchTensor("@output"), Backward and Step, with a residual that skips a stage.
They start the same work as the SDK's Link items, so their failures follow the same rules."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from client_sdk import LayerList
from shardtrain import auth, errors, rpc, wire
from shardtrain import schedule as schedules
from shardtrain.residuals import INPUT_GRADIENT, OUTPUT
from shardtrain.v1 import coordinator_pb2, shard_pb2
from tests.integration.training import (SKIP_A_STAGE, largest_difference, regression_batches, train_locally,
                                        train_remotely)

SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


class Calls:
    """A client of the per-call RPCs, as another language would write it: one Peer per stage."""

    def __init__(self, model, security):
        self.deployment_id = model.deployment_id
        self.stages = [rpc.Peer(f"stage {i}", placement.shard_address, rpc.SHARD_SERVICE, security, timeout=30)
                       for i, placement in enumerate(model.placements)]
        for stage in self.stages:
            stage.metadata = auth.with_deployment(stage.metadata, model._clients.secret)

    def key(self, step: int) -> shard_pb2.StepKey:
        return shard_pb2.StepKey(deployment_id=self.deployment_id, step=step)

    async def forward(self, step: int, x: torch.Tensor, stage: int = 0, **header) -> torch.Tensor:
        forward = shard_pb2.ForwardHeader(key=self.key(step), requires_grad=True, zero_grad=True,
                                          after_optimizer_step=step - 1, **header)
        await self.stages[stage].call("Forward", wire.framed(shard_pb2.ForwardRequest, forward, {"activation": x}))
        return (await rpc.fetch_tensor(self.stages[-1], self.key(step), OUTPUT)).requires_grad_(True)

    async def backward(self, step: int, gradient: torch.Tensor) -> None:
        await self.stages[-1].call("Backward", wire.framed(shard_pb2.BackwardRequest,
                                                           shard_pb2.BackwardHeader(key=self.key(step)),
                                                           {"gradient": gradient}))

    async def step(self, step: int, stage: int = 0) -> None:
        request = shard_pb2.StepRequest(deployment_id=self.deployment_id, step=step, optimizer_step=step,
                                        backward_steps=[step])
        await self.stages[stage].call("Step", request)

    async def settled(self, step: int, x: torch.Tensor) -> None:
        """Returns once every stage has settled optimizer step `step`: a Step call returns when the first stage has,
        the others apply it as it comes down. A no-grad forward that waits for it on each stage tells."""
        forward = shard_pb2.ForwardHeader(key=self.key(step + 1), requires_grad=False, after_optimizer_step=step)
        await self.stages[0].call("Forward", wire.framed(shard_pb2.ForwardRequest, forward, {"activation": x}))
        await rpc.fetch_tensor(self.stages[-1], self.key(step + 1), OUTPUT)

    async def close(self) -> None:
        for stage in self.stages:
            await stage.close()


def run(model, security, script):
    async def with_calls():
        calls = Calls(model, security)
        try:
            return await script(calls)
        finally:
            await calls.close()
    return model._io.run(with_calls())


def test_forward_fetch_backward_step_calls_match_one_process(cluster4):
    torch.manual_seed(1)
    reference = LayerList(SKIP_A_STAGE)
    batches = regression_batches(steps=10, batch=8, features=3)
    model = cluster4.deploy(reference, optimizer=SGD, split_points=[2, 4])

    async def train(calls: Calls) -> None:
        for step, (x, y) in enumerate(batches, start=1):
            pred = await calls.forward(step, x)
            torch.nn.functional.mse_loss(pred, y).backward()
            await calls.backward(step, pred.grad)
            await calls.step(step)
        await calls.settled(len(batches), batches[0][0])
    run(model, cluster4.security, train)
    assert largest_difference(model.state_dict(), train_locally(reference, batches, SGD)) <= 1e-5


def test_the_first_stage_keeps_the_input_gradient_when_the_forward_asks(cluster4):
    torch.manual_seed(2)
    reference = LayerList(SKIP_A_STAGE)
    (x, y), = regression_batches(steps=1, batch=8, features=3)
    model = cluster4.deploy(reference, optimizer=SGD, split_points=[2, 4])

    async def one_step(calls: Calls) -> torch.Tensor:
        pred = await calls.forward(1, x, input_requires_grad=True)
        torch.nn.functional.mse_loss(pred, y).backward()
        await calls.backward(1, pred.grad)
        return await rpc.fetch_tensor(calls.stages[0], calls.key(1), INPUT_GRADIENT)
    input_grad = run(model, cluster4.security, one_step)
    x_local = x.clone().requires_grad_(True)
    torch.nn.functional.mse_loss(copy.deepcopy(reference)(x_local), y).backward()
    assert torch.allclose(input_grad, x_local.grad, atol=1e-6)


def test_calls_to_the_wrong_stage_are_refused_at_once_and_training_goes_on(cluster4):
    torch.manual_seed(3)
    reference = LayerList(SKIP_A_STAGE)
    batches = regression_batches(steps=2, batch=8, features=3)
    model = cluster4.deploy(reference, optimizer=SGD, split_points=[2, 4])
    (x, y), second = batches

    async def script(calls: Calls) -> None:
        with pytest.raises(errors.FailedPrecondition, match=r"Forward goes to the first stage \(stage 0\)"):
            await calls.forward(1, x, stage=1)
        pred = await calls.forward(1, x)
        torch.nn.functional.mse_loss(pred, y).backward()
        await calls.backward(1, pred.grad)
        with pytest.raises(errors.FailedPrecondition, match=r"Step goes to the first stage"):
            await calls.step(1, stage=2)
        with pytest.raises(errors.InvalidArgument, match=r"FetchTensor here serves '@output', '@input_grad', 'skip', "
                                                         r"not 'res_1': a residual is fetched from a stage that reads"):
            await rpc.fetch_tensor(calls.stages[-1], calls.key(1), "res_1")
        await calls.step(1)
        with pytest.raises(errors.FailedPrecondition, match="optimizer step 1 was settled already"):
            await calls.step(1)
        await calls.settled(1, x)
    run(model, cluster4.security, script)
    assert largest_difference(model.state_dict(), train_locally(reference, batches[:1], SGD)) <= 1e-5


def test_a_failed_backward_refuses_the_step_on_every_stage(cluster4):
    torch.manual_seed(4)
    reference = LayerList(SKIP_A_STAGE)
    batches = regression_batches(steps=2, batch=8, features=3)
    model = cluster4.deploy(reference, optimizer=SGD, split_points=[2, 4])
    before = model.state_dict()
    (x, y), (x2, y2) = batches

    async def script(calls: Calls) -> None:
        pred = await calls.forward(1, x)
        with pytest.raises(errors.InvalidArgument, match="gradient"):
            await calls.backward(1, torch.ones(3, 3))  # the output is (8, 1)
        with pytest.raises(errors.FailedPrecondition, match="optimizer step 1 not applied: the backward of step 1"):
            await calls.step(1)
        pred = await calls.forward(2, x2)  # the next step trains from the weights before
        torch.nn.functional.mse_loss(pred, y2).backward()
        await calls.backward(2, pred.grad)
        request = shard_pb2.StepRequest(deployment_id=calls.deployment_id, step=2, optimizer_step=2,
                                        backward_steps=[2])
        await calls.stages[0].call("Step", request)
    run(model, cluster4.security, script)
    local = copy.deepcopy(reference)
    local.load_state_dict(before)
    expected = train_locally(local, [(x2, y2)], SGD)
    # Step answers once stage 0 applied it; the later stages apply it as its verdict reaches them.
    deadline = time.monotonic() + 60
    while largest_difference(model.state_dict(), expected) > 1e-5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert largest_difference(model.state_dict(), expected) <= 1e-5


def test_a_forward_refused_by_the_stage_fails_its_call_and_the_sdk_trains_on(cluster4):
    torch.manual_seed(5)
    model = cluster4.deploy(LayerList(SKIP_A_STAGE), optimizer=SGD, split_points=[2, 4])

    async def script(calls: Calls) -> None:
        with pytest.raises(errors.InvalidArgument, match=r"expected float32 of shape \[batch, 3\], got .*\[8, 5\]"):
            await calls.forward(1, torch.ones(8, 5))  # the model takes 3 features
    run(model, cluster4.security, script)
    assert len(train_remotely(model, regression_batches(steps=2, batch=8, features=3))) == 2


class TwoInOneOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x, shift):
        return self.second(self.first(x) + shift)


def test_calls_on_a_model_of_several_inputs_are_refused_as_the_calls_carry_one(cluster4):
    x = torch.randn(4, 3)
    model = cluster4.deploy(TwoInOneOut(), example_inputs=(x, torch.zeros(4, 3)), num_stages=2)

    async def script(calls):
        with pytest.raises(errors.FailedPrecondition, match="takes or returns several tensors; the per-call RPCs "
                                                            "carry one each way"):
            await calls.forward(1, x)
    run(model, cluster4.security, script)
    assert model(x, torch.ones(4, 3)).shape == (4, 3)  # the SDK trains on


@pytest.mark.parametrize("name", schedules.SCHEDULES)
def test_plan_schedule_answers_each_stage_s_actions_as_the_stages_run_them(cluster4, name):
    stages, per_device = (4, 2) if name in schedules.INTERLEAVED else (3, 1)
    request = coordinator_pb2.PlanScheduleRequest(num_stages=stages, microbatches=6, schedule=name,
                                                  virtual_stages=per_device)
    answer = cluster4._io.run(cluster4._coordinator.call("PlanSchedule", request))
    ops = {(True, False): schedules.BACKWARD, (False, True): schedules.WEIGHT, (False, False): schedules.FORWARD}
    assert [entry.stage for entry in answer.stages] == list(range(stages))
    for entry in answer.stages:
        got = [schedules.Action(ops[(a.backward, a.weight)], a.microbatch) for a in entry.actions]
        assert got == schedules.stage_actions(name, entry.stage, stages, 6, per_device)
