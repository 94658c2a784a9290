"""ShardServicer.steps_ahead: which stages apply optimizer steps ahead of their verdict, by --step-ahead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shard_service.servicer import AHEAD_SECONDS, ShardServicer
from shardtrain.settings import ShardSettings


def servicer_with(step_ahead: str, index: int | None, device: str = "cpu", last_step: float = 0.0) -> ShardServicer:
    servicer = ShardServicer(ShardSettings(coordinator="c:1", step_ahead=step_ahead), "127.0.0.1:1")
    if index is not None:
        servicer._stage = SimpleNamespace(index=index, device=torch.device(device), last_step_seconds=last_step)
    return servicer


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_the_first_stage_and_a_shard_without_a_stage_never_step_ahead(mode):
    assert not servicer_with(mode, index=0, last_step=1.0).steps_ahead
    assert not servicer_with(mode, index=None).steps_ahead


def test_auto_steps_ahead_on_a_cpu_stage_once_its_optimizer_step_is_slow_enough():
    assert not servicer_with("auto", index=1, last_step=0.0).steps_ahead  # not measured yet: the first step
    assert not servicer_with("auto", index=1, last_step=AHEAD_SECONDS / 2).steps_ahead
    assert servicer_with("auto", index=2, last_step=AHEAD_SECONDS).steps_ahead
    assert not servicer_with("auto", index=1, device="cuda:0", last_step=1.0).steps_ahead


def test_on_and_off_do_as_they_say_after_the_first_stage():
    assert servicer_with("on", index=1, device="cuda:0").steps_ahead
    assert not servicer_with("off", index=1, last_step=1.0).steps_ahead
