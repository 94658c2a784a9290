"""Dynamic loss scaling for fp16 (as torch.amp.GradScaler): the backward starts from `scale` instead of 1, so small
gradients survive float16; before each optimizer step the stages' gradient norms say whether any gradient
overflowed. If one did, the step is skipped on every stage and the scale halves; otherwise every gradient is
multiplied by 1 / scale (and by clipping's factor) before the step, and after `growth_interval` such steps in a
row the scale doubles."""

from __future__ import annotations

import math

import torch

from client_sdk.optimizer import clip_coefficient


class LossScaler:
    """The scale, and what a step's gradients under it mean for that step."""

    def __init__(self, scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.skipped = 0  # steps skipped so far, for the user to see
        self._good_steps = 0

    def verdict(self, norms: list[float], norm_type: float = 2.0,
                clip: float | None = None) -> tuple[float, bool, torch.Tensor]:
        """(the factor every gradient is multiplied by before the step, whether the step is skipped, the total
        norm of the unscaled gradients) from each stage's norm of its scaled gradients; moves the scale on."""
        total = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32), norm_type) if norms \
            else torch.tensor(0.0)
        if not math.isfinite(total.item()):
            self.scale *= self.backoff_factor
            self._good_steps, self.skipped = 0, self.skipped + 1
            return 0.0, True, total
        scale = self.scale
        coefficient = 1.0
        if clip is not None:
            total, coefficient = clip_coefficient([n / scale for n in norms], clip, norm_type, False)
        else:
            total = total / scale
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0
        return coefficient / scale, False, total
