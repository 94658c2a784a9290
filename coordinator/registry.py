"""The shards that have registered, in order, and are still heard from."""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardtrain.addresses import is_host_port
from shardtrain.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

MAX_SHARDS = 4096
_DEVICE = re.compile(r"|cpu|cuda|cuda:\d{1,4}")


@dataclass(frozen=True)
class ShardRecord:
    """A registered shard."""

    shard_id: str
    address: str
    device: str
    memory_bytes: int = 0  # what a stage there may use; 0: unknown
    instance: str = ""     # the shard process's own random name: a restart at the address has another


class ShardRegistry:
    """Shards by address; a shard that registers again (a restart, or its heartbeat) keeps its id and place.

    A shard not heard from for `expiry` seconds is forgotten (it died, or was never there to begin with);
    if it comes back it registers as a new shard.
    """

    def __init__(self, expiry: float = math.inf, clock: Callable[[], float] = time.monotonic) -> None:
        self._by_address: dict[str, ShardRecord] = {}
        self._heard: dict[str, float] = {}
        self._ids = itertools.count()
        self._expiry = expiry
        self._clock = clock

    def holder(self, address: str) -> ShardRecord | None:
        """The registration of `address` still heard from, if any."""
        self._expire()
        return self._by_address.get(address)

    def register(self, address: str, device: str, memory_bytes: int = 0, instance: str = "") -> ShardRecord:
        """Adds or refreshes a shard; InvalidArgument for an address that is not host:port, ResourceExhausted
        once MAX_SHARDS have registered."""
        if not is_host_port(address):  # what a stage plan will name it by (shard_service/stage_plan.py)
            raise InvalidArgument(f"shard address {address[:80]!r} must be host:port")
        if not _DEVICE.fullmatch(device):
            raise InvalidArgument(f"shard device {device[:40]!r} must be cpu, cuda or cuda:N")
        self._expire()
        previous = self._by_address.get(address)
        if previous is None and len(self._by_address) >= MAX_SHARDS:
            raise ResourceExhausted(f"{MAX_SHARDS} shards have registered, the most this coordinator keeps")
        shard_id = previous.shard_id if previous else f"shard-{next(self._ids)}"
        self._by_address[address] = ShardRecord(shard_id, address, device or "cpu", max(memory_bytes, 0), instance)
        self._heard[address] = self._clock()
        return self._by_address[address]

    def forget(self, address: str) -> None:
        """Drops a shard (it did not answer); it comes back, as a new shard, when it registers again."""
        self._by_address.pop(address, None)
        self._heard.pop(address, None)

    def shards(self) -> list[ShardRecord]:
        """Every registered shard still heard from, in registration order."""
        self._expire()
        return list(self._by_address.values())

    def _expire(self) -> None:
        now = self._clock()
        for address in [a for a, heard in self._heard.items() if now - heard > self._expiry]:
            self.forget(address)

    def take(self, count: int) -> list[ShardRecord]:
        """The first `count` shards; FailedPrecondition if fewer have registered."""
        shards = self.shards()
        if count > len(shards):
            raise FailedPrecondition(f"{count} stages need {count} shards but {len(shards)} have registered")
        return shards[:count]
