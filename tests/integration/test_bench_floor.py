"""bench/floor.py: the lean 3-process loop that bench.train_step quotes as the host's floor trains for real."""

from __future__ import annotations

import torch

from bench.floor import check, split_of
from client_sdk import LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL


def test_the_floor_trains_as_one_process_does():
    # Same weights, same batch, same Adam, one intra-op thread: the same arithmetic in the same order. A forward
    # that did not wait for its step would meet weights a step behind (or, in its backward, a step ahead).
    assert check(batch=32, steps=12) <= 1e-5


def test_the_floor_splits_the_seed_model_where_the_coordinator_does():
    torch.manual_seed(0)
    # tests/unit/test_partition.py: the seed model's parameter counts, balanced over 3 stages
    assert split_of(LayerList(TEST_RESIDUAL_SMALL), 3) == [(0, 3), (3, 5), (5, 10)]


def test_the_floor_takes_adams_keyword_arguments_as_one_process_does():
    # bench.train_step --adam reaches the floor's stage processes: a weight decay they ignored would show.
    assert check(batch=32, steps=6, adam={"fused": True, "weight_decay": 0.5}) <= 1e-5
