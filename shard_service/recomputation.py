"""A stage's activation recomputation: what a micro-batch that kept only its inputs needs to run its forward again
in backward (Replay, with the random state its dropout drew from), and runs of layers named for recomputation run
under torch.utils.checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from shardtrain.residuals import Wiring, run_chain


@dataclass
class Replay:
    """What recomputing a micro-batch's forward in its backward needs beyond its inputs: the layers it ran, the
    random state its dropout drew from, and the loss attached to its output, if any."""

    layers: list
    input: torch.Tensor
    random_state: tuple
    output: torch.Tensor | None = None  # as forward returned them (no graph), for the loss's value
    outgoing: dict[str, torch.Tensor] | None = None
    loss: tuple | None = None  # attach_loss's arguments, applied again to the recomputed output


def random_state(device: torch.device) -> tuple:
    """The random state a forward on `device` draws from (dropout's masks), to draw the same again."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def replaying(device: torch.device, state: tuple):
    """Draws from `state` inside, and leaves torch's random streams as they were after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if device.type == "cuda":
            torch.cuda.set_rng_state(state[1], device)
        yield


def segments(flags: Sequence[bool]) -> list[tuple[int, int, bool]]:
    """(start, end, recomputed) of each run of consecutive layers that share a flag."""
    runs: list[tuple[int, int, bool]] = []
    for index, flag in enumerate(flags):
        if runs and runs[-1][2] == flag:
            runs[-1] = (runs[-1][0], index + 1, flag)
        else:
            runs.append((index, index + 1, flag))
    return runs


def run_segments(layers: Sequence[torch.nn.Module], wirings: Sequence[Wiring], runs: list[tuple[int, int, bool]],
                 x: torch.Tensor, saved: dict[str, torch.Tensor],
                 paused: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
    """run_chain, each recomputed run of layers under one non-reentrant torch.utils.checkpoint: it keeps the run's
    inputs only and runs it again in backward, random state preserved, inside `paused()` (batch norms count the
    first run only)."""
    for start, end, recomputed in runs:
        part, part_wirings = layers[start:end], wirings[start:end]
        if not recomputed:
            x = run_chain(part, part_wirings, x, saved)
            continue
        names, made = list(saved), [name for wiring in part_wirings for name in wiring.out_variables]

        def segment(x, *values, part=part, part_wirings=part_wirings, names=names, made=made):
            local = dict(zip(names, values))
            return (run_chain(part, part_wirings, x, local), *(local[name] for name in made))
        x, *values = torch.utils.checkpoint.checkpoint(segment, x, *(saved[name] for name in names),
                                                       use_reentrant=False,
                                                       context_fn=lambda: (contextlib.nullcontext(), paused()))
        saved.update(zip(made, values))
    return x
