"""shard_service.mailbox: values left by one side of a step for the other, with waits that time out."""

from __future__ import annotations

import asyncio
import re

import pytest

from shard_service.mailbox import Mailbox
from shardtrain.errors import DeadlineExceeded, FailedPrecondition, ShardtrainError

LONG = 5.0    # a wait that must not time out
SHORT = 0.01  # a wait that must


def run(coroutine):
    return asyncio.run(coroutine)


def test_get_returns_what_was_put():
    async def scenario():
        mailbox = Mailbox()
        mailbox.put((1, 0, "res_1"), "tensor")
        return await mailbox.get((1, 0, "res_1"), LONG, "residual")
    assert run(scenario()) == "tensor"


def test_get_waits_for_a_later_put():
    async def scenario():
        mailbox = Mailbox()
        getter = asyncio.create_task(mailbox.get("k", LONG, "residual"))
        await asyncio.sleep(0)
        assert not getter.done()
        mailbox.put("k", 42)
        return await getter
    assert run(scenario()) == 42


def test_values_are_kept_apart_by_key():
    async def scenario():
        mailbox = Mailbox()
        mailbox.put((1, 0, "a"), "step 1")
        mailbox.put((2, 0, "a"), "step 2")
        return await mailbox.get((2, 0, "a"), LONG, "a"), await mailbox.get((1, 0, "a"), LONG, "a")
    assert run(scenario()) == ("step 2", "step 1")


def test_value_can_be_read_more_than_once():
    async def scenario():
        mailbox = Mailbox()
        mailbox.put("k", 1)
        return await mailbox.get("k", LONG, "k"), await mailbox.get("k", LONG, "k")
    assert run(scenario()) == (1, 1)


def test_second_put_replaces_the_value():
    async def scenario():
        mailbox = Mailbox()
        mailbox.put("k", "first")
        mailbox.put("k", "second")
        return await mailbox.get("k", LONG, "k")
    assert run(scenario()) == "second"


def test_get_times_out_naming_what_it_waited_for():
    async def scenario():
        await Mailbox().get((3, 0, "res_1"), SHORT, "residual 'res_1' of step 3")
    with pytest.raises(DeadlineExceeded, match=re.escape("residual 'res_1' of step 3 did not arrive within 0.01 s")):
        run(scenario())


def test_put_after_a_timed_out_get_is_still_delivered():
    async def scenario():
        mailbox = Mailbox()
        with pytest.raises(DeadlineExceeded):
            await mailbox.get("k", SHORT, "k")
        mailbox.put("k", "late")
        return await mailbox.get("k", LONG, "k")
    assert run(scenario()) == "late"


def test_oldest_entries_are_evicted_beyond_capacity():
    async def scenario():
        mailbox = Mailbox(capacity=2)
        for key in ("a", "b", "c"):
            mailbox.put(key, key.upper())
        kept = [await mailbox.get(key, LONG, key) for key in ("b", "c")]
        with pytest.raises(FailedPrecondition, match="'a' was evicted: too many entries waiting"):
            await mailbox.get("a", SHORT, "'a'")  # at once: no wait for what will never come
        return kept
    assert run(scenario()) == ["B", "C"]


def test_discard_forgets_one_entry():
    async def scenario():
        mailbox = Mailbox()
        mailbox.put("a", 1)
        mailbox.put("b", 2)
        mailbox.discard("a")
        mailbox.discard("never-put")
        with pytest.raises(DeadlineExceeded):
            await mailbox.get("a", SHORT, "a")
        return await mailbox.get("b", LONG, "b")
    assert run(scenario()) == 2


def test_discard_where_forgets_every_matching_key():
    async def scenario():
        mailbox = Mailbox()
        for step in (1, 2, 3):
            mailbox.put((step, 0, "r"), step)
        mailbox.discard_where(lambda key: key[0] <= 2)
        for step in (1, 2):
            with pytest.raises(DeadlineExceeded):
                await mailbox.get((step, 0, "r"), SHORT, f"step {step}")
        return await mailbox.get((3, 0, "r"), LONG, "step 3")
    assert run(scenario()) == 3


def test_reader_of_a_discarded_entry_gets_a_shardtrain_error():
    async def scenario():
        mailbox = Mailbox()
        reader = asyncio.create_task(mailbox.get("k", LONG, "residual 'r' of step 1"))
        await asyncio.sleep(0)
        mailbox.discard("k")
        with pytest.raises(ShardtrainError, match="residual 'r' of step 1"):
            await reader
    run(scenario())


def test_tensors_beyond_the_byte_bound_evict_the_oldest_and_their_readers_are_told():
    import torch

    async def scenario():
        box = Mailbox(max_bytes=3 << 20)
        for step in range(5):
            box.put((step, 0, "@output"), torch.zeros(1 << 18))  # 1 MiB each
        assert len(box.delivered()) == 3  # the newest three: 3 MiB
        with pytest.raises(FailedPrecondition, match="evicted: more than 3 MiB of tensors were waiting"):
            await box.get((0, 0, "@output"), 1.0, "step 0's output")
        assert (await box.get((4, 0, "@output"), 1.0, "step 4's output")).numel() == 1 << 18
        box.discard((4, 0, "@output"))
        box.put((5, 0, "@output"), torch.zeros(1 << 18))
        assert len(box.delivered()) == 3

    run(scenario())


def test_take_reads_a_value_once_and_has_says_whether_one_waits():
    async def scenario():
        mailbox = Mailbox()
        mailbox.put("k", 1)
        assert mailbox.has("k")
        assert await mailbox.take("k", LONG, "k") == 1
        assert not mailbox.has("k")
        with pytest.raises(DeadlineExceeded):
            await mailbox.take("k", SHORT, "k")
    run(scenario())


def test_a_discard_with_an_error_hands_the_waiting_reader_that_error():
    from shardtrain.errors import Cancelled

    async def scenario():
        mailbox = Mailbox()
        reader = asyncio.create_task(mailbox.take("k", LONG, "k"))
        await asyncio.sleep(0)
        mailbox.discard_where(lambda key: True, Cancelled("step 3 failed on another stage"))
        with pytest.raises(Cancelled, match="step 3 failed on another stage"):
            await reader
    run(scenario())


def test_values_count_against_a_shared_budget_until_taken_or_discarded():
    from shard_service.held import HeldItems
    from shardtrain.errors import ResourceExhausted

    async def scenario():
        held = HeldItems(max_items=1, max_bytes=10)
        first, second = Mailbox(held=held), Mailbox(held=held)
        first.put("a", "x", size=6)
        with pytest.raises(ResourceExhausted, match="at most 1 and 0 MiB"):
            second.put("b", "y", size=5)
        assert not second.has("b") and held.bytes == 6
        second.put("b", "y", size=4)
        assert held.bytes == 10 and first.held_bytes() == 6
        await first.take("a", LONG, "a")
        second.discard("b")
        assert held.bytes == 0
    run(scenario())
