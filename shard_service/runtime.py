"""One deployment on one shard as a plain object: it takes the deployment's events (a backward ended, an optimizer
step settled, a link that brought backwards broke, a deadline passed) and answers what may run now, as data. No
I/O, no asyncio, no torch: unit tests drive it with written-out event sequences.

It keeps what the deployment decided about its steps: the verdicts taken and passed down (verdicts.py), which
steps a per-call RPC started, whose data rows could not be read, whose backwards end with an optimizer step.
It decides the order of the client's work in every mode: a forward runs once the optimizer step it follows has
settled here; an optimizer step waits until every backward it follows has an outcome here, and is refused if one
failed; backwards whose link broke count as failed. With replicas, a planned step ends here once the stages after
this one finished it too (or the link to them broke). A planned step's own actions are its machine's
(step_machine.py); the deployment starts one per step, refuses a step that does not count up or one too many at
once, and drops them with the step. A new deployment is a new object: nothing is reset by hand.

Its adapters perform what it answers: ordering.py parks a caller on a future until its Wait is Ready (or its
deadline passes), planned_run.py performs a step machine's effects, executor.py runs the computations."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shard_service.step_machine import (ACTIVATION, BACKWARD, FORWARD, INPUT_GRADIENT, OUTPUT, RESIDUAL_GRADIENTS,
                                        RESIDUALS, Compute, Send, StepMachine)
from shard_service.verdicts import Verdicts
from shardtrain import errors, schedule

MAX_RUNS = 4  # planned steps a stage holds at once: the SDK runs one at a time; a few more while one settles


@dataclass(frozen=True)
class Wait:
    """What a caller asked for has not happened yet: park it until a Ready with this id (or its deadline)."""

    id: int
    what: str


@dataclass(frozen=True)
class Ready:
    """The condition of Wait `id` holds now: wake its caller."""

    id: int


@dataclass
class DeploymentRuntime:
    """What one deployment has settled on this shard, what waits for it, and its planned steps' machines."""

    deployment_id: str = ""
    optimizer_steps: int = 0  # the highest optimizer step settled here (applied or refused)
    forwarded: int = -1  # the highest step this stage started a forward for (steps count from 0)
    _backwards: dict[int, str] = field(default_factory=dict)  # step -> "" if its backward succeeded here, else why
    _lost: tuple[int, str] = (-1, "")  # backwards without an outcome up to this step never come, and why
    _waits: dict[int, Callable[[], bool]] = field(default_factory=dict)  # wait id -> the condition it waits for
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _machines: dict[int, StepMachine] = field(default_factory=dict)
    _after: dict[int, str] = field(default_factory=dict)  # replicated: step -> "" once the stages after this one
                                                          # finished it, else why they failed it
    verdicts: Verdicts = field(default_factory=Verdicts)  # the optimizer steps' verdicts taken and passed down
    by_call: set[int] = field(default_factory=set)  # steps a per-call RPC started: their results wait for FetchTensor
    unread: set[int] = field(default_factory=set)  # steps whose data rows could not be read here: their items drop
    ended_by_step: set[int] = field(default_factory=set)  # first stage: backwards whose end an optimizer step reports

    # --- what may wait ------------------------------------------------------------------------------
    def after_optimizer_step(self, number: int) -> Wait | None:
        """None if optimizer step `number` has settled here (0 always has), else a Wait for it."""
        return self._wait(lambda: self.optimizer_steps >= number, f"optimizer step {number}")

    def after_backwards(self, steps: Iterable[int]) -> Wait | None:
        """None if every listed step's backward has an outcome here, else a Wait for them (backward_failures then
        says which failed)."""
        steps = list(steps)
        return self._wait(lambda: all(self._outcome(step) is not None for step in steps), f"backward of steps {steps}")

    def after_stages_after(self, step: int) -> Wait | None:
        """Replicated, before a step's end here: None once the stages after this one finished planned step `step`
        or failed it (stages_after_outcome says which), else a Wait for them."""
        return self._wait(lambda: step in self._after, f"the stages after this one finishing step {step}")

    def stages_after_outcome(self, step: int) -> str:
        """"" if the stages after this one finished planned step `step`, else why they failed it."""
        return self._after[step]

    def backward_failures(self, steps: Iterable[int]) -> dict[int, str]:
        """The listed steps whose backward failed here (or never comes), with why."""
        return {step: self._outcome(step) for step in steps if self._outcome(step)}

    def deadline_passed(self, wait: Wait, seconds: float) -> errors.DeadlineExceeded:
        """Wait `wait` ended unmet after `seconds`: it is dropped, and this is the error its caller raises."""
        self._waits.pop(wait.id, None)
        return errors.DeadlineExceeded(f"{wait.what} did not happen within {seconds:g} s")

    def gave_up(self, wait: Wait) -> None:
        """The caller of `wait` stopped waiting (its work was cancelled)."""
        self._waits.pop(wait.id, None)

    # --- events -------------------------------------------------------------------------------------
    def optimizer_step_settled(self, number: int) -> list[Ready]:
        """Optimizer step `number` is over here, applied or refused."""
        self.optimizer_steps = max(self.optimizer_steps, number)
        return self._ready()

    def backward_finished(self, step: int, failure: str = "") -> list[Ready]:
        """Step `step`'s backward ended here: "" for success, else why it failed."""
        self._backwards[step] = failure
        return self._ready()

    def backwards_lost(self, up_to_step: int, reason: str) -> list[Ready]:
        """The backwards of steps up to `up_to_step` that have no outcome yet will not come (the link that brings
        them broke): they count as failed for `reason`."""
        if up_to_step <= self._lost[0]:
            return []
        self._lost = (up_to_step, reason)
        return self._ready()

    def stages_after_finished(self, step: int, failure: str = "") -> list[Ready]:
        """The stages after this one finished planned step `step` ("") or failed it (why); the first word counts."""
        if step in self._after:
            return []
        self._after[step] = failure
        return self._ready()

    def next_link_broke(self, reason: str) -> list[Ready]:
        """The link to the next stage broke: the planned steps under way here hear no more from the stages after."""
        for step in self._machines:
            if step <= self.forwarded and step not in self._after:
                self._after[step] = reason
        return self._ready()

    def forward_started(self, step: int) -> None:
        """A forward of the loop started for `step`."""
        self.forwarded = max(self.forwarded, step)

    def forget(self, up_to_step: int) -> None:
        """Drops what is kept of steps up to `up_to_step`: outcomes, machines and the steps' marks."""
        for kept in (self._backwards, self._machines, self._after):
            for step in [step for step in kept if step <= up_to_step]:
                del kept[step]
        for marked in (self.by_call, self.unread, self.ended_by_step):
            marked.difference_update([step for step in marked if step <= up_to_step])

    # --- the loop's items ----------------------------------------------------------------------------
    def loop_forward(self, microbatch: int, last: bool) -> list:
        """A forward item of the PyTorch-shaped loop: the one action of a one-micro-batch schedule, arrived as the
        script called, then what it sends. The activation goes first, as the next stage needs it now and a
        residual's consumer only later; from the `last` stage the model's other outputs go ahead of the output,
        which the SDK takes as the step's end. (It runs once after_optimizer_step allows.)"""
        sends = [Send(RESIDUALS, microbatch), Send(OUTPUT, microbatch)] if last else \
            [Send(ACTIVATION, microbatch), Send(RESIDUALS, microbatch)]
        return [Compute(FORWARD, microbatch)] + sends

    def loop_backward(self, microbatch: int) -> list:
        """A backward item of the loop: its computation, then the input gradient (first: the stage before needs it
        now, while a residual's producer is that stage or one before it; from the first stage it tells the SDK
        the backward ended) and the residuals' gradients. Its outcome is then backward_finished."""
        return [Compute(BACKWARD, microbatch), Send(INPUT_GRADIENT, microbatch),
                Send(RESIDUAL_GRADIENTS, microbatch)]

    # --- planned steps ------------------------------------------------------------------------------
    def start_step(self, step: int, plan_schedule: str, microbatches: int, stage: int, num_stages: int,
                   virtual_stages: int) -> StepMachine:
        """The machine of planned step `step` on this stage, which starts it: InvalidArgument for an unknown
        schedule, a micro-batch count out of bounds or a step that does not count up; ResourceExhausted with
        MAX_RUNS steps already under way."""
        check_plan(plan_schedule, microbatches)
        if step <= self.forwarded:
            raise errors.InvalidArgument(f"step {step} comes after step {self.forwarded} on this stage: steps count up")
        if sum(not machine.finished for machine in self._machines.values()) >= MAX_RUNS:
            raise errors.ResourceExhausted(f"{MAX_RUNS} planned steps already run here; a step waits for an "
                                           "optimizer step that has not come")
        per_device = virtual_stages if plan_schedule in schedule.INTERLEAVED else 1  # others: stage by stage
        actions = schedule.stage_actions(plan_schedule, stage, num_stages, microbatches, per_device)
        machine = StepMachine(step, actions, microbatches, first=stage == 0, last=stage == num_stages - 1,
                              split=plan_schedule in schedule.SPLIT_BACKWARD)
        self._machines[step] = machine
        self.forwarded = step
        return machine

    def step_machine(self, step: int) -> StepMachine | None:
        """The machine of planned step `step`, while it is held here."""
        return self._machines.get(step)

    # --- inside -------------------------------------------------------------------------------------
    def _wait(self, holds: Callable[[], bool], what: str) -> Wait | None:
        if holds():
            return None  # the usual case
        wait = Wait(next(self._ids), what)
        self._waits[wait.id] = holds
        return wait

    def _ready(self) -> list[Ready]:
        """The waits whose condition holds now, each answered once."""
        ready = [wait_id for wait_id, holds in self._waits.items() if holds()]
        for wait_id in ready:
            del self._waits[wait_id]
        return [Ready(wait_id) for wait_id in ready]

    def _outcome(self, step: int) -> str | None:
        if step in self._backwards:
            return self._backwards[step]
        return self._lost[1] if step <= self._lost[0] else None


def check_plan(plan_schedule: str, microbatches: int) -> None:
    """InvalidArgument unless the plan names a known schedule and a micro-batch count within bounds."""
    if plan_schedule not in schedule.SCHEDULES:
        raise errors.InvalidArgument(f"unknown schedule {plan_schedule!r}; expected one of {schedule.SCHEDULES}")
    if not 1 <= microbatches <= schedule.MAX_MICROBATCHES:
        raise errors.InvalidArgument(f"a planned step has 1 to {schedule.MAX_MICROBATCHES} micro-batches, "
                                     f"got {microbatches}")
