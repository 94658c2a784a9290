"""One stage's planned step as a plain state machine: it takes the step's events (an item arrived, a computation
finished, a deadline passed, the step failed) and returns the effects to perform (compute this, send that, wait for
this item, report a failure), as data. It decides what may run next; planned_run.py performs it on the executor and
the links. No I/O, no asyncio, no tensors: unit tests drive it with written-out event sequences.

Actions run one at a time in the schedule's order: the next starts once the previous one computed and its input
came. Items that come early are remembered until their action's turn; after a failure nothing more runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtrain import errors, schedule

FORWARD, BACKWARD, WEIGHT = schedule.FORWARD, schedule.BACKWARD, schedule.WEIGHT
TARGET = "target"  # the last stage's loss target of a micro-batch, from the SDK
LOSS = "loss"      # the last stage's loss of a micro-batch: computed after its forward, sent to the SDK
ACTIVATION = "activation"
OUTPUT = "output"  # the loop's last stage: a forward's output, to the SDK
RESIDUALS = "residuals"
INPUT_GRADIENT = "input gradient"
RESIDUAL_GRADIENTS = "residual gradients"
ITEMS = (FORWARD, BACKWARD, TARGET)  # what may arrive


@dataclass(frozen=True)
class ConnectAllReduce:
    """Join the replicas' all-reduce of this step's gradients, before any work."""


@dataclass(frozen=True)
class Await:
    """The next action waits for this item; nothing runs until it comes (or its deadline passes)."""

    kind: str
    microbatch: int


@dataclass(frozen=True)
class ArmAllReduce:
    """The weight gradients of the coming backward count toward the all-reduce; `last` for the step's last."""

    last: bool


@dataclass(frozen=True)
class Compute:
    """Run action (op, microbatch) on the stage, with the input that came for it."""

    op: str
    microbatch: int


@dataclass(frozen=True)
class ComputeLoss:
    """The last stage: the loss of the micro-batch's output against its target."""

    microbatch: int


@dataclass(frozen=True)
class Send:
    """Send what the micro-batch's last computation made: ACTIVATION, OUTPUT, LOSS, RESIDUALS, INPUT_GRADIENT or
    RESIDUAL_GRADIENTS."""

    what: str
    microbatch: int


@dataclass(frozen=True)
class FinishAllReduce:
    """Every action ran: finish the all-reduce of the step's gradients (all_reduced() once it is over)."""


@dataclass(frozen=True)
class DropWaiting:
    """The step is over here: drop the items that wait for a turn that will not come."""


@dataclass(frozen=True)
class Report:
    """The step failed here, with `error`."""

    error: Exception


@dataclass(frozen=True)
class Done:
    """The step's work on this stage is over."""


class StepMachine:
    """The actions of one stage in one planned step (schedule.stage_actions), over `microbatches` micro-batches:
    the first stage sends no input gradient, the last computes each micro-batch's loss after its forward."""

    def __init__(self, step: int, actions: list[schedule.Action], microbatches: int, first: bool, last: bool,
                 split: bool):
        self.step, self._actions, self._microbatches = step, actions, microbatches
        self._first, self._last, self._split = first, last, split
        self._final = actions[-1].microbatch if actions else -1  # the backward that ends the step here
        self._next = 0  # the action under way, or the next to start, by index
        self._running = False  # the action at _next was started (its Compute returned)
        self._arrived: set[tuple[str, int]] = set()  # items in and not yet used
        self._seen: set[tuple[str, int]] = set()  # every item that came, to refuse a second
        self._awaiting: tuple[str, int] | None = None  # the item the effects in _then wait for
        self._then: list = []
        self._started = False
        self.ended = False  # the step is over here (done or failed): later events change nothing
        self.finished = False  # every action ran and the all-reduce is over

    # --- events ------------------------------------------------------------------------------------
    def started(self) -> list:
        """The run begins."""
        self._started = True
        return [ConnectAllReduce()] + self._advance()

    def arrived(self, kind: str, microbatch: int) -> list:
        """An item came; InvalidArgument for a micro-batch outside the plan or a second item of one kind."""
        self._check(kind, microbatch)
        self._seen.add((kind, microbatch))
        if self.ended:
            return []
        self._arrived.add((kind, microbatch))
        if self._awaiting != (kind, microbatch):
            return []
        self._awaiting = None
        return self._need((kind, microbatch), self._then)

    def computed(self, op: str, microbatch: int) -> list:
        """A Compute (op FORWARD, BACKWARD or WEIGHT) or ComputeLoss (op LOSS) finished."""
        if self.ended:
            return []
        action = self._actions[self._next] if self._running else None
        if action is None or microbatch != action.microbatch or op not in (action.op, LOSS):
            raise errors.InternalError(f"step {self.step}: {op} of micro-batch {microbatch} finished, but the "
                                       f"action under way is {action}")
        if op == FORWARD and self._last:
            return self._need((TARGET, microbatch), [ComputeLoss(microbatch)])
        self._next, self._running = self._next + 1, False
        return self._sends_after(op, microbatch) + self._advance()

    def all_reduced(self) -> list:
        """The all-reduce after the last action finished: the step's work here is over."""
        if self.ended or self._next < len(self._actions):
            return []
        self.ended = self.finished = True
        return [Done()]

    def failed(self, error: Exception) -> list:
        """Work here failed (a computation, a send, a wait): the step ends here with `error`."""
        if self.ended:
            return []
        self.ended = True
        self._arrived.clear()
        return [DropWaiting(), Report(error)]

    def aborted(self, reason: str) -> list:
        """The step failed on another stage, or a link it needs ended."""
        return self.failed(errors.Cancelled(reason))

    def deadline_passed(self, seconds: float) -> list:
        """The item awaited did not come within `seconds`."""
        if self._awaiting is None:
            return []
        kind, microbatch = self._awaiting
        return self.failed(errors.DeadlineExceeded(
            f"the {kind} of step {self.step} micro-batch {microbatch} did not arrive within {seconds:g} s"))

    # --- decisions ---------------------------------------------------------------------------------
    def _check(self, kind: str, microbatch: int) -> None:
        if kind not in ITEMS:
            raise errors.InvalidArgument(f"a planned step's items are {ITEMS}, got {kind!r}")
        if not 0 <= microbatch < self._microbatches:
            raise errors.InvalidArgument(f"step {self.step} is planned over {self._microbatches} micro-batches; "
                                         f"got a {kind} item for micro-batch {microbatch}")
        if (kind, microbatch) in self._seen:
            raise errors.InvalidArgument(f"a second {kind} item for step {self.step} micro-batch {microbatch}")

    def _advance(self) -> list:
        """The next action's effects, once the one before is over: its input first, then its computation."""
        if not self._started or self.ended or self._running:
            return []
        if self._next == len(self._actions):
            return [FinishAllReduce()]  # a failure there still fails the step
        action, self._running = self._actions[self._next], True
        arm = action.op == WEIGHT or (action.op == BACKWARD and not self._split)
        then = ([ArmAllReduce(action.microbatch == self._final)] if arm else []) + [Compute(*_op(action))]
        return self._need(self._input_of(action), then)

    def _input_of(self, action: schedule.Action) -> tuple[str, int] | None:
        if action.op == FORWARD or (action.op == BACKWARD and not self._last):
            return action.op, action.microbatch
        return None  # the last stage's backward starts from its loss; a weight gradient from its backward

    def _need(self, item: tuple[str, int] | None, then: list) -> list:
        """`then` if `item` is in (and uses it up); else an Await for it, `then` kept for its arrival."""
        if item is None or item in self._arrived:
            self._arrived.discard(item)
            return then
        self._awaiting, self._then = item, then
        return [Await(*item)]

    def _sends_after(self, op: str, microbatch: int) -> list:
        if op == FORWARD:
            return [Send(ACTIVATION, microbatch), Send(RESIDUALS, microbatch)]
        if op == LOSS:
            return [Send(LOSS, microbatch), Send(RESIDUALS, microbatch)]
        if op == BACKWARD:
            gradient = [] if self._first else [Send(INPUT_GRADIENT, microbatch)]
            return gradient + [Send(RESIDUAL_GRADIENTS, microbatch)]
        return []


def _op(action: schedule.Action) -> tuple[str, int]:
    return action.op, action.microbatch
