"""The one bound on what a stage holds waiting to run: forwards, backwards and loss targets, counted and weighed.

A script that never steps could pile up any number of forwards waiting for an optimizer step; a planned step's
micro-batches and targets wait for their turn. They all share one budget, so that no mix of them passes it; an
item beyond it is refused with RESOURCE_EXHAUSTED and the stage goes on serving.
"""

from __future__ import annotations

import torch

from shardtrain.errors import ResourceExhausted

# Items a stage holds at once, tensors and all, while they wait to run: the loop has one or two, a script that
# never steps could pile up any number. Beyond either bound the item is refused.
MAX_HELD_ITEMS = 128
MAX_HELD_BYTES = 2 << 30


def tensor_bytes(tensor: torch.Tensor | None) -> int:
    """A tensor's bytes (0 for none)."""
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class HeldItems:
    """How many items of the loop wait here and how many bytes every waiting item holds, under one bound."""

    def __init__(self, max_items: int = MAX_HELD_ITEMS, max_bytes: int = MAX_HELD_BYTES):
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items = 0   # the loop's forwards and backwards (a planned step's are bounded by its plan)
        self.bytes = 0   # the tensors of everything waiting: the loop's items, planned micro-batches, targets

    def check(self, size: int, item: bool = False) -> None:
        """ResourceExhausted if one more tensor of `size` bytes (and with `item`, one more item) would not fit."""
        if (item and self.items >= self.max_items) or self.bytes + size > self.max_bytes:
            raise ResourceExhausted(
                f"{self.items} forwards and backwards and {self.bytes >> 20} MiB of tensors already wait to run "
                f"here, at most {self.max_items} and {self.max_bytes >> 20} MiB: a step waits for an optimizer step "
                "that has not come, or too many or too large micro-batches were sent at once")

    def hold(self, size: int, item: bool = False) -> None:
        """Counts what starts waiting; ResourceExhausted (and nothing counted) if it does not fit."""
        self.check(size, item)
        self.items += item
        self.bytes += size

    def release(self, size: int, item: bool = False) -> None:
        """What waited stopped waiting (it ran, or was dropped)."""
        self.items -= item
        self.bytes -= size
