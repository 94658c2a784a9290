"""How many intra-op threads each kind of stage work gets: one, or all the shard has, whichever runs it faster.

Small work runs faster on one thread: waking OpenMP workers costs more than they save, all the more
when shards share a host's cores. Big work runs faster on all of them. Measured on the 2-core
development machine with the loop of bench/train_step.py (seed model, 3 local shards, 400 steps):
at batch 32, shards started with SHARDTRAIN_THREADS=1 stepped in 17.0-19.4 ms against 19.9-21.2 ms
with torch's default of two (three alternating runs); in one process (`python -m bench.train_step`),
batch 1024 takes 67 ms on one thread and 46 ms on two. So each shard measures instead of
guessing: the first calls of each kind alternate between the two counts, the faster median wins,
and every RETUNE calls it measures again. A kind is the work's name and its tensors' size to a
power of two: a forward of batch 1024 is not tuned on what a forward of batch 32 taught. Keyed by
name alone, the choice a small batch made held for a large one until the next retune; with the
size in the kind, `python -m bench.train_step --batches 32 256 1024` timed the batch-1024 loop at
75.7 ms (1.43x one process) against 87.6 ms (1.66x) in the run before (one run each).

What is timed is the work alone, from its fourth call on. Timed with the hand-off to the compute
thread counted in, and from the first calls (which allocate an optimizer's state), the shards' Adam
trials at batch 32 took 3.9-13 ms where a warm Adam of one stage takes about 1 ms, and two of three
shards chose two threads for it; for the whole seed model, one process's Adam takes 2.4 ms on one
thread and 3.8 ms on two. Now they choose one. Two threads must also beat one by a tenth: the core
they take is the other shards' too.
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
