"""shard_service.device: the turns of an interleaved step's actions on a shared device follow the device's order,
whatever order the stages ask in; a turn not taken in time, or a step given up, ends the waits."""

from __future__ import annotations

import asyncio

import pytest

from shard_service.device import Device
from shardtrain import errors

ORDER = [(0, "F", 0), (1, "F", 0), (1, "B", 0), (0, "B", 0)]  # (stage, op, micro-batch) in the device's order


def test_actions_asked_in_another_order_run_in_the_devices_order():
    async def scenario() -> list:
        device, ran = Device(), []

        async def action(key) -> None:
            await device.turn(0, lambda: ORDER, key, timeout=5.0)
            ran.append(key)
            await asyncio.sleep(0)
            device.turn_done(0)
        await asyncio.gather(*(action(key) for key in reversed(ORDER)))
        device.close()
        return ran
    assert asyncio.run(scenario()) == ORDER


def test_a_turn_that_never_comes_names_what_the_device_waits_for():
    async def scenario() -> None:
        device = Device()
        try:
            await device.turn(0, lambda: ORDER, (1, "F", 0), timeout=0.05)
        finally:
            device.close()
    with pytest.raises(errors.DeadlineExceeded, match=r"the device waits for \(0, 'F', 0\)"):
        asyncio.run(scenario())


def test_a_step_given_up_ends_every_wait_for_its_turns():
    async def scenario() -> None:
        device = Device()
        waiting = asyncio.ensure_future(device.turn(0, lambda: ORDER, (1, "B", 0), timeout=5.0))
        await asyncio.sleep(0.01)
        device.give_up(0)
        try:
            await waiting
        finally:
            device.close()
    with pytest.raises(errors.Cancelled, match="step 0 failed on another stage"):
        asyncio.run(scenario())
