"""client_sdk.batch.split_batch: a batch over replicas, then micro-batches."""

from __future__ import annotations

import pytest
import torch

from client_sdk.batch import split_batch
from shardtrain.errors import InvalidArgument


def test_rows_go_to_replicas_then_micro_batches_in_order():
    x, y = torch.arange(10).reshape(10, 1), torch.arange(10)
    mask = torch.arange(10) % 3 == 0
    shares = split_batch({"x": x, "y": y, "mask": mask}, replicas=2, microbatches=2)
    assert [[len(piece["x"]) for piece in share] for share in shares] == [[3, 2], [3, 2]]
    assert torch.equal(torch.cat([piece["x"] for share in shares for piece in share]), x)
    assert all(torch.equal(piece["x"].reshape(-1), piece["y"]) and torch.equal(piece["mask"], piece["y"] % 3 == 0)
               for share in shares for piece in share)


def test_too_few_rows_is_invalid():
    with pytest.raises(InvalidArgument, match="3 rows cannot feed 2 replica"):
        split_batch({"x": torch.zeros(3, 1), "y": torch.zeros(3)}, replicas=2, microbatches=2)


def test_inputs_and_targets_must_share_the_batch():
    with pytest.raises(InvalidArgument, match=r"same batch dimension \(dim 0\), got x \[4, 1\], y \[5\]"):
        split_batch({"x": torch.zeros(4, 1), "y": torch.zeros(5)}, replicas=1, microbatches=1)
    with pytest.raises(InvalidArgument, match=r"got x \[4, 1\], scale \[\]"):
        split_batch({"x": torch.zeros(4, 1), "scale": torch.tensor(2.0)}, replicas=1, microbatches=1)


def test_microbatches_must_be_positive():
    with pytest.raises(InvalidArgument, match=r"microbatches must be an integer in 1\.\.4096, got 0"):
        split_batch({"x": torch.zeros(4, 1), "y": torch.zeros(4)}, replicas=1, microbatches=0)
