"""coordinator.registry: shards by address, in registration order, with stable ids."""

from __future__ import annotations

import pytest

from coordinator import registry as registry_module
from coordinator.registry import ShardRecord, ShardRegistry
from shardtrain.errors import FailedPrecondition, InvalidArgument, ResourceExhausted


def registry_of(*addresses: str) -> ShardRegistry:
    registry = ShardRegistry()
    for address in addresses:
        registry.register(address, "cpu")
    return registry


def test_register_gives_ids_in_order():
    registry = ShardRegistry()
    assert registry.register("10.0.0.1:7001", "cpu") == ShardRecord("shard-0", "10.0.0.1:7001", "cpu")
    assert registry.register("10.0.0.2:7001", "cuda:0") == ShardRecord("shard-1", "10.0.0.2:7001", "cuda:0")
    assert [s.shard_id for s in registry.shards()] == ["shard-0", "shard-1"]


def test_empty_device_means_cpu():
    assert ShardRegistry().register("h:1", "").device == "cpu"


def test_re_register_keeps_id_and_place_and_refreshes_the_device():
    registry = registry_of("a:1", "b:2", "c:3")
    assert registry.register("b:2", "cuda:1") == ShardRecord("shard-1", "b:2", "cuda:1")
    assert registry.shards() == [ShardRecord("shard-0", "a:1", "cpu"), ShardRecord("shard-1", "b:2", "cuda:1"),
                                 ShardRecord("shard-2", "c:3", "cpu")]


def test_new_shard_after_a_re_register_gets_a_fresh_id():
    registry = registry_of("a:1", "b:2")
    registry.register("a:1", "cpu")
    assert registry.register("c:3", "cpu").shard_id == "shard-2"


@pytest.mark.parametrize("address", ["localhost:50051", "[::1]:7000", "shard-3.svc:80"])
def test_host_port_addresses_are_accepted(address):
    assert ShardRegistry().register(address, "cpu").address == address


@pytest.mark.parametrize("address", ["", "localhost", ":7000", "localhost:", "localhost:http", "host:-1", "host:0",
                                     "host:65536"])
def test_address_that_is_not_host_port_is_refused_by_name(address):
    with pytest.raises(InvalidArgument, match=f"shard address {address!r} must be host:port"):
        ShardRegistry().register(address, "cpu")


def test_refused_address_is_not_registered():
    registry = ShardRegistry()
    with pytest.raises(InvalidArgument):
        registry.register("nohost", "cpu")
    assert registry.shards() == []


def test_take_gives_the_first_shards_in_order():
    assert [s.address for s in registry_of("a:1", "b:2", "c:3").take(2)] == ["a:1", "b:2"]


def test_take_all():
    assert len(registry_of("a:1", "b:2").take(2)) == 2


def test_take_keeps_each_preferred_shard_in_its_slot_and_fills_a_gone_one_with_a_spare():
    registry = registry_of("a:1", "b:2", "c:3", "d:4", "e:5")
    registry.forget("b:2")  # died: the first shard that no slot prefers takes its place
    assert [s.address for s in registry.take(4, prefer=["d:4", "b:2", "a:1", "c:3"])] == ["d:4", "e:5", "a:1", "c:3"]
    assert [s.address for s in registry.take(3, prefer=["c:3"])] == ["c:3", "a:1", "d:4"]


def test_take_more_than_registered_is_failed_precondition():
    with pytest.raises(FailedPrecondition, match="3 stages need 3 shards but 2 have registered"):
        registry_of("a:1", "b:2").take(3)


def test_an_overlong_address_is_refused_and_named_in_part():
    with pytest.raises(InvalidArgument, match="must be host:port"):
        ShardRegistry().register("h" * 300 + ":1", "cpu")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu; rm -rf /", "cuda:12345"])
def test_a_device_that_is_not_cpu_or_cuda_is_refused(device):
    with pytest.raises(InvalidArgument, match="must be cpu, cuda or cuda:N"):
        ShardRegistry().register("host:1", device)


def test_registrations_beyond_the_limit_are_resource_exhausted_but_a_known_shard_may_register_again(monkeypatch):
    monkeypatch.setattr(registry_module, "MAX_SHARDS", 2)
    registry = registry_of("a:1", "b:1")
    with pytest.raises(ResourceExhausted, match="2 shards have registered"):
        registry.register("c:1", "cpu")
    assert registry.register("a:1", "cuda:0").shard_id == "shard-0"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_shard_not_heard_from_within_the_expiry_is_forgotten_and_comes_back_as_a_new_one():
    clock = Clock()
    registry = ShardRegistry(expiry=30.0, clock=clock)
    registry.register("a:1", "cpu")
    registry.register("b:1", "cpu")
    clock.now = 20.0
    registry.register("a:1", "cpu")  # a's heartbeat; b stays silent
    clock.now = 40.0
    assert [s.address for s in registry.shards()] == ["a:1"]
    assert registry.register("b:1", "cpu").shard_id == "shard-2"  # not b's old id: ids are never reused


def test_a_forgotten_shard_leaves_the_list_and_frees_its_place():
    registry = registry_of("a:1", "b:1", "c:1")
    registry.forget("b:1")
    registry.forget("nowhere:1")  # forgetting one that is not there is no error
    assert [s.address for s in registry.shards()] == ["a:1", "c:1"]
    assert [s.address for s in registry.take(2)] == ["a:1", "c:1"]


def grouped(*groups: tuple[str, int]) -> ShardRegistry:
    """A registry of devices, each (group, shards): the shards of one process register one after another."""
    registry = ShardRegistry()
    port = 7000
    for group, count in groups:
        for _ in range(count):
            port += 1
            registry.register(f"h:{port}", "cpu", device_group=group)
    return registry


def test_by_device_puts_stage_s_on_device_s_mod_p():
    registry = grouped(("a", 2), ("b", 2), ("c", 2), ("d", 2))
    assert [s.address for s in registry.by_device(4, 1, 2)] == ["h:7001", "h:7003", "h:7002", "h:7004"]
    by_replica = [s.device_group for s in registry.by_device(4, 2, 2)]
    assert by_replica == ["a", "b", "a", "b", "c", "d", "c", "d"]  # replica 1 on devices of its own


def test_by_device_skips_devices_with_too_few_shards_and_says_what_it_needs():
    registry = grouped(("a", 1), ("b", 2), ("c", 3))
    assert [s.device_group for s in registry.by_device(4, 1, 2)] == ["b", "c", "b", "c"]
    with pytest.raises(FailedPrecondition, match=r"1 x 6 stages at 3 per device need 2 devices serving 3 shards "
                                                 r"each \(shardtrain shard --virtual-stages 3\); 1 have registered"):
        registry.by_device(6, 1, 3)
    with pytest.raises(InvalidArgument, match="5 stages do not split into devices of 2 stages each"):
        registry.by_device(5, 1, 2)
