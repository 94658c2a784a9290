"""shardtrain.addresses: host:port as peers are dialled, and bind addresses of this host alone."""

from __future__ import annotations

import pytest

from shardtrain import addresses


@pytest.mark.parametrize("address, local", [
    ("127.0.0.1:0", True), ("127.0.0.2:50051", True), ("localhost:1", True), ("[::1]:5", True),
    ("unix:/tmp/socket", True), ("0.0.0.0:50051", False), ("[::]:1", False), ("10.1.2.3:5", False),
    ("shard-0:50052", False)])
def test_loopback_addresses_are_told_from_the_rest(address, local):
    assert addresses.is_loopback(address) is local


@pytest.mark.parametrize("address", ["localhost:50051", "[::1]:7000", "shard-3.svc:80", "10.0.0.7:65535"])
def test_host_port_addresses_are_taken(address):
    assert addresses.is_host_port(address)


@pytest.mark.parametrize("address", ["", "localhost", ":7000", "localhost:", "host:0", "host:65536", "host:-1",
                                     "a host:1", "h" * 300 + ":1", "unix:/tmp/socket"])
def test_anything_else_is_not(address):
    assert not addresses.is_host_port(address)
