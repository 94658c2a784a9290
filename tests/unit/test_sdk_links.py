"""client_sdk.sdk_links: what a failure item that comes back fails among the steps the SDK waits for.

The items are built as a shard builds them (shardtrain.link_streams.error_item) and handed to SdkLinks as its
links hand them over; nothing is sent, so no peer is needed.
"""

from __future__ import annotations

import asyncio

from client_sdk.sdk_links import SdkLinks, _expect
from shardtrain import errors, link_streams
from shardtrain.v1 import shard_pb2

BROKE = errors.Unavailable("shard at 127.0.0.1:1 (stage 1) is unavailable: its link to this shard ended")


def waits(links: SdkLinks, outputs=(), backwards=(), optimizer_steps=()) -> dict:
    """Futures the SDK would wait on: outputs and backwards by step; optimizer steps as (number, last forward)."""
    pending = {("output", step): _expect(links._outputs, step) for step in outputs}
    pending.update({("backward", step): _expect(links._backwards, step) for step in backwards})
    for number, after_forward in optimizer_steps:
        pending["optimizer step", number] = _expect(links._settles, number)
        links._after_forward[number] = after_forward
    return pending


def failed(pending: dict) -> set:
    return {name for name, future in pending.items() if future.done() and future.exception() is not None}


def after_item(item: shard_pb2.LinkMessage, **waiting) -> set:
    async def run() -> set:
        links = SdkLinks("d", None, None, None, timeout=1.0)
        pending = waits(links, **waiting)
        links._on_item(None, item, None)
        return failed(pending)
    return asyncio.run(run())


def test_a_broken_link_between_stages_fails_the_steps_it_may_have_cost_and_no_later_one():
    item = link_streams.error_item(None, BROKE, "shard 127.0.0.1:2 (stage 2)", through_step=3)
    assert after_item(item, outputs=[3, 4], backwards=[2, 3], optimizer_steps=[(3, 3), (4, 4)]) == {
        ("output", 3), ("backward", 2), ("backward", 3), ("optimizer step", 3)}


def test_a_report_from_before_any_forward_fails_nothing_that_follows():
    item = link_streams.error_item(None, BROKE, "shard 127.0.0.1:2 (stage 2)", through_step=-1)
    assert after_item(item, outputs=[0], optimizer_steps=[(1, 0)]) == set()


def test_a_broken_link_that_names_no_step_fails_everything_in_flight():
    item = link_streams.error_item(None, BROKE, "the SDK")
    assert after_item(item, outputs=[3, 4], backwards=[3], optimizer_steps=[(3, 3), (4, 4)]) == {
        ("output", 3), ("output", 4), ("backward", 3), ("optimizer step", 3), ("optimizer step", 4)}


def test_the_failure_raised_is_the_reported_one():
    async def run() -> BaseException:
        links = SdkLinks("d", None, None, None, timeout=1.0)
        output = waits(links, outputs=[5])["output", 5]
        links._on_item(None, link_streams.error_item(None, BROKE, "shard 127.0.0.1:2 (stage 2)", through_step=5), None)
        return output.exception()
    raised = asyncio.run(run())
    assert isinstance(raised, errors.Unavailable) and "its link to this shard ended" in str(raised)
