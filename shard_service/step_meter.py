"""Per optimizer step on a stage, for metrics: its time from its first training forward here to the step applied,
and the samples (rows of the stage's input) its forwards took, over every micro-batch and accumulated step."""

from __future__ import annotations

import time

import torch

from shardtrain import metrics


class StepMeter:
    """Counts training forwards until an optimizer step is applied, then records the step (metrics.step)."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._samples = 0

    def forward(self, x: torch.Tensor | None, seconds: float) -> None:
        """A training forward of one micro-batch ran on `x` (None for a stage without a main input: no rows) and
        ended just now, after `seconds`."""
        if not metrics.enabled():
            return
        if self._started is None:
            self._started = time.perf_counter() - seconds
        if isinstance(x, torch.Tensor) and x.dim():
            self._samples += x.shape[0]

    def stepped(self) -> None:
        """The optimizer step of the forwards counted so far was applied here."""
        if self._started is not None:
            metrics.step(time.perf_counter() - self._started, self._samples)
        self.clear()

    def clear(self) -> None:
        """Forgets the forwards counted so far: their step was refused, or the stage is a new deployment's."""
        self._started, self._samples = None, 0
