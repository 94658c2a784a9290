"""The state a script's calls into a deployment move through (docs/architecture.md, "Call orders"): step numbers,
forwards awaiting their backward, and the backwards and optimizer steps sent but not yet settled."""

from __future__ import annotations

import itertools

from client_sdk.inflight import InFlight
from shardtrain.errors import FailedPrecondition

MAX_AWAITING = 64  # forwards whose backward may still come: as many steps as a shard keeps in flight


class CallOrder:
    """One deployment's call-order state, shared by the loop and train_step; it sends nothing itself. A handle that
    takes over a redeployment takes the new deployment's, fresh, with it."""

    def __init__(self) -> None:
        self.steps = itertools.count()
        self.last_step = -1
        self.optimizer_steps = 0
        self.settle_before_forward = 0  # the last optimizer step sent, which the next forward must follow
        self.backward_steps: list[int] = []
        self.zero_grad_pending = False
        self.awaiting_backward: list[int] = []  # forwards under autograd whose backward has not been sent
        self.stale: dict[int, str] = {}  # forwards a backward may no longer run for, and why
        self.has_gradients = False  # some backward was sent since the last zero_grad
        self.async_steps: list[int] = []  # aforward steps whose abackward has not come
        self.inflight = InFlight(on_failure=self.abandon_deferred_work)

    def next_step(self) -> int:
        """Numbers the next forward (or planned step)."""
        self.last_step = next(self.steps)
        return self.last_step

    def take_zero_grad(self) -> bool:
        """Whether a zero_grad is pending: the item about to be sent carries it, so it no longer is."""
        zero_grad, self.zero_grad_pending = self.zero_grad_pending, False
        return zero_grad

    def await_backward(self, step: int) -> None:
        """Records a forward under autograd; beyond MAX_AWAITING, the oldest one's graph is given up, as the
        shards give it up (they keep as many steps in flight)."""
        self.awaiting_backward.append(step)
        if len(self.awaiting_backward) > MAX_AWAITING:
            self.outdate(self.awaiting_backward.pop(0), f"more than {MAX_AWAITING} later forwards ran before its "
                                                        "backward, and the shards keep no more graphs than that")

    def check_backward(self, step: int) -> None:
        """FailedPrecondition, at once, for a backward that no shard could run: PyTorch refuses these too."""
        if step in self.stale:
            raise FailedPrecondition(f"step {step}'s output cannot be backpropagated: {self.stale.pop(step)}")
        if step not in self.awaiting_backward:
            raise FailedPrecondition(f"step {step}'s output was already backpropagated, or never ran under autograd: "
                                     "the shards free a forward's graph at its backward (retain_graph is not kept "
                                     "across the wire); run the forward again for another backward")
        self.awaiting_backward.remove(step)

    def outdate_awaiting_backward(self) -> None:
        """An optimizer step changes the weights that every graph still awaiting its backward holds."""
        for step in self.awaiting_backward:
            self.outdate(step, "an optimizer step changed the weights its graph holds since (PyTorch raises the "
                               "same: a variable needed for gradient computation has been modified by an inplace "
                               "operation); run the forward again")
        self.awaiting_backward.clear()

    def outdate(self, step: int, why: str) -> None:
        """Step `step`'s backward may no longer run, for the reason `why` (the latest MAX_AWAITING are kept)."""
        self.stale[step] = why
        while len(self.stale) > MAX_AWAITING:
            self.stale.pop(next(iter(self.stale)))

    def abandon_deferred_work(self) -> None:
        """After a failure every call in flight was cancelled: no step is owed, none may be waited for."""
        self.settle_before_forward = 0
        self.backward_steps.clear()
