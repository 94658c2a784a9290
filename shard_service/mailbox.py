"""Tensors one side of a step leaves for the other to pick up: awaitable, bounded, with timeouts."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Hashable

from shardtrain.errors import DeadlineExceeded, FailedPrecondition
from shardtrain.waiting import settled_within


class _Refused(Exception):
    """Set on a slot that will never be filled; its reader turns it into FailedPrecondition."""


def _refuse(slot: asyncio.Future, why: str) -> None:
    if not slot.done():
        slot.set_exception(_Refused(why))
        slot.exception()  # marks it retrieved: nobody may be waiting


class Mailbox:
    """Values keyed by (step, microbatch, name); a reader waits until the writer has put, up to a timeout."""

    def __init__(self, capacity: int = 1024, max_bytes: int = 0):
        self._slots: OrderedDict[Hashable, asyncio.Future] = OrderedDict()
        self._capacity = capacity
        self._max_bytes = max_bytes  # 0: bounded by count alone
        self._sizes: dict[Hashable, int] = {}  # bytes of the tensors delivered, by key
        self._evicted: OrderedDict[Hashable, str] = OrderedDict()  # recent evictions, for a reader that comes later

    def _slot(self, key: Hashable) -> asyncio.Future:
        if key not in self._slots:
            self._slots[key] = asyncio.get_running_loop().create_future()
            while len(self._slots) > self._capacity:  # forgotten entries (failed steps) must not pile up
                self._evict("too many entries waiting")
        return self._slots[key]

    def _evict(self, why: str) -> None:
        key, slot = self._slots.popitem(last=False)
        self._sizes.pop(key, None)
        _refuse(slot, f"was evicted: {why}")
        self._evicted[key] = f"was evicted: {why}"
        while len(self._evicted) > self._capacity:
            self._evicted.popitem(last=False)

    def put(self, key: Hashable, value: Any) -> None:
        """Delivers a value; a second put for the same key replaces it. Past `max_bytes` of tensors held, the
        oldest entries are evicted (their readers get FailedPrecondition)."""
        self._evicted.pop(key, None)
        slot = self._slot(key)
        if slot.done():
            self._slots[key] = slot = asyncio.get_running_loop().create_future()
        slot.set_result(value)
        if self._max_bytes and hasattr(value, "untyped_storage"):
            self._sizes[key] = value.numel() * value.element_size()
            while sum(self._sizes.values()) > self._max_bytes and next(iter(self._slots)) != key:
                self._evict(f"more than {self._max_bytes >> 20} MiB of tensors were waiting")

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
            raise FailedPrecondition(f"{what} {refused}") from None

    def delivered(self) -> list:
        """The values put and not yet discarded."""
        return [slot.result() for slot in self._slots.values() if slot.done() and slot.exception() is None]

    def discard(self, key: Hashable) -> None:
        """Forgets one entry; a reader still waiting for it gets FailedPrecondition."""
        slot = self._slots.pop(key, None)
        self._sizes.pop(key, None)
        if slot is not None:
            _refuse(slot, "was dropped: its step was abandoned or the stage reloaded")

    def discard_where(self, predicate) -> None:
        """Forgets every entry whose key satisfies `predicate`."""
        for key in [k for k in self._slots if predicate(k)]:
            self.discard(key)
