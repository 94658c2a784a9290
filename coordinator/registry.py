"""The shards that have registered, in order."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardtrain.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

MAX_SHARDS = 4096
_DEVICE = re.compile(r"|cpu|cuda|cuda:\d{1,4}")


@dataclass(frozen=True)
class ShardRecord:
    """A registered shard."""

    shard_id: str
    address: str
    device: str


class ShardRegistry:
    """Shards by address; a shard that registers again (a restart) keeps its id and place."""

    def __init__(self) -> None:
        self._by_address: dict[str, ShardRecord] = {}

    def register(self, address: str, device: str) -> ShardRecord:
        """Adds or refreshes a shard; InvalidArgument for an address that is not host:port, ResourceExhausted
        once MAX_SHARDS have registered."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or len(address) > 261 or not 0 < int(port) < 65536:
            raise InvalidArgument(f"shard address {address[:80]!r} must be host:port")
        if not _DEVICE.fullmatch(device):
            raise InvalidArgument(f"shard device {device[:40]!r} must be cpu, cuda or cuda:N")
        previous = self._by_address.get(address)
        if previous is None and len(self._by_address) >= MAX_SHARDS:
            raise ResourceExhausted(f"{MAX_SHARDS} shards have registered, the most this coordinator keeps")
        shard_id = previous.shard_id if previous else f"shard-{len(self._by_address)}"
        self._by_address[address] = ShardRecord(shard_id, address, device or "cpu")
        return self._by_address[address]

    def shards(self) -> list[ShardRecord]:
        """Every registered shard, in registration order."""
        return list(self._by_address.values())

    def take(self, count: int) -> list[ShardRecord]:
        """The first `count` shards; FailedPrecondition if fewer have registered."""
        shards = self.shards()
        if count > len(shards):
            raise FailedPrecondition(f"{count} stages need {count} shards but {len(shards)} have registered")
        return shards[:count]
