"""The device a shard computes on, shared by the stages a shard process holds (--virtual-stages): one compute
thread and one lock, so their work runs one piece at a time, and, in an interleaved planned step, the turns
that make their actions follow the device's order (shardtrain/schedule.py)."""

from __future__ import annotations

import asyncio
import os
import resource
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from shard_service.mailbox import Mailbox
from shardtrain import errors

Key = tuple[int, str, int]  # (stage, op, micro-batch)


def device_memory(device: str) -> int:
    """Bytes of the shard's device: a GPU's memory, or the host's physical memory (0 if unknown)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def peak_memory(device: str) -> int:
    """The most the shard has held: on a GPU what the CUDA allocator held, else the process's peak resident set."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(torch.device(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts it in KiB


def compute_kind(settings) -> str:
    """What timing a layer here depends on: the device's kind and model, and the threads the shard computes on.
    Shards of one host that say the same measure a layer alike, so one measures for all."""
    kind = settings.device.partition(":")[0]
    model = torch.cuda.get_device_name(torch.device(settings.device)) if kind == "cuda" and \
        torch.cuda.is_available() else "cpu"
    return f"{kind}/{model}/{settings.threads or torch.get_num_threads()} threads/{settings.virtual_stages} stages"


def stage_memory(settings) -> int:
    """Bytes a stage on this shard may use: --memory, or the device's, shared by the process's stages."""
    return (settings.memory_bytes or device_memory(settings.device)) // settings.virtual_stages


class Device:
    """One device: its compute thread, its lock, and the order of each interleaved step's actions on it."""

    def __init__(self) -> None:
        # One thread, in order. OpenMP thread counts are per thread: the work sets its own where it runs.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="stage")
        self.lock = asyncio.Lock()
        self._steps: dict[int, _Turns] = {}

    async def turn(self, step: int, order: Callable[[], list[Key]], key: Key, timeout: float) -> None:
        """Waits until `key` is the next action of `step` on this device; `order` gives the step's order, asked
        once per step by whichever stage comes first. DeadlineExceeded after `timeout`, Cancelled if the step
        was given up."""
        turns = self._steps.get(step)
        if turns is None:
            turns = self._steps[step] = _Turns(order())
        await turns.wait(key, timeout)

    def turn_done(self, step: int) -> None:
        """The action whose turn it was is over: the next one may go."""
        turns = self._steps.get(step)
        if turns is not None and turns.advance():
            del self._steps[step]

    def give_up(self, step: int) -> None:
        """The step failed: whoever waits for a turn in it hears so."""
        turns = self._steps.pop(step, None)
        if turns is not None:
            turns.cancel(errors.Cancelled(f"step {step} failed on another stage"))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class _Turns:
    """One step's order on a device and how far it got: the action whose turn comes finds its key in the mailbox."""

    def __init__(self, order: list[Key]):
        self.order = order
        self.position = 0
        self._turns = Mailbox()

    async def wait(self, key: Key, timeout: float) -> None:
        if key not in self.order:
            raise errors.InternalError(f"action {key} is not in this device's order of the step")
        if self.position < len(self.order) and self.order[self.position] == key:
            self._turns.discard(key)
            return
        try:
            await self._turns.take(key, timeout, f"the turn of action {key}")
        except errors.DeadlineExceeded:
            expected = self.order[self.position] if self.position < len(self.order) else None
            raise errors.DeadlineExceeded(f"action {key} waited {timeout:g} s for its turn on the device; "
                                          f"the device waits for {expected}") from None

    def advance(self) -> bool:
        """Moves on to the next action; whether the order is over."""
        self.position += 1
        if self.position >= len(self.order):
            return True
        self._turns.put(self.order[self.position], None)
        return False

    def cancel(self, error: errors.ShardtrainError) -> None:
        self._turns.discard_where(lambda key: True, error)
