"""shard_service.step_machine: one stage's planned step driven by written-out event sequences, each event's effects
compared exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shard_service.step_machine import (ACTIVATION, BACKWARD, FORWARD, INPUT_GRADIENT, LOSS, RESIDUAL_GRADIENTS,
                                        RESIDUALS, TARGET, WEIGHT, ArmAllReduce, Await, Compute, ComputeLoss,
                                        ConnectAllReduce, Done, DropWaiting, FinishAllReduce, Report, Send,
                                        StepMachine)
from shardtrain import errors, schedule

ROOT = Path(__file__).resolve().parents[2]
START = ConnectAllReduce()
END = [FinishAllReduce()]  # then all_reduced(): Done


def machine(name: str, stage: int, stages: int, microbatches: int, virtual_stages: int = 1) -> StepMachine:
    """Stage `stage`'s machine for step 7 under schedule `name`."""
    actions = schedule.stage_actions(name, stage, stages, microbatches, virtual_stages)
    return StepMachine(7, actions, microbatches, first=stage == 0, last=stage == stages - 1,
                       split=name in schedule.SPLIT_BACKWARD)


def play(step: StepMachine, script: list[tuple]) -> None:
    """Feeds each (event, arguments, expected effects) in turn and compares what the machine returns."""
    for number, (event, arguments, expected) in enumerate(script):
        assert getattr(step, event)(*arguments) == expected, f"event {number}: {event}{arguments}"


def sent(what: str, k: int) -> list[Send]:
    """A forward's results (what: ACTIVATION or LOSS), or a backward's gradients (what: INPUT_GRADIENT)."""
    if what == INPUT_GRADIENT:
        return [Send(INPUT_GRADIENT, k), Send(RESIDUAL_GRADIENTS, k)]
    return [Send(what, k), Send(RESIDUALS, k)]


def test_1f1b_first_stage_runs_both_forwards_then_each_backward_as_its_gradient_comes():
    play(machine("1f1b", 0, 3, 2), [
        ("started", (), [START, Await(FORWARD, 0)]),
        ("arrived", (FORWARD, 0), [Compute(FORWARD, 0)]),
        ("arrived", (FORWARD, 1), []),  # early: kept for its turn
        ("computed", (FORWARD, 0), sent(ACTIVATION, 0) + [Compute(FORWARD, 1)]),
        ("computed", (FORWARD, 1), sent(ACTIVATION, 1) + [Await(BACKWARD, 0)]),
        ("arrived", (BACKWARD, 0), [ArmAllReduce(False), Compute(BACKWARD, 0)]),
        # The first stage sends no input gradient: only the residuals' gradients go back.
        ("computed", (BACKWARD, 0), [Send(RESIDUAL_GRADIENTS, 0), Await(BACKWARD, 1)]),
        ("arrived", (BACKWARD, 1), [ArmAllReduce(True), Compute(BACKWARD, 1)]),
        ("computed", (BACKWARD, 1), [Send(RESIDUAL_GRADIENTS, 1)] + END),
        ("all_reduced", (), [Done()]),
    ])


def test_1f1b_middle_stage_passes_activations_on_and_gradients_back():
    play(machine("1f1b", 1, 3, 3), [  # F0 F1 B0 F2 B1 B2
        ("started", (), [START, Await(FORWARD, 0)]),
        ("arrived", (FORWARD, 0), [Compute(FORWARD, 0)]),
        ("computed", (FORWARD, 0), sent(ACTIVATION, 0) + [Await(FORWARD, 1)]),
        ("arrived", (FORWARD, 1), [Compute(FORWARD, 1)]),
        ("arrived", (FORWARD, 2), []),
        ("computed", (FORWARD, 1), sent(ACTIVATION, 1) + [Await(BACKWARD, 0)]),
        ("arrived", (BACKWARD, 0), [ArmAllReduce(False), Compute(BACKWARD, 0)]),
        ("computed", (BACKWARD, 0), sent(INPUT_GRADIENT, 0) + [Compute(FORWARD, 2)]),
        ("computed", (FORWARD, 2), sent(ACTIVATION, 2) + [Await(BACKWARD, 1)]),
        ("arrived", (BACKWARD, 2), []),
        ("arrived", (BACKWARD, 1), [ArmAllReduce(False), Compute(BACKWARD, 1)]),
        ("computed", (BACKWARD, 1), sent(INPUT_GRADIENT, 1) + [ArmAllReduce(True), Compute(BACKWARD, 2)]),
        ("computed", (BACKWARD, 2), sent(INPUT_GRADIENT, 2) + END),
        ("all_reduced", (), [Done()]),
    ])


def test_1f1b_last_stage_takes_each_loss_against_its_target_and_starts_the_backward_from_it():
    play(machine("1f1b", 2, 3, 2), [  # F0 B0 F1 B1
        ("started", (), [START, Await(FORWARD, 0)]),
        ("arrived", (FORWARD, 0), [Compute(FORWARD, 0)]),
        ("computed", (FORWARD, 0), [Await(TARGET, 0)]),
        ("arrived", (TARGET, 0), [ComputeLoss(0)]),
        ("computed", (LOSS, 0), sent(LOSS, 0) + [ArmAllReduce(False), Compute(BACKWARD, 0)]),
        ("arrived", (FORWARD, 1), []),
        ("arrived", (TARGET, 1), []),
        ("computed", (BACKWARD, 0), sent(INPUT_GRADIENT, 0) + [Compute(FORWARD, 1)]),
        ("computed", (FORWARD, 1), [ComputeLoss(1)]),
        ("computed", (LOSS, 1), sent(LOSS, 1) + [ArmAllReduce(True), Compute(BACKWARD, 1)]),
        ("computed", (BACKWARD, 1), sent(INPUT_GRADIENT, 1) + END),
        ("all_reduced", (), [Done()]),
    ])


def test_zb_h1_splits_each_backward_into_b_then_a_weight_gradient_that_waits_for_nothing():
    play(machine("zb-h1", 0, 2, 2), [  # F0 F1 B0 W0 B1 W1
        ("started", (), [START, Await(FORWARD, 0)]),
        ("arrived", (FORWARD, 0), [Compute(FORWARD, 0)]),
        ("arrived", (FORWARD, 1), []),
        ("computed", (FORWARD, 0), sent(ACTIVATION, 0) + [Compute(FORWARD, 1)]),
        ("computed", (FORWARD, 1), sent(ACTIVATION, 1) + [Await(BACKWARD, 0)]),
        ("arrived", (BACKWARD, 0), [Compute(BACKWARD, 0)]),  # B arms nothing: its W does
        ("computed", (BACKWARD, 0), [Send(RESIDUAL_GRADIENTS, 0), ArmAllReduce(False), Compute(WEIGHT, 0)]),
        ("computed", (WEIGHT, 0), [Await(BACKWARD, 1)]),
        ("arrived", (BACKWARD, 1), [Compute(BACKWARD, 1)]),
        ("computed", (BACKWARD, 1), [Send(RESIDUAL_GRADIENTS, 1), ArmAllReduce(True), Compute(WEIGHT, 1)]),
        ("computed", (WEIGHT, 1), END),
        ("all_reduced", (), [Done()]),
    ])


def test_interleaved_runs_a_virtual_stage_its_share_of_its_devices_order():
    """4 stages on 2 devices: stage 2 shares device 0 with stage 0 and runs F0 F1 B0 B1 of its own."""
    play(machine("interleaved", 2, 4, 2, virtual_stages=2), [
        ("started", (), [START, Await(FORWARD, 0)]),
        ("arrived", (FORWARD, 1), []),
        ("arrived", (FORWARD, 0), [Compute(FORWARD, 0)]),
        ("computed", (FORWARD, 0), sent(ACTIVATION, 0) + [Compute(FORWARD, 1)]),
        ("computed", (FORWARD, 1), sent(ACTIVATION, 1) + [Await(BACKWARD, 0)]),
        ("arrived", (BACKWARD, 1), []),
        ("arrived", (BACKWARD, 0), [ArmAllReduce(False), Compute(BACKWARD, 0)]),
        ("computed", (BACKWARD, 0), sent(INPUT_GRADIENT, 0) + [ArmAllReduce(True), Compute(BACKWARD, 1)]),
        ("computed", (BACKWARD, 1), sent(INPUT_GRADIENT, 1) + END),
        ("all_reduced", (), [Done()]),
    ])


def test_items_that_come_before_the_run_starts_wait_for_it():
    step = machine("gpipe", 1, 3, 1)
    play(step, [
        ("arrived", (BACKWARD, 0), []),
        ("arrived", (FORWARD, 0), []),
        ("started", (), [START, Compute(FORWARD, 0)]),
        ("computed", (FORWARD, 0), sent(ACTIVATION, 0) + [ArmAllReduce(True), Compute(BACKWARD, 0)]),
    ])


def test_a_backward_that_fails_mid_step_ends_it_and_nothing_more_runs():
    step = machine("1f1b", 1, 3, 2)  # F0 F1 B0 B1
    failure = RuntimeError("backward of micro-batch 0 failed")
    play(step, [
        ("started", (), [START, Await(FORWARD, 0)]),
        ("arrived", (FORWARD, 0), [Compute(FORWARD, 0)]),
        ("arrived", (FORWARD, 1), []),
        ("computed", (FORWARD, 0), sent(ACTIVATION, 0) + [Compute(FORWARD, 1)]),
        ("computed", (FORWARD, 1), sent(ACTIVATION, 1) + [Await(BACKWARD, 0)]),
        ("arrived", (BACKWARD, 1), []),
        ("arrived", (BACKWARD, 0), [ArmAllReduce(False), Compute(BACKWARD, 0)]),
        ("failed", (failure,), [DropWaiting(), Report(failure)]),
        ("computed", (BACKWARD, 0), []),  # nothing is sent, and B1, whose gradient waits, never runs
        ("failed", (RuntimeError("again"),), []),
        ("deadline_passed", (5.0,), []),
    ])
    with pytest.raises(errors.InvalidArgument, match="a second backward item"):
        step.arrived(BACKWARD, 1)


def test_a_step_that_ends_elsewhere_mid_step_drops_what_waits_and_runs_nothing_more():
    """A link the step needs ended (or another stage failed it): the run hears it as an abort."""
    step = machine("gpipe", 1, 3, 2)  # F0 F1 B0 B1
    effects = step.started() + step.arrived(FORWARD, 0)
    assert effects == [START, Await(FORWARD, 0), Compute(FORWARD, 0)]
    drop, report = step.aborted("the link to stage 2 ended")
    assert drop == DropWaiting() and isinstance(report.error, errors.Cancelled)
    assert str(report.error) == "the link to stage 2 ended"
    play(step, [
        ("computed", (FORWARD, 0), []),
        ("arrived", (FORWARD, 1), []),
        ("aborted", ("again",), []),
    ])


def test_an_all_reduce_that_fails_after_the_last_action_fails_the_step():
    step = machine("gpipe", 2, 3, 1)  # F0 B0
    failure = RuntimeError("the other replica did not answer")
    play(step, [
        ("arrived", (TARGET, 0), []),
        ("arrived", (FORWARD, 0), []),
        ("started", (), [START, Compute(FORWARD, 0)]),
        ("computed", (FORWARD, 0), [ComputeLoss(0)]),
        ("computed", (LOSS, 0), sent(LOSS, 0) + [ArmAllReduce(True), Compute(BACKWARD, 0)]),
        ("computed", (BACKWARD, 0), sent(INPUT_GRADIENT, 0) + END),
        ("failed", (failure,), [DropWaiting(), Report(failure)]),
        ("all_reduced", (), []),
    ])


def test_an_item_that_does_not_come_by_its_deadline_fails_the_step_naming_it():
    step = machine("1f1b", 1, 3, 1)
    assert step.deadline_passed(5.0) == []  # nothing awaited yet
    assert step.started() == [START, Await(FORWARD, 0)]
    drop, report = step.deadline_passed(2.5)
    assert drop == DropWaiting() and isinstance(report.error, errors.DeadlineExceeded)
    assert str(report.error) == "the forward of step 7 micro-batch 0 did not arrive within 2.5 s"
    assert step.arrived(FORWARD, 0) == []


def test_items_outside_the_plan_or_twice_are_refused_and_change_nothing():
    step = machine("gpipe", 1, 3, 2)
    with pytest.raises(errors.InvalidArgument, match="step 7 is planned over 2 micro-batches; got a forward item "
                                                     "for micro-batch 2"):
        step.arrived(FORWARD, 2)
    with pytest.raises(errors.InvalidArgument, match="items are"):
        step.arrived("residual", 0)
    assert step.started() == [START, Await(FORWARD, 0)]
    assert step.arrived(FORWARD, 0) == [Compute(FORWARD, 0)]
    with pytest.raises(errors.InvalidArgument, match="a second forward item for step 7 micro-batch 0"):
        step.arrived(FORWARD, 0)
    with pytest.raises(errors.InternalError, match="weight of micro-batch 0 finished"):
        step.computed(WEIGHT, 0)
    assert step.computed(FORWARD, 0) == sent(ACTIVATION, 0) + [Await(FORWARD, 1)]


def test_the_machine_loads_no_grpc_asyncio_or_torch():
    code = ("import sys, shard_service.step_machine; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'asyncio', 'torch', 'socket')))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", f"importing the step machine loaded {loaded.stdout.strip()}"
