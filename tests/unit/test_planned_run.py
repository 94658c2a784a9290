"""shard_service.planned_run over shard_service.executor: three stages' planned runs wired to each other in one process,
no server: each runs its actions in the schedule's order, sends exactly what it should, and together they compute
one process's gradients."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from shard_service.executor import StageExecutor
from shard_service.mailbox import Mailbox
from shard_service.ordering import StepOrder
from shard_service.runtime import DeploymentRuntime
from shard_service.planned_run import PlannedRun
from shard_service.stage import Stage
from shard_service.step_meter import StepMeter
from shardtrain import allowed_losses, errors, schedule
from shardtrain.residuals import StageResiduals
from shardtrain.v1 import shard_pb2
from tests.unit.test_stage import SGD, capture, model_state, source

LAYERS = [torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)]  # one per stage


@pytest.fixture(scope="module")
def programs() -> list[bytes]:
    examples = [torch.randn(2, 3), torch.randn(2, 4), torch.randn(2, 4)]
    return [capture(layer, example) for layer, example in zip(LAYERS, examples)]


def stages(programs, model: torch.nn.Sequential) -> list[Stage]:
    built = []
    for index, (layer, program) in enumerate(zip(model, programs)):
        stage = Stage(index, [source(index, layer, program)], StageResiduals(), SGD, "cpu")
        stage.weights.load_state({k: v for k, v in model_state(model).items() if k.startswith(f"{index}.")})
        built.append(stage)
    return built


class FakeShard:
    """What a stage's executor uses of its shard: the stage's place, a compute thread that records what ran, the
    settled steps, the loss; no replicas, residuals or shared device."""

    def __init__(self, index: int, count: int, ran: list, loss_fn):
        self.plan = shard_pb2.StagePlan(stage=index, num_stages=count)
        self.settings = SimpleNamespace(timeouts=SimpleNamespace(peer_wait=5.0), simulate_compute=0.0)
        self.deployment = DeploymentRuntime("d")
        self.order, self.steps, self.device, self.deployment_id = StepOrder(self.deployment), StepMeter(), None, "d"
        self._ran, self._loss_fn = ran, loss_fn
        self.durations: list[tuple[str, float]] = []  # (work's name, seconds it ran on the "compute thread")

    async def run(self, function, *args):
        names = {"forward": "forward", "backward": "backward", "backward_input": "backward",
                 "backward_weight": "weight"}
        if function.__name__ in names:
            self._ran.append((names[function.__name__], args[0][1]))
        start = time.perf_counter()
        result = function(*args)
        self.durations.append((function.__name__, time.perf_counter() - start))
        return result

    async def residual_gradients(self, stage, key) -> dict:
        return {}

    async def averager_call(self, name: str) -> None:
        return None

    def averager_arm(self, last_microbatch: bool) -> None:
        pass

    def loss(self, spec):
        return self._loss_fn


class PipelineSends:
    """A stage's sends, handed straight to the neighbouring run and logged."""

    def __init__(self, pipeline: Pipeline, index: int):
        self.pipeline, self.index = pipeline, index
        self.links = SimpleNamespace(by_call=set())

    async def loss(self, key, value) -> None:
        self.pipeline.sent.append((self.index, "loss", key.microbatch))
        self.pipeline.losses.append(value)

    async def activation(self, header, output) -> None:
        self.pipeline.sent.append((self.index, "activation", header.key.microbatch))
        self.pipeline.runs[self.index + 1].deliver(header.key.microbatch, "forward", (header, output))

    async def input_gradient(self, key, grad, zero_grad: bool = False, planned: bool = False) -> None:
        if self.index > 0:
            self.pipeline.sent.append((self.index, "gradient", key.microbatch))
            self.pipeline.runs[self.index - 1].deliver(key.microbatch, "backward",
                                                       (shard_pb2.BackwardHeader(key=key), grad))

    async def residuals(self, key, outgoing, to_client: bool = True) -> None:
        pass

    async def residual_gradients(self, key, grads) -> None:
        pass


class Pipeline:
    """Three runs of one planned step whose sends hand items straight to the neighbouring run, logging each send."""

    def __init__(self, built: list[Stage], plan: shard_pb2.StepPlan, targets: list[torch.Tensor],
                 loss: str = "MSELoss"):
        self.sent: list[tuple] = []   # (stage, what, micro-batch) in the order they were sent
        self.ran: dict[int, list[tuple[str, int]]] = {i: [] for i in range(len(built))}
        self.losses: list[float] = []
        self.runs: list[PlannedRun] = []
        self.targets = targets
        loss_fn = allowed_losses.build(loss, "{}")
        for index, stage in enumerate(built):
            shard = FakeShard(index, len(built), self.ran[index], loss_fn)
            executor = StageExecutor(shard, stage, PipelineSends(self, index))
            self.runs.append(PlannedRun(executor, 0, plan, Mailbox()))

    def put_targets(self) -> None:
        rows = sum(len(t) for t in self.targets)
        for k, y in enumerate(self.targets):
            key = shard_pb2.StepKey(deployment_id="d", step=0, microbatch=k)
            self.runs[-1]._targets.put((0, k), (shard_pb2.LossTarget(key=key, rows=len(y), batch_rows=rows), y))

    async def execute(self, inputs: list[torch.Tensor]) -> list:
        self.put_targets()
        for k, x in enumerate(inputs):
            header = shard_pb2.ForwardHeader(key=shard_pb2.StepKey(deployment_id="d", step=0, microbatch=k),
                                             requires_grad=True, zero_grad=k == 0)
            self.runs[0].deliver(k, "forward", (header, x))
        return await asyncio.gather(*(run.execute() for run in self.runs), return_exceptions=True)


def batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(rows, 3), torch.randn(rows, 2)


@pytest.mark.parametrize("name", [name for name in schedule.SCHEDULES if name not in schedule.INTERLEAVED])
def test_each_stage_runs_its_schedule_and_the_gradients_equal_one_process(programs, name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    built = stages(programs, model)
    x, y = batch()
    m = 4
    pipeline = Pipeline(built, shard_pb2.StepPlan(microbatches=m, schedule=name), list(y.chunk(m)))
    assert asyncio.run(pipeline.execute(list(x.chunk(m)))) == [None, None, None]

    for index in range(3):
        expected = [(a.op, a.microbatch) for a in schedule.stage_actions(name, index, 3, m)]
        assert pipeline.ran[index] == expected
    # Stage 0 sends no input gradient (nobody asked for it); the last stage sends losses, not activations.
    assert sorted(pipeline.sent) == sorted(
        [(0, "activation", k) for k in range(m)] + [(1, "activation", k) for k in range(m)]
        + [(2, "loss", k) for k in range(m)] + [(1, "gradient", k) for k in range(m)]
        + [(2, "gradient", k) for k in range(m)])

    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    assert sum(pipeline.losses) == pytest.approx(loss.item(), abs=1e-6)
    for index, stage in enumerate(built):
        for key, parameter in model.named_parameters():
            if key.startswith(f"{index}."):
                assert torch.allclose(stage.weights._state[key].grad, parameter.grad, atol=1e-6), key


def test_simulated_device_time_is_spent_within_the_stage_work_it_follows(programs):
    """--simulate-compute-ms: each planned forward and backward holds its device that much longer, inside the
    shard's run (on the compute thread, as a wait for kernels), not after it on the event loop."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x, y = batch()
    pipeline = Pipeline(stages(programs, model), shard_pb2.StepPlan(microbatches=2, schedule="1f1b"),
                        list(y.chunk(2)))
    for run in pipeline.runs:
        run.shard.settings.simulate_compute = 0.03
    assert asyncio.run(pipeline.execute(list(x.chunk(2)))) == [None, None, None]
    for run in pipeline.runs:
        timed = [(name, seconds) for name, seconds in run.shard.durations if name in ("forward", "backward")]
        assert len(timed) == 4 and all(seconds >= 0.03 for _, seconds in timed), timed


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_loss_that_fails_on_one_micro_batch_fails_the_last_stage_after_what_it_sent(programs):
    """1F1B, 3 stages, 2 micro-batches: the last stage runs F0 B0 F1 B1. The target of micro-batch 1 does not fit the
    output, so the last stage fails at F1, after it sent micro-batch 0's loss and gradient and nothing of micro-batch
    1; the stages before still wait for micro-batch 1's gradient until the run is aborted."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x, y = batch(4)
    targets = [y[:2], torch.randn(2, 3)]  # micro-batch 1: 3 columns against an output of 2
    pipeline = Pipeline(stages(programs, model), shard_pb2.StepPlan(microbatches=2, schedule="1f1b"), targets)

    async def scenario():
        pipeline.put_targets()
        tasks = [asyncio.ensure_future(run.execute()) for run in pipeline.runs]
        for k, xk in enumerate(x.chunk(2)):
            header = shard_pb2.ForwardHeader(key=shard_pb2.StepKey(deployment_id="d", step=0, microbatch=k),
                                             requires_grad=True, zero_grad=k == 0)
            pipeline.runs[0].deliver(k, "forward", (header, xk))
        with pytest.raises(errors.InvalidArgument, match="the loss failed on micro-batch 1"):
            await tasks[2]
        await asyncio.sleep(0.05)
        assert not tasks[0].done() and not tasks[1].done()  # waiting for micro-batch 1's gradient
        for run in pipeline.runs[:2]:
            run.abort()
        for task in tasks[:2]:
            with pytest.raises(errors.Cancelled):
                await task
    asyncio.run(scenario())
    assert [s for s in pipeline.sent if s[0] == 2] == [(2, "loss", 0), (2, "gradient", 0)]
    assert pipeline.ran[2] == [("forward", 0), ("backward", 0), ("forward", 1)]


def test_a_run_whose_all_reduce_fails_to_connect_runs_no_action(programs):
    """The first action's item came before the run began: the failure ends the run before that action runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    pipeline = Pipeline(stages(programs, model), shard_pb2.StepPlan(microbatches=1, schedule="gpipe"), [])
    run = pipeline.runs[0]

    async def connect_fails(name: str) -> None:
        raise errors.Unavailable("the other replica did not answer")
    run.shard.averager_call = connect_fails

    async def scenario():
        header = shard_pb2.ForwardHeader(key=shard_pb2.StepKey(deployment_id="d", step=0, microbatch=0))
        run.deliver(0, "forward", (header, torch.zeros(1, 3)))
        with pytest.raises(errors.Unavailable, match="did not answer"):
            await run.execute()
    asyncio.run(scenario())
    assert pipeline.ran[0] == [] and run.held_bytes() == 0


def test_items_outside_the_plan_are_refused(programs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    pipeline = Pipeline(stages(programs, model), shard_pb2.StepPlan(microbatches=2, schedule="gpipe"), [])

    async def scenario():
        run = pipeline.runs[1]
        with pytest.raises(errors.InvalidArgument, match="over 2 micro-batches"):
            run.deliver(2, "forward", (None, None))
        run.deliver(0, "forward", (None, torch.zeros(1)))
        with pytest.raises(errors.InvalidArgument, match="a second forward item"):
            run.deliver(0, "forward", (None, torch.zeros(1)))
        assert run.held_bytes() == 4
    asyncio.run(scenario())
    with pytest.raises(errors.InvalidArgument, match="unknown schedule"):
        PlannedRun(pipeline.runs[0].executor, 0, shard_pb2.StepPlan(microbatches=2, schedule="zigzag"))
    with pytest.raises(errors.InvalidArgument, match="1 to 4096 micro-batches"):
        PlannedRun(pipeline.runs[0].executor, 0, shard_pb2.StepPlan(microbatches=0, schedule="gpipe"))
