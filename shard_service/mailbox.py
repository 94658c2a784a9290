"""Values one side of a step leaves for the other to pick up, by key: awaitable, bounded, with deadlines.

The one keyed wait of a shard: residuals and their gradients, tied weights' gradients, loss targets, a planned
step's micro-batches, the stages' word that they finished a step, and a device's turns all wait here. A reader
waits with one timer (shardtrain/waiting.py); a value put before anyone reads costs no wait at all.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Callable, Hashable

from shard_service.held import HeldItems
from shardtrain.errors import DeadlineExceeded, FailedPrecondition, ShardtrainError
from shardtrain.waiting import settled_within


class _Refused(Exception):
    """Set on a slot that will never be filled: the error its reader raises, or why (as FailedPrecondition)."""

    def __init__(self, why: str, error: ShardtrainError | None = None):
        super().__init__(why)
        self.error = error


def _refuse(slot: asyncio.Future, why: str, error: ShardtrainError | None = None) -> None:
    if not slot.done():
        slot.set_exception(_Refused(why, error))
        slot.exception()  # marks it retrieved: nobody may be waiting


class Mailbox:
    """Values keyed by (step, microbatch, name) or the like; a reader waits until the writer has put, up to a
    timeout. `max_bytes` evicts the oldest tensors past it; `held` is a budget the values' bytes count against
    while they wait (a put that does not fit it is refused)."""

    def __init__(self, capacity: int = 1024, max_bytes: int = 0, held: HeldItems | None = None):
        self._slots: OrderedDict[Hashable, asyncio.Future] = OrderedDict()
        self._capacity = capacity
        self._max_bytes = max_bytes  # 0: bounded by count alone
        self._held = held
        self._sizes: dict[Hashable, int] = {}  # bytes of the tensors delivered, by key
        self._evicted: OrderedDict[Hashable, str] = OrderedDict()  # recent evictions, for a reader that comes later

    def _slot(self, key: Hashable) -> asyncio.Future:
        if key not in self._slots:
            self._slots[key] = asyncio.get_running_loop().create_future()
            while len(self._slots) > self._capacity:  # forgotten entries (failed steps) must not pile up
                self._evict("too many entries waiting")
        return self._slots[key]

    def _forget_size(self, key: Hashable) -> None:
        size = self._sizes.pop(key, 0)
        if self._held is not None:
            self._held.release(size)

    def _evict(self, why: str) -> None:
        key, slot = self._slots.popitem(last=False)
        self._forget_size(key)
        _refuse(slot, f"was evicted: {why}")
        self._evicted[key] = f"was evicted: {why}"
        while len(self._evicted) > self._capacity:
            self._evicted.popitem(last=False)

    def put(self, key: Hashable, value: Any, size: int | None = None) -> None:
        """Delivers a value of `size` bytes (by default a tensor's own); a second put for the same key replaces it.
        ResourceExhausted, and nothing delivered, past the `held` budget; past `max_bytes` of tensors held, the
        oldest entries are evicted (their readers get FailedPrecondition)."""
        if size is None:
            size = value.numel() * value.element_size() if hasattr(value, "untyped_storage") else 0
        if self._held is not None:
            self._held.hold(size)  # refused before anything changes
        self._forget_size(key)
        self._evicted.pop(key, None)
        slot = self._slot(key)
        if slot.done():
            self._slots[key] = slot = asyncio.get_running_loop().create_future()
        slot.set_result(value)
        self._sizes[key] = size
        while self._max_bytes and sum(self._sizes.values()) > self._max_bytes and next(iter(self._slots)) != key:
            self._evict(f"more than {self._max_bytes >> 20} MiB of tensors were waiting")

    def has(self, key: Hashable) -> bool:
        """Whether a value under `key` was put and not yet taken or discarded."""
        slot = self._slots.get(key)
        return slot is not None and slot.done() and slot.exception() is None

    async def get(self, key: Hashable, timeout: float, what: str) -> Any:
        """Waits for the value under `key`; DeadlineExceeded naming `what` after `timeout` seconds."""
        if key not in self._slots and key in self._evicted:
            raise FailedPrecondition(f"{what} {self._evicted[key]}")
        slot = self._slot(key)
        if slot.done() and slot.exception() is None:
            return slot.result()  # already delivered: no timer, no task
        if not await settled_within(slot, timeout):
            raise DeadlineExceeded(f"{what} did not arrive within {timeout:g} s")
        try:
            return slot.result()
        except _Refused as refused:
            raise refused.error or FailedPrecondition(f"{what} {refused}") from None

    async def take(self, key: Hashable, timeout: float, what: str) -> Any:
        """get, then the entry is forgotten: a value read once."""
        try:
            return await self.get(key, timeout, what)
        finally:
            self._slots.pop(key, None)
            self._forget_size(key)

    def delivered(self) -> list:
        """The values put and not yet discarded."""
        return [slot.result() for slot in self._slots.values() if slot.done() and slot.exception() is None]

    def held_bytes(self) -> int:
        """Bytes of the values that wait here."""
        return sum(self._sizes.values())

    def discard(self, key: Hashable, error: ShardtrainError | None = None) -> None:
        """Forgets one entry; a reader still waiting for it gets `error`, or FailedPrecondition."""
        slot = self._slots.pop(key, None)
        self._forget_size(key)
        if slot is not None:
            _refuse(slot, "was dropped: its step was abandoned or the stage reloaded", error)

    def discard_where(self, predicate: Callable[[Hashable], bool], error: ShardtrainError | None = None) -> None:
        """Forgets every entry whose key satisfies `predicate`."""
        for key in [k for k in self._slots if predicate(k)]:
            self.discard(key, error)
