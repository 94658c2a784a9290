"""shard_service.link_dispatch over a real shard, no server: the last of two stages, its links to stage 0 and to the SDK
recorded, is fed written-out item sequences and must send exactly what one process computes, in order."""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest
import torch
from torch import nn

from client_sdk.layers import capture_model, layers_of
from shard_service.link_dispatch import LinkedLoop
from shard_service.peers import Peers
from shard_service.shard import Shard
from shardtrain import errors, link_streams
from shardtrain.settings import ShardSettings
from shardtrain.v1 import shard_pb2

DEPLOYMENT = "d"
ROLES = shard_pb2.LinkRole


class RecordingEnd(link_streams.LinkEnd):
    """A link end whose sends are kept as items (message, tensor) instead of going anywhere."""

    def __init__(self, opening: shard_pb2.LinkOpen):
        self.items: list[tuple] = []
        self._reader = link_streams.ItemReader()
        super().__init__(f"recorded {ROLES.Name(opening.role)}", self._record, opening)

    async def _record(self, frame) -> None:
        item = self._reader.feed(frame)
        if item is not None:
            self.items.append(item)

    def kinds(self) -> list[str]:
        return [message.WhichOneof("item") for message, _ in self.items]


class LastStage:
    """Stage 1 of 2 (the model's last Linear), loaded from a captured model, with its two links opened."""

    def __init__(self, model: nn.Sequential):
        captured = capture_model(model, layers_of(model))
        plan = shard_pb2.StagePlan(stage=1, num_stages=2, previous_address="127.0.0.1:9", num_replicas=1)
        request = shard_pb2.LoadStageRequest(deployment_id=DEPLOYMENT, plan=plan, layers=captured[2:],
                                             optimizer=shard_pb2.OptimizerSpec(name="SGD", kwargs_json='{"lr": 0.1}'))
        settings = ShardSettings(coordinator="127.0.0.1:1", shared_memory=False, local_links=False)
        self.shard = Shard(settings, "127.0.0.1:8")
        self.peers = Peers(settings)
        self.loop = LinkedLoop(self.shard, self.peers)
        self.request = request
        self.state = {key: value.clone() for key, value in model.state_dict().items() if key.startswith("2.")}

    async def start(self) -> None:
        await self.shard.load(self.request)
        self.shard.stage.weights.load_state(self.state)
        await self.loop.reset(DEPLOYMENT)
        self.up = RecordingEnd(shard_pb2.LinkOpen(deployment_id=DEPLOYMENT, role=ROLES.LINK_ROLE_NEXT, from_stage=0))
        self.out = RecordingEnd(shard_pb2.LinkOpen(deployment_id=DEPLOYMENT, role=ROLES.LINK_ROLE_OUTPUT,
                                                   from_stage=-1))
        for end, role, source in ((self.up, ROLES.LINK_ROLE_NEXT, 0), (self.out, ROLES.LINK_ROLE_OUTPUT, -1)):
            self.loop.opened(shard_pb2.LinkOpen(deployment_id=DEPLOYMENT, role=role, from_stage=source), end)

    async def feed(self, end: link_streams.LinkEnd, message: shard_pb2.LinkMessage, tensor=None) -> None:
        """Hands one item to the loop, as a link's reader would, and lets the work it started run to its end."""
        self.loop.on_item(end, message, tensor)
        await self.settle()

    async def settle(self) -> None:
        """Waits (up to 10 s) until the work the loop started has ended."""
        await self.loop.settled(10.0)

    def weights(self) -> dict[str, torch.Tensor]:
        return {key: value.clone() for key, value in self.shard.stage.weights.state().items()}

    async def close(self) -> None:
        await self.loop.close()
        await self.shard.close()
        await self.peers.close()


def key(step: int, microbatch: int = 0) -> shard_pb2.StepKey:
    return shard_pb2.StepKey(deployment_id=DEPLOYMENT, step=step, microbatch=microbatch)


def forward(step: int, **fields) -> shard_pb2.LinkMessage:
    return shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(key=key(step), requires_grad=True, **fields))


def step_item(number: int, steps: list[int], failure: str = "") -> shard_pb2.LinkMessage:
    request = shard_pb2.StepRequest(deployment_id=DEPLOYMENT, step=max(steps), optimizer_step=number,
                                    backward_steps=steps)
    return shard_pb2.LinkMessage(step=shard_pb2.LinkStep(request=request, failure=failure))


def backpropagated(layer: nn.Module, h: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's output for `h`, the leaf holding `h` and its gradient): `grad` backpropagated in one process."""
    leaf = h.clone().requires_grad_(True)
    out = layer(leaf)
    out.backward(grad)
    return out, leaf


@pytest.fixture
def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_a_step_sends_the_output_down_the_gradient_up_and_applies_the_optimizer_as_one_process(model):
    reference = copy.deepcopy(model[2])
    h, grad = torch.randn(5, 4), torch.randn(5, 2)

    async def sequence():
        stage = LastStage(model)
        await stage.start()
        await stage.feed(stage.up, forward(0), h)
        await stage.feed(stage.out, shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=key(0))), grad)
        await stage.feed(stage.up, step_item(1, [0]))
        await stage.feed(stage.up, shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=1)))
        weights = stage.weights()
        await stage.close()
        return stage, weights
    stage, weights = asyncio.run(sequence())

    out, leaf = backpropagated(reference, h, grad)
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert stage.out.kinds() == ["output", "flush"]
    assert torch.allclose(stage.out.items[0][1], out.detach(), atol=1e-6)
    assert stage.up.kinds() == ["backward"]
    assert torch.allclose(stage.up.items[0][1], leaf.grad, atol=1e-6)
    for name, value in reference.state_dict().items():
        assert torch.allclose(weights[f"2.{name}"], value, atol=1e-6), name


def test_a_backward_that_fails_is_reported_up_and_no_stage_applies_the_step(model):
    """A gradient of the wrong shape: the error goes up toward stage 0 (each stage it passes counts the backward
    as failed), the step item names the failure, and this stage leaves its weights as they were."""
    h = torch.randn(5, 4)

    async def sequence():
        stage = LastStage(model)
        await stage.start()
        before = stage.weights()
        await stage.feed(stage.up, forward(0), h)
        await stage.feed(stage.out, shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=key(0))),
                         torch.randn(5, 3))
        await stage.feed(stage.up, step_item(1, [0]))
        await stage.feed(stage.up, shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=1)))
        after = stage.weights()
        await stage.close()
        return stage, before, after
    stage, before, after = asyncio.run(sequence())

    assert stage.up.kinds() == ["error"]
    error = stage.up.items[0][0].error
    assert error.backward and error.key.step == 0 and error.code == "INVALID_ARGUMENT"
    assert "output gradient" in error.message
    assert stage.out.kinds() == ["output", "flush"]  # the step settled (refused): the flush passes
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_step_a_call_started_keeps_its_output_for_fetching_and_a_backward_call_sends_the_gradient_up(model):
    """keep_output (set by the Forward RPC): the output waits in the call outbox, not on the SDK's link; a Backward
    call runs as a backward item; a later forward of the same step number without it goes to the SDK again."""
    reference = copy.deepcopy(model[2])
    h, grad = torch.randn(5, 4), torch.randn(5, 2)

    async def sequence():
        stage = LastStage(model)
        await stage.start()
        await stage.feed(stage.up, forward(0, keep_output=True), h)
        kept = await stage.loop.calls.fetch(key(0), "@output", timeout=1)
        await stage.loop.per_call.backward_call(shard_pb2.BackwardHeader(key=key(0)), grad)
        with pytest.raises(errors.FailedPrecondition, match=r"Forward goes to the first stage \(stage 0\)"):
            await stage.loop.per_call.forward_call(shard_pb2.ForwardHeader(key=key(1)), h)
        await stage.feed(stage.up, forward(1), h)
        await stage.close()
        return stage, kept
    stage, kept = asyncio.run(sequence())

    out, leaf = backpropagated(reference, h, grad)
    assert torch.allclose(kept, out.detach(), atol=1e-6)
    assert stage.out.kinds() == ["output"]  # step 1's, the SDK's
    assert stage.out.items[0][0].output.key.step == 1
    assert stage.up.kinds() == ["backward"]
    assert torch.allclose(stage.up.items[0][1], leaf.grad, atol=1e-6)


def test_a_link_from_the_previous_stage_that_ends_mid_step_is_reported_to_the_sdk(model):
    async def sequence():
        stage = LastStage(model)
        await stage.start()
        await stage.feed(stage.up, forward(0), torch.randn(5, 4))
        stage.loop.closed(stage.up)
        await stage.settle()
        await stage.close()
        return stage
    stage = asyncio.run(sequence())

    assert stage.out.kinds() == ["output", "error"]
    error = stage.out.items[1][0].error
    assert error.code == "UNAVAILABLE" and not error.HasField("key") and error.through_step == 0
    assert "its link to this shard ended" in error.message


def test_a_planned_step_on_the_last_stage_sends_each_loss_to_the_sdk_and_gradients_up_in_1f1b_order(model):
    """Two micro-batches, 1F1B: the last stage runs F0 B0 F1 B1, so its sends alternate."""
    plan = shard_pb2.StepPlan(microbatches=2, schedule="1f1b")
    hs, ys = torch.randn(4, 4).chunk(2), torch.randn(4, 2).chunk(2)

    async def sequence():
        stage = LastStage(model)
        await stage.start()
        for k, y in enumerate(ys):
            target = shard_pb2.LossTarget(key=key(0, k), loss=shard_pb2.LossSpec(name="MSELoss"), rows=2,
                                          batch_rows=4)
            await stage.feed(stage.out, shard_pb2.LinkMessage(target=target), y)
        for k, h in enumerate(hs):  # the run waits for its items in turn: nothing to wait for after each
            header = shard_pb2.ForwardHeader(key=key(0, k), requires_grad=True, zero_grad=k == 0, plan=plan)
            stage.loop.on_item(stage.up, shard_pb2.LinkMessage(forward=header), h)
        await stage.settle()
        await stage.close()
        return stage
    stage = asyncio.run(sequence())

    assert stage.out.kinds() == ["loss", "loss"] and stage.up.kinds() == ["backward", "backward"]
    assert [message.backward.key.microbatch for message, _ in stage.up.items] == [0, 1]
    expected = [0.5 * nn.functional.mse_loss(model[2](h), y).item() for h, y in zip(hs, ys)]
    assert [message.loss.loss for message, _ in stage.out.items] == pytest.approx(expected, abs=1e-6)


def test_a_forward_that_failed_before_this_stage_settles_its_step_here_at_once(model):
    """A planned step that failed on an earlier stage before any of its items came here: the error item is all this
    stage sees, and the optimizer step listing that step's backward must be refused here, not wait for it."""
    async def sequence():
        stage = LastStage(model)
        await stage.start()
        before = stage.weights()
        error = link_streams.error_item(key(0), errors.InvalidArgument("refused on stage 0"), "stage 0")
        await stage.feed(stage.up, error)
        await stage.feed(stage.up, step_item(1, [0]))
        await stage.feed(stage.up, shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=1)))
        after = stage.weights()
        await stage.close()
        return stage, before, after
    stage, before, after = asyncio.run(sequence())
    assert stage.out.kinds() == ["error", "flush"]
    assert all(torch.equal(before[name], after[name]) for name in before)


async def until(condition, what: str) -> None:
    """Lets the loop run until `condition()` holds (up to 10 s)."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{what} did not happen")


def test_a_step_of_the_previous_deployment_ended_by_a_new_load_settles_nothing_of_the_new_one(model):
    """A recovery loads a new deployment on a surviving shard while its old deployment's optimizer step still runs
    (queued behind the new stage's build, then on the compute thread). The LoadStage ends that old work; what it
    settles on its way out must stay with the old deployment: the new one's forwards still wait for their own
    optimizer steps, else a forward runs (and clears gradients) before the step it follows."""
    h, grad = torch.randn(5, 4), torch.randn(5, 2)
    release = threading.Event()

    async def sequence():
        stage = LastStage(model)
        await stage.start()
        await stage.feed(stage.up, forward(0), h)
        await stage.feed(stage.out, shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=key(0))), grad)
        old, lock = stage.shard.stage, stage.shard.device.lock
        old.step = lambda *args: release.wait(10)  # the old step, slow on the compute thread
        stage.shard._durations["step"] = 1.0
        await lock.acquire()  # the device busy: the new stage's build and the old step queue for it, in that order
        request = shard_pb2.LoadStageRequest()
        request.CopyFrom(stage.request)
        request.deployment_id = "new"
        load = asyncio.ensure_future(stage.shard.load(request))
        await until(lambda: len(lock._waiters or ()) == 1, "the load's wait for the device")
        stage.loop.on_item(stage.up, step_item(7, [0]), None)
        await until(lambda: len(lock._waiters or ()) == 2, "the old step's wait for the device")
        lock.release()
        await load
        await stage.loop.reset("new")  # as LoadStage does next: the old step is ended mid-way
        release.set()
        await until(lambda: not stage.loop._tasks, "the old step's end")
        with pytest.raises(errors.DeadlineExceeded):
            await stage.shard.order.after_optimizer_step(1, 0.05)
        await stage.close()
    asyncio.run(sequence())
