"""The interleaved schedule: shard processes serving two shards each on one device, stage s on device s mod p,
each device running its stages' actions in the schedule's order, and training equal to one process."""

from __future__ import annotations

import pytest
import torch

from client_sdk import Cluster, LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL
from shardtrain import errors
from shardtrain import schedule as schedules
from tests.integration.test_pipeline import train_full_batch
from tests.integration.training import largest_difference, regression_batches

SGD = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


@pytest.fixture(scope="module")
def two_devices():
    with Cluster.local(num_shards=2, virtual_stages=2) as cluster:
        yield cluster


def test_a_process_registers_one_shard_per_stage_of_its_device(two_devices):
    shards = two_devices.shards()
    assert len(shards) == 4
    groups = {}
    for shard in shards:
        groups.setdefault(shard.device_group, []).append(shard.address)
    assert len(groups) == 2 and all(group and len(members) == 2 for group, members in groups.items())


@pytest.mark.parametrize("microbatches", [4, 6])  # 6 does not divide the batch of 30: uneven micro-batches
def test_interleaved_training_equals_one_process(two_devices, microbatches):
    torch.manual_seed(0)
    reference = LayerList(TEST_RESIDUAL_SMALL)  # its residual crosses stages
    batches = regression_batches(steps=6, batch=30, features=1)
    expected, expected_losses = train_full_batch(reference, batches, SGD)
    model = two_devices.deploy(TEST_RESIDUAL_SMALL, optimizer=SGD, num_stages=4, virtual_stages=2)
    model.load_state_dict(reference.state_dict())
    device_of = {shard.address: shard.device_group for shard in two_devices.shards()}
    devices = [device_of[placement.shard_address] for placement in model.placements]
    assert devices[0] == devices[2] != devices[1] == devices[3]  # stage s on device s mod 2
    losses = [model.train_step(x, y, "MSELoss", microbatches=microbatches, schedule="interleaved")
              for x, y in batches]
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-7)
    assert largest_difference(model.state_dict(), expected) <= 1e-5

    timeline = model.timeline()  # each device ran its stages' actions one at a time, in the schedule's order
    for device in range(2):
        spans = sorted((span for span in timeline.spans if span.stage % 2 == device and span.kind != "optimizer"),
                       key=lambda span: span.start)
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))
        expected_order = [(stage, action.op, action.microbatch) for stage, action in
                          schedules.device_actions("interleaved", device, 4, microbatches, 2)]
        assert [(span.stage, span.kind, span.microbatch) for span in spans] == expected_order


def test_what_the_interleaved_schedule_cannot_do_is_refused(two_devices):
    x, y = regression_batches(steps=1, batch=16, features=1)[0]
    model = two_devices.deploy(TEST_RESIDUAL_SMALL, optimizer=SGD, num_stages=4, virtual_stages=2)
    with pytest.raises(errors.InvalidArgument, match="does not split into 2 rounds; use one of"):
        model.train_step(x, y, "MSELoss", microbatches=5, schedule="interleaved")
    model.train_step(x, y, "MSELoss", microbatches=4, schedule="1f1b")  # other schedules run, one stage at a time
    model.train_step(x, y, "MSELoss", microbatches=4, schedule="interleaved")
    with pytest.raises(errors.InvalidArgument, match="3 stages do not split into devices of 2 stages each"):
        two_devices.deploy(TEST_RESIDUAL_SMALL, optimizer=SGD, num_stages=3, virtual_stages=2)
    plain = two_devices.deploy(TEST_RESIDUAL_SMALL, optimizer=SGD, num_stages=2)
    needs = r"needs several stages per device: deploy\(\.\.\., virtual_stages=2\)"
    with pytest.raises(errors.InvalidArgument, match=needs):
        plain.train_step(x, y, "MSELoss", microbatches=4, schedule="interleaved")


def test_a_plan_a_shard_refuses_fails_its_step_at_once_and_the_next_step_trains(two_devices):
    torch.manual_seed(0)
    reference = LayerList(TEST_RESIDUAL_SMALL)
    batches = regression_batches(steps=2, batch=16, features=1)
    model = two_devices.deploy(TEST_RESIDUAL_SMALL, optimizer=SGD, num_stages=2)
    model.load_state_dict(reference.state_dict())
    model._planned_steps.check_schedule = lambda *_: None  # as a client in another language sending it unchecked
    with pytest.raises(errors.InvalidArgument, match=r"\(stage 0\): the interleaved schedule puts several stages"):
        model.train_step(*batches[0], "MSELoss", microbatches=4, schedule="interleaved")
    model.train_step(*batches[1], "MSELoss", microbatches=4, schedule="1f1b")  # no stage waits for the refused one
    expected, _ = train_full_batch(reference, batches[1:], SGD)
    assert largest_difference(model.state_dict(), expected) <= 1e-5
