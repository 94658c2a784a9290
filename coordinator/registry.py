"""The shards that have registered, in order, and are still heard from."""

from __future__ import annotations

import hmac
import itertools
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shardtrain.addresses import is_host_port
from shardtrain.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted

MAX_SHARDS = 4096
_DEVICE = re.compile(r"|cpu|cuda|cuda:\d{1,4}")


@dataclass(frozen=True)
class ShardRecord:
    """A registered shard."""

    shard_id: str
    address: str
    device: str
    memory_bytes: int = 0  # what a stage there may use; 0: unknown
    instance: str = ""     # the shard's own random name: a restart at the address has another
    device_group: str = ""  # shards that compute on one device name the same group; empty: a device of its own
    control_key: str = field(default="", repr=False)  # what the coordinator presents on LoadStage, ProfileLayers
    compute: str = ""  # what timing a layer there depends on; empty: measured on its own

    @property
    def measures_like(self) -> tuple[str, str]:
        """Shards with the same key time a layer alike: one host, one kind of compute (or the shard alone)."""
        return (self.address.rpartition(":")[0], self.compute) if self.compute else (self.address, "")


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

    def register(self, address: str, device: str, memory_bytes: int = 0, instance: str = "",
                 device_group: str = "", control_key: str = "", compute: str = "") -> ShardRecord:
        """Adds or refreshes a shard; InvalidArgument for an address that is not host:port, ResourceExhausted
        once MAX_SHARDS have registered."""
        if not is_host_port(address):  # what a stage plan will name it by (shard_service/load_checks.py)
            raise InvalidArgument(f"shard address {address[:80]!r} must be host:port")
        if not _DEVICE.fullmatch(device):
            raise InvalidArgument(f"shard device {device[:40]!r} must be cpu, cuda or cuda:N")
        self._expire()
        previous = self._by_address.get(address)
        if previous is None and len(self._by_address) >= MAX_SHARDS:
            raise ResourceExhausted(f"{MAX_SHARDS} shards have registered, the most this coordinator keeps")
        if previous is not None and previous.instance == instance and not hmac.compare_digest(
                previous.control_key.encode(), control_key.encode()):
            raise PermissionDenied(f"{address} registered as instance {instance!r} with another control key: only "
                                   "that process renews its registration")
        shard_id = previous.shard_id if previous else f"shard-{next(self._ids)}"
        self._by_address[address] = ShardRecord(shard_id, address, device or "cpu", max(memory_bytes, 0), instance,
                                                device_group[:64], control_key[:128], compute[:200])
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

    def by_device(self, num_stages: int, replicas: int, per_device: int) -> list[ShardRecord]:
        """Shards for `replicas` pipelines of `num_stages` stages with `per_device` stages per device, in the order
        take() gives them (replica by replica, stage by stage): stage s of replica r on device r x p + s mod p
        (p = num_stages / per_device), the (s div p)-th shard of that device's group. Devices in the order their
        first shard registered; FailedPrecondition if too few have `per_device` shards."""
        if num_stages % per_device:
            raise InvalidArgument(f"{num_stages} stages do not split into devices of {per_device} stages each; "
                                  f"give num_stages a multiple of virtual_stages")
        groups: dict[str, list[ShardRecord]] = {}
        for shard in self.shards():
            groups.setdefault(shard.device_group or shard.address, []).append(shard)
        devices = [members for members in groups.values() if len(members) >= per_device]
        per_pipeline = num_stages // per_device
        if len(devices) < per_pipeline * replicas:
            raise FailedPrecondition(f"{replicas} x {num_stages} stages at {per_device} per device need "
                                     f"{per_pipeline * replicas} devices serving {per_device} shards each "
                                     f"(shardtrain shard --virtual-stages {per_device}); "
                                     f"{len(devices)} have registered")
        return [devices[r * per_pipeline + s % per_pipeline][s // per_pipeline]
                for r in range(replicas) for s in range(num_stages)]

    def take(self, count: int, prefer: Sequence[str] = ()) -> list[ShardRecord]:
        """`count` shards: slot i takes the shard at prefer[i] where one is registered there, every other slot the
        next shard in registration order that no slot took (a spare); FailedPrecondition if fewer have registered."""
        shards = self.shards()
        if count > len(shards):
            raise FailedPrecondition(f"{count} stages need {count} shards but {len(shards)} have registered")
        by_address = {shard.address: shard for shard in shards}
        slots = [by_address.get(address) for address in list(prefer)[:count]]
        slots += [None] * (count - len(slots))
        taken = {shard.address for shard in slots if shard is not None}
        spares = iter([shard for shard in shards if shard.address not in taken])
        return [shard or next(spares) for shard in slots]
