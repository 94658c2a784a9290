"""shard_service.held: one bound on the items and bytes a stage holds waiting to run."""

from __future__ import annotations

import pytest
import torch

from shard_service.held import HeldItems, tensor_bytes
from shardtrain.errors import ResourceExhausted


def test_items_and_bytes_are_counted_until_released_and_either_bound_refuses():
    held = HeldItems(max_items=2, max_bytes=100)
    held.hold(40, item=True)
    held.hold(50)  # a target or a planned micro-batch: bytes only
    with pytest.raises(ResourceExhausted, match="1 forwards and backwards and 0 MiB"):
        held.hold(20, item=True)
    held.hold(10, item=True)
    with pytest.raises(ResourceExhausted, match="at most 2"):
        held.check(0, item=True)
    held.release(40, item=True)
    held.check(0, item=True)
    assert (held.items, held.bytes) == (1, 60)


def test_tensor_bytes_counts_elements_times_their_size():
    assert tensor_bytes(torch.zeros(3, 2)) == 24 and tensor_bytes(None) == 0
