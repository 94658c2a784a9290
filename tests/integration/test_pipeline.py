"""Pipelined train_step (GPipe, 1F1B, ZB-H1) and data-parallel replicas equal one process's full-batch training."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from client_sdk import LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL
from shardtrain import errors
from shardtrain import schedule as schedules
from tests.integration.training import SKIP_A_STAGE, largest_difference, regression_batches

ADAM = (torch.optim.Adam, {"lr": 3e-3})
SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
# Summing micro-batch gradients rounds differently from one full-batch backward (~1e-7 relative), and
# Adam divides by the gradient's own scale, so near-zero gradients turn that into visible steps:
# weights are compared to 1e-4, against Adam's step of up to 3e-3 per iteration.
PIPELINE_TOLERANCE = 1e-4


def train_full_batch(module: nn.Module, batches, optimizer: tuple, loss_fn=nn.functional.mse_loss):
    """One process, one full-batch step per batch; returns (state dict, losses)."""
    local = copy.deepcopy(module)
    opt = optimizer[0](local.parameters(), **optimizer[1])
    losses = []
    for x, y in batches:
        loss = loss_fn(local(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return local.state_dict(), losses


def train_pipelined(model, batches, loss="MSELoss", **kwargs) -> list[float]:
    return [model.train_step(x, y, loss, **kwargs) for x, y in batches]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("microbatches", [1, 4, 7])  # 7 does not divide the batch of 30: uneven micro-batches
def test_pipelined_seed_model_equals_full_batch_training(cluster4, schedule, microbatches):
    torch.manual_seed(0)
    reference = LayerList(TEST_RESIDUAL_SMALL)  # its residual crosses stages
    batches = regression_batches(steps=8, batch=30, features=1)
    expected, expected_losses = train_full_batch(reference, batches, ADAM)
    model = cluster4.deploy(TEST_RESIDUAL_SMALL, optimizer=ADAM, num_stages=3)
    model.load_state_dict(reference.state_dict())
    losses = train_pipelined(model, batches, microbatches=microbatches, schedule=schedule)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-7)
    assert largest_difference(model.state_dict(), expected) <= PIPELINE_TOLERANCE


def test_residual_skipping_a_stage_under_1f1b(cluster4):
    torch.manual_seed(1)
    reference = LayerList(SKIP_A_STAGE)
    batches = regression_batches(steps=10, batch=16, features=3)
    model = cluster4.deploy(reference, optimizer=(torch.optim.SGD, {"lr": 0.1}), split_points=[2, 4])
    train_pipelined(model, batches, microbatches=4, schedule="1f1b")
    expected, _ = train_full_batch(reference, batches, (torch.optim.SGD, {"lr": 0.1}))
    assert largest_difference(model.state_dict(), expected) <= 1e-5


def classifier() -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def test_a_named_loss_with_arguments_is_computed_on_the_last_stage(cluster4):
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randn(24, 6, generator=generator), torch.randint(0, 5, (24,), generator=generator))
               for _ in range(6)]
    loss = nn.CrossEntropyLoss(label_smoothing=0.1)
    expected, expected_losses = train_full_batch(classifier(), batches, ADAM, loss)
    model = cluster4.deploy(classifier(), optimizer=ADAM, num_stages=3)
    losses = train_pipelined(model, batches, loss, microbatches=3)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert largest_difference(model.state_dict(), expected) <= PIPELINE_TOLERANCE


class HalfL1(nn.Module):
    """A loss of the user's own: the shards cannot import it, so it travels as a captured graph."""

    def forward(self, prediction, target):
        return 0.5 * (prediction - target).abs().mean()


def test_a_loss_of_your_own_is_captured_and_shipped(cluster4):
    batches = regression_batches(steps=6, batch=12, features=6, outputs=5)
    expected, expected_losses = train_full_batch(classifier(), batches, ADAM, HalfL1())
    model = cluster4.deploy(classifier(), optimizer=ADAM, num_stages=2)
    losses = train_pipelined(model, batches, HalfL1(), microbatches=4, schedule="gpipe")
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert largest_difference(model.state_dict(), expected) <= PIPELINE_TOLERANCE


@pytest.mark.parametrize("loss_fn", [torch.nn.functional.mse_loss, lambda prediction, target: (
    (prediction - target).abs().mean() / 2)], ids=["F.mse_loss", "a lambda"])
def test_a_loss_function_is_captured_and_shipped_under_a_torch_schedule_name(cluster4, loss_fn):
    batches = regression_batches(steps=4, batch=12, features=6, outputs=5)
    expected, expected_losses = train_full_batch(classifier(), batches, ADAM, loss_fn)
    model = cluster4.deploy(classifier(), optimizer=ADAM, num_stages=2)
    losses = train_pipelined(model, batches, loss_fn, microbatches=4, schedule="GPipe")
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert largest_difference(model.state_dict(), expected) <= PIPELINE_TOLERANCE


def test_1f1b_keeps_at_most_p_micro_batches_alive_and_gpipe_keeps_m(cluster4):
    x, y = regression_batches(steps=1, batch=64, features=6, outputs=5)[0]
    peaks = {}
    for schedule in ("1f1b", "gpipe"):
        model = cluster4.deploy(classifier(), optimizer=ADAM, num_stages=3)
        model.train_step(x, y, "MSELoss", microbatches=8, schedule=schedule)
        stats = {s["stage"]: s for s in model.stats()}
        assert [stats[stage]["peak_in_flight"] for stage in range(3)] == (
            [3, 2, 1] if schedule == "1f1b" else [8, 8, 8])
        assert all(s["forward_s"] > 0 and s["backward_s"] > 0 and 0 < s["busy_fraction"] <= 1
                   for s in stats.values())
        peaks[schedule] = stats[0]["peak_activation_bytes"]
    assert 0 < peaks["1f1b"] < peaks["gpipe"]


@pytest.mark.parametrize("stages", [1, 2])
def test_two_replicas_equal_full_batch_training(cluster4, stages):
    torch.manual_seed(4)
    reference = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    batches = regression_batches(steps=8, batch=21, features=4)  # 21 rows: the replicas' shares differ
    expected, expected_losses = train_full_batch(reference, batches, ADAM)
    model = cluster4.deploy(reference, optimizer=ADAM, num_stages=stages, replicas=2)
    assert model.replicas == 2
    losses = train_pipelined(model, batches, microbatches=2)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert largest_difference(model.state_dict(), expected) <= PIPELINE_TOLERANCE
    assert sorted((s["replica"], s["stage"], s["allreduce_backend"]) for s in model.stats()) == [
        (r, s, "gloo") for r in range(2) for s in range(stages)]


def test_a_replicated_model_refuses_the_unsynchronised_loop(cluster4):
    model = cluster4.deploy(nn.Sequential(nn.Linear(4, 1)), num_stages=1, replicas=2)
    with pytest.raises(errors.FailedPrecondition, match="2 replicas: train it with model.train_step"):
        model(torch.randn(2, 4))
    with torch.no_grad():
        assert model(torch.randn(2, 4)).shape == (2, 1)  # inference runs on replica 0


def test_bad_train_step_arguments_are_refused_and_training_goes_on(cluster4):
    model = cluster4.deploy(classifier(), optimizer=ADAM, num_stages=2)
    x, y = regression_batches(steps=1, batch=6, features=6, outputs=5)[0]
    with pytest.raises(errors.InvalidArgument, match="unknown schedule 'zigzag'"):
        model.train_step(x, y, "MSELoss", schedule="zigzag")
    with pytest.raises(errors.InvalidArgument, match="6 rows cannot feed 1 replica"):
        model.train_step(x, y, "MSELoss", microbatches=8)
    with pytest.raises(errors.InvalidArgument, match="'TripletMarginLoss' is not allowed"):
        model.train_step(x, y, "TripletMarginLoss")
    with pytest.raises(errors.InvalidArgument, match="the loss failed on micro-batch 0"):
        model.train_step(x, y[:, :2], "MSELoss")
    assert model.train_step(x, y, "MSELoss", microbatches=2) > 0


def test_a_dead_replica_fails_the_step_instead_of_hanging(own_cluster):
    model = own_cluster.deploy(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), num_stages=1,
                               replicas=2)
    x, y = regression_batches(steps=1, batch=8, features=4)[0]
    model.train_step(x, y, "MSELoss")
    victim = next(s for s in own_cluster._services.services
                  if s.address == model._trainer.replicas[1].stages[0].address)
    victim.process.kill()
    victim.process.wait()
    started = time.monotonic()
    with pytest.raises((errors.Unavailable, errors.DeadlineExceeded), match="unavailable|replica"):
        model.train_step(x, y, "MSELoss")
    assert time.monotonic() - started < 60


def test_a_failing_stage_cancels_the_step_on_every_shard(cluster4):
    model = cluster4.deploy(classifier(), optimizer=ADAM, num_stages=3)
    x, y = regression_batches(steps=1, batch=8, features=6, outputs=5)[0]
    started = time.monotonic()
    with pytest.raises(errors.InvalidArgument, match="the loss failed"):
        model.train_step(x, y[:, :2], "MSELoss", microbatches=2)
    # The other shards were told to stop (the cancellation reaches them asynchronously): none keeps the step.
    while any(report.in_flight_steps for report in model.describe()):
        assert time.monotonic() - started < 30, "a shard still holds the failed step"
        time.sleep(0.05)
    assert model.train_step(x, y, "MSELoss", microbatches=2) > 0


def test_a_step_that_fails_on_a_later_micro_batch_changes_no_stage(cluster4):
    """Under 1F1B the last stage runs micro-batch 0's backward before micro-batch 1's loss fails: every stage must
    still refuse the optimizer step, or the stages' weights would drift apart."""
    model = cluster4.deploy(classifier(), optimizer=ADAM, num_stages=3)
    x, _ = regression_batches(steps=1, batch=8, features=6, outputs=5)[0]
    labels = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(0))
    model.train_step(x, labels, "CrossEntropyLoss", microbatches=2)
    before = model.state_dict()
    bad = labels.clone()
    bad[6] = 7  # no such class: only micro-batch 1's loss fails
    with pytest.raises(errors.InvalidArgument, match="the loss failed on micro-batch 1"):
        model.train_step(x, bad, "CrossEntropyLoss", microbatches=2)
    assert largest_difference(model.state_dict(), before) == 0
    assert model.train_step(x, labels, "CrossEntropyLoss", microbatches=2) > 0


def test_train_step_and_the_loop_take_turns_as_in_one_process(cluster4):
    """Both run on the same Links and optimizer step count: a planned step, a loop step, a planned step."""
    module = classifier()
    batches = regression_batches(steps=3, batch=12, features=6, outputs=5)
    expected, expected_losses = train_full_batch(module, batches, SGD)
    model = cluster4.deploy(module, optimizer=SGD, num_stages=3)
    losses = [model.train_step(*batches[0], "MSELoss", microbatches=3)]
    model.zero_grad()  # a planned step leaves its gradients, as a step in one process does
    x, y = batches[1]
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    model.step()
    model.zero_grad()
    losses.append(loss.item())
    losses.append(model.train_step(*batches[2], "MSELoss", microbatches=2, schedule="gpipe"))
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert largest_difference(model.state_dict(), expected) <= PIPELINE_TOLERANCE


def test_a_step_of_many_micro_batches_is_not_refused_as_items_piling_up(cluster4):
    """GPipe sends every micro-batch at once: 200 forward items wait on stage 0, more than the loop may pile up."""
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    batches = regression_batches(steps=1, batch=200, features=4)
    expected, expected_losses = train_full_batch(module, batches, SGD)
    model = cluster4.deploy(module, optimizer=SGD, num_stages=2)
    assert train_pipelined(model, batches, microbatches=200, schedule="gpipe") == pytest.approx(expected_losses,
                                                                                             rel=1e-5)
    assert largest_difference(model.state_dict(), expected) <= 1e-5


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_the_timeline_shows_each_stage_s_actions_of_the_last_step_in_order_on_one_clock(cluster4, schedule):
    model = cluster4.deploy(classifier(), optimizer=ADAM, num_stages=3)
    x, y = regression_batches(steps=1, batch=16, features=6, outputs=5)[0]
    model.train_step(x, y, "MSELoss", microbatches=4, schedule=schedule)
    timeline = model.timeline()
    lanes = timeline.lanes()
    assert list(lanes) == [(0, 0), (0, 1), (0, 2)]
    for (_, stage), spans in lanes.items():
        work = [(span.kind, span.microbatch) for span in spans if span.kind != "optimizer"]
        assert work == [(action.op, action.microbatch) for action in schedules.stage_actions(schedule, stage, 3, 4)]
        assert spans[-1].kind == "optimizer"
        assert all(earlier.end <= later.start for earlier, later in zip(spans, spans[1:]))  # one at a time
    span = {(s.stage, s.kind, s.microbatch): s for s in timeline.spans}
    for s in timeline.spans:  # after what it depends on, on the stages' shared clock
        if s.kind == "forward" and s.stage > 0:
            assert span[(s.stage - 1, "forward", s.microbatch)].end <= s.start
        if s.kind == "backward" and s.stage < 2:
            assert span[(s.stage + 1, "backward", s.microbatch)].end <= s.start
        if s.kind == "weight":
            assert span[(s.stage, "backward", s.microbatch)].end <= s.start
    rows = timeline.text(60).splitlines()
    assert len(rows) == 4 and all(len(row.split("|")[1]) == 60 for row in rows[:3])
    assert 0 < timeline.bubble() < 1
