"""How many intra-op threads each kind of stage work gets: one, or all the shard has, whichever runs it faster.

Small work runs faster on one thread (waking OpenMP workers costs more than they save, all the more when
shards share a host's cores); big work runs faster on all of them. So each shard measures instead of
guessing: the first calls of each kind alternate between the two counts, the faster median wins, and
every RETUNE calls it measures again. A kind is the work's name and its tensors' size to a power of two,
so a forward of batch 1024 is not tuned on what a forward of batch 32 taught. Only the work itself is
timed, from its fourth call on (the first calls allocate, an optimizer's state for one), and two threads
must beat one by a tenth: the core they take may be another shard's too. Figures: docs/performance.md.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("shardtrain.shard")

WARMUP = 3     # first calls of a kind, not timed: they allocate (an optimizer's state, caches) and run slow
TRIALS = 4     # calls timed with each count before choosing
RETUNE = 400   # calls after a choice before measuring again
MARGIN = 0.9   # more threads must save a tenth of the time: the cores they take are other shards' too


def work_kind(name: str, arguments: Iterable) -> str:
    """The kind of a piece of work: its name, and the size of its tensor arguments to a power of two."""
    size = sum(argument.numel() for argument in arguments if isinstance(argument, torch.Tensor))
    return f"{name} of under 2^{size.bit_length()} elements" if size else name


@dataclass
class _Kind:
    untimed: int = WARMUP
    samples: dict[int, list[float]] = field(default_factory=dict)
    chosen: int = 0
    since_chosen: int = 0


class ThreadChoice:
    """Per kind of work (a name), the thread count to run it with, learnt from how long it took."""

    def __init__(self, most: int):
        self.most = max(1, most)
        self._kinds: dict[str, _Kind] = {}

    def threads(self, kind: str) -> int:
        """The count to run the next piece of `kind` with."""
        if self.most == 1:
            return 1
        state = self._kinds.setdefault(kind, _Kind())
        if state.chosen:
            return state.chosen
        ones, alls = (len(state.samples.get(n, ())) for n in (1, self.most))
        return 1 if ones <= alls else self.most

    def record(self, kind: str, threads: int, seconds: float) -> None:
        """How long a piece of `kind` took with `threads`."""
        if self.most == 1:
            return
        state = self._kinds.setdefault(kind, _Kind())
        if state.chosen:
            state.since_chosen += 1
            if state.since_chosen >= RETUNE:
                self._kinds[kind] = _Kind(untimed=0)  # warm by now
            return
        if state.untimed:
            state.untimed -= 1
            return
        state.samples.setdefault(threads, []).append(seconds)
        if all(len(state.samples.get(n, ())) >= TRIALS for n in (1, self.most)):
            medians = {n: statistics.median(state.samples[n]) for n in (1, self.most)}
            state.chosen = self.most if medians[self.most] < MARGIN * medians[1] else 1
            level = logging.INFO if max(medians.values()) > 1e-3 else logging.DEBUG
            log.log(level, "%s runs on %d intra-op thread(s): median %.2f ms on 1, %.2f ms on %d", kind, state.chosen,
                     medians[1] * 1e3, medians[self.most] * 1e3, self.most)

    def chosen(self) -> dict[str, int]:
        """The counts chosen so far, by kind (for Describe and tests)."""
        return {kind: state.chosen for kind, state in self._kinds.items() if state.chosen}
