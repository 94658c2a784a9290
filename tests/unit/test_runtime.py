"""shard_service.runtime: a deployment's order across modes and its planned steps, driven by written-out event
sequences, each event's answer compared exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shard_service.runtime import MAX_RUNS, DeploymentRuntime, Ready, Wait
from shard_service.step_machine import (ACTIVATION, BACKWARD, FORWARD, INPUT_GRADIENT, OUTPUT, RESIDUAL_GRADIENTS,
                                        RESIDUALS, Await, Compute, ConnectAllReduce, DropWaiting, Report, Send)
from shardtrain import errors

ROOT = Path(__file__).resolve().parents[2]


def test_a_forward_waits_for_the_optimizer_step_it_follows_and_no_longer():
    runtime = DeploymentRuntime("d")
    assert runtime.after_optimizer_step(0) is None  # the first step follows none
    wait = runtime.after_optimizer_step(2)
    assert wait == Wait(1, "optimizer step 2")
    assert runtime.optimizer_step_settled(1) == []
    assert runtime.optimizer_step_settled(2) == [Ready(1)]
    assert runtime.optimizer_step_settled(2) == []  # answered once
    assert runtime.after_optimizer_step(2) is None and runtime.after_optimizer_step(1) is None


def test_a_step_that_comes_before_its_backward_waits_for_it_then_applies():
    runtime = DeploymentRuntime("d")
    wait = runtime.after_backwards([0])
    assert wait == Wait(1, "backward of steps [0]")
    assert runtime.optimizer_step_settled(1) == []  # another event does not wake it
    assert runtime.backward_finished(0, "") == [Ready(1)]
    assert runtime.backward_failures([0]) == {}


def test_a_step_after_a_failed_backward_is_refused_naming_why():
    runtime = DeploymentRuntime("d")
    assert runtime.backward_finished(3, "stage 2: out of memory") == []
    assert runtime.after_backwards([3]) is None
    assert runtime.backward_failures([3]) == {3: "stage 2: out of memory"}


def test_a_link_that_ends_mid_step_fails_the_backwards_that_would_have_come_on_it():
    runtime = DeploymentRuntime("d")
    wait = runtime.after_backwards([4, 5])
    assert runtime.backward_finished(4, "") == []  # 5 has no outcome yet
    assert runtime.backwards_lost(5, "the link to stage 2 broke") == [Ready(wait.id)]
    assert runtime.backward_failures([4, 5]) == {5: "the link to stage 2 broke"}
    assert runtime.backwards_lost(3, "an older break") == []  # a lower bound changes nothing
    assert runtime.backward_finished(6, "") == [] and runtime.backward_failures([6]) == {}  # after the break


def test_waits_are_answered_once_each_in_the_order_they_were_made():
    runtime = DeploymentRuntime("d")
    first, second, third = (runtime.after_optimizer_step(1), runtime.after_backwards([0]),
                            runtime.after_optimizer_step(2))
    assert runtime.backward_finished(0) == [Ready(second.id)]
    assert runtime.optimizer_step_settled(2) == [Ready(first.id), Ready(third.id)]


def test_a_deadline_drops_its_wait_and_names_what_did_not_happen():
    runtime = DeploymentRuntime("d")
    wait = runtime.after_optimizer_step(3)
    error = runtime.deadline_passed(wait, 2.5)
    assert isinstance(error, errors.DeadlineExceeded)
    assert str(error) == "optimizer step 3 did not happen within 2.5 s"
    assert runtime.optimizer_step_settled(3) == []  # nobody waits any more
    gone = runtime.after_backwards([1])
    runtime.gave_up(gone)
    assert runtime.backward_finished(1) == []


def test_a_planned_step_starts_its_machine_and_counts_up():
    runtime = DeploymentRuntime("d")
    step = runtime.start_step(2, "1f1b", 2, stage=1, num_stages=3, virtual_stages=1)
    assert runtime.step_machine(2) is step and runtime.forwarded == 2
    assert step.started() == [ConnectAllReduce(), Await(FORWARD, 0)]
    assert step.arrived(FORWARD, 0) == [Compute(FORWARD, 0)]
    assert step.computed(FORWARD, 0) == [Send(ACTIVATION, 0), Send(RESIDUALS, 0), Await(FORWARD, 1)]
    with pytest.raises(errors.InvalidArgument, match="step 2 comes after step 2 on this stage: steps count up"):
        runtime.start_step(2, "1f1b", 2, stage=1, num_stages=3, virtual_stages=1)
    runtime.forward_started(5)  # a forward of the loop
    with pytest.raises(errors.InvalidArgument, match="step 4 comes after step 5"):
        runtime.start_step(4, "gpipe", 2, stage=1, num_stages=3, virtual_stages=1)


def test_a_plan_out_of_bounds_is_refused_before_anything_starts():
    runtime = DeploymentRuntime("d")
    with pytest.raises(errors.InvalidArgument, match="unknown schedule 'pipedream'; expected one of"):
        runtime.start_step(0, "pipedream", 2, stage=0, num_stages=2, virtual_stages=1)
    with pytest.raises(errors.InvalidArgument, match="1 to .* micro-batches, got 0"):
        runtime.start_step(0, "gpipe", 0, stage=0, num_stages=2, virtual_stages=1)
    assert runtime.forwarded == -1 and runtime.step_machine(0) is None


def test_at_most_max_runs_steps_at_once_until_the_optimizer_step_forgets_them():
    runtime = DeploymentRuntime("d")
    machines = [runtime.start_step(step, "gpipe", 1, stage=0, num_stages=2, virtual_stages=1)
                for step in range(MAX_RUNS)]
    machines[0].started()
    # A step that failed here still holds its place until its optimizer step has settled and forgotten it.
    effects = machines[0].failed(errors.Cancelled("stage 1 failed"))
    assert [type(effect) for effect in effects] == [DropWaiting, Report] and machines[0].ended
    with pytest.raises(errors.ResourceExhausted, match=f"{MAX_RUNS} planned steps already run here"):
        runtime.start_step(MAX_RUNS, "gpipe", 1, stage=0, num_stages=2, virtual_stages=1)
    runtime.backward_finished(0, "stage 1 failed")
    runtime.forget(0)
    assert runtime.step_machine(0) is None and runtime.after_backwards([0]) is not None  # its outcome went too
    assert runtime.start_step(MAX_RUNS, "gpipe", 1, stage=0, num_stages=2, virtual_stages=1).step == MAX_RUNS


def test_a_step_that_finished_frees_its_place_at_once():
    runtime = DeploymentRuntime("d")
    machines = [runtime.start_step(step, "gpipe", 1, stage=0, num_stages=1, virtual_stages=1)
                for step in range(MAX_RUNS)]
    only = machines[0]  # one stage, one micro-batch: forward, its loss, backward, all-reduce
    only.started()
    only.arrived(FORWARD, 0)
    only.computed(FORWARD, 0)
    only.arrived("target", 0)
    only.computed("loss", 0)
    only.computed(BACKWARD, 0)
    only.all_reduced()
    assert only.finished
    assert runtime.start_step(MAX_RUNS, "gpipe", 1, stage=0, num_stages=1, virtual_stages=1).step == MAX_RUNS


def test_the_runtime_loads_no_grpc_asyncio_or_torch():
    code = ("import sys, shard_service.runtime; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'asyncio', 'torch', 'socket')))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", f"importing the runtime loaded {loaded.stdout.strip()}"


def test_a_replicated_step_ends_here_once_the_stages_after_finished_it_the_first_word_counting():
    runtime = DeploymentRuntime("d")
    runtime.start_step(0, "1f1b", 2, stage=0, num_stages=2, virtual_stages=1)
    wait = runtime.after_stages_after(0)
    assert wait == Wait(1, "the stages after this one finishing step 0")
    assert runtime.stages_after_finished(0, "") == [Ready(1)]
    assert runtime.stages_after_finished(0, "stage 1: too late") == []  # the first word counts
    assert runtime.after_stages_after(0) is None and runtime.stages_after_outcome(0) == ""


def test_a_link_to_the_next_stage_that_ends_mid_step_fails_the_steps_under_way_and_no_later_one():
    runtime = DeploymentRuntime("d")
    for step in (3, 4):
        runtime.start_step(step, "gpipe", 2, stage=0, num_stages=2, virtual_stages=1)
    runtime.stages_after_finished(3, "")
    wait = runtime.after_stages_after(4)
    assert runtime.next_link_broke("the link to stage 1 broke") == [Ready(wait.id)]
    assert runtime.stages_after_outcome(3) == "" and runtime.stages_after_outcome(4) == "the link to stage 1 broke"
    runtime.start_step(5, "gpipe", 2, stage=0, num_stages=2, virtual_stages=1)  # sent on a new link
    assert runtime.after_stages_after(5) is not None
    runtime.forget(4)
    assert runtime.after_stages_after(4) is not None  # forgotten with its step


def test_what_the_deployment_marked_of_its_steps_goes_with_them_and_a_verdict_counts_once():
    runtime = DeploymentRuntime("d")
    runtime.by_call.add(3)
    runtime.unread.add(2)
    runtime.ended_by_step.update({1, 4})
    runtime.forget(3)
    assert (runtime.by_call, runtime.unread, runtime.ended_by_step) == (set(), set(), {4})
    assert runtime.verdicts.take(1) and not runtime.verdicts.take(1)
    assert DeploymentRuntime("e").verdicts.take(1)  # a new deployment starts with none taken


def test_a_loop_item_is_a_one_action_schedule_then_its_sends_in_the_order_the_stages_after_need_them():
    runtime = DeploymentRuntime("d")
    # The activation first: the next stage needs it now, a residual's consumer only later.
    assert runtime.loop_forward(3, last=False) == [Compute(FORWARD, 3), Send(ACTIVATION, 3), Send(RESIDUALS, 3)]
    # The last stage: the model's other outputs go ahead of the output, which the SDK takes as the step's end.
    assert runtime.loop_forward(0, last=True) == [Compute(FORWARD, 0), Send(RESIDUALS, 0), Send(OUTPUT, 0)]
    assert runtime.loop_backward(2) == [Compute(BACKWARD, 2), Send(INPUT_GRADIENT, 2), Send(RESIDUAL_GRADIENTS, 2)]
