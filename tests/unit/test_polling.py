"""shard_service.polling: a selector that polls for a window before it sleeps, and never past a timeout."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time

import pytest

from shard_service.polling import PollingLoop, PollingSelector, held


@pytest.fixture
def pair():
    reader, writer = socket.socketpair()
    yield reader, writer
    reader.close()
    writer.close()


def _selector(window: float, sock: socket.socket) -> PollingSelector:
    selector = PollingSelector(window)
    selector.register(sock, selectors.EVENT_READ)
    return selector


def _cpu_and_wall(selector: PollingSelector, timeout: float | None) -> tuple[list, float, float]:
    cpu, wall = time.thread_time(), time.monotonic()
    ready = selector.select(timeout)
    return ready, time.thread_time() - cpu, time.monotonic() - wall


def _waiting_for_an_item(window: float, delay: float, pair) -> tuple[float, float]:
    """(CPU, wall time) of a select(None) that an item sent `delay` seconds later ends."""
    reader, writer = pair
    selector = _selector(window, reader)
    timer = threading.Timer(delay, writer.send, (b"x",))
    timer.start()
    try:
        ready, cpu, wall = _cpu_and_wall(selector, None)
    finally:
        timer.join()
        selector.close()
    assert [key.fileobj for key, _ in ready] == [reader]
    return cpu, wall


def test_an_item_that_comes_while_polling_is_returned(pair):
    cpu, _ = _waiting_for_an_item(0.5, 0.02, pair)
    assert cpu > 0.002  # it polled (and did not sleep) until the item came


def test_after_the_window_it_sleeps_until_an_item_comes(pair):
    cpu, wall = _waiting_for_an_item(0.01, 0.3, pair)
    assert wall >= 0.25
    assert cpu < 0.1  # polled for 10 ms, then slept for the rest


def test_it_never_waits_past_the_timeout(pair):
    reader, _ = pair
    selector = _selector(1.0, reader)
    ready, _, wall = _cpu_and_wall(selector, 0.02)
    assert ready == []
    assert 0.015 <= wall < 0.5  # the timeout, not the 1 s window
    ready, _, wall = _cpu_and_wall(selector, 0)
    assert ready == [] and wall < 0.05
    selector.close()


def test_a_timeout_longer_than_the_window_is_kept_whole(pair):
    reader, _ = pair
    selector = _selector(0.01, reader)
    ready, _, wall = _cpu_and_wall(selector, 0.1)
    assert ready == []
    assert 0.09 <= wall < 0.5
    selector.close()


def test_held_or_window_zero_sleeps_at_once(pair):
    reader, _ = pair
    for selector in (_selector(0.0, reader), _selector(0.2, reader)):
        with selector.held():
            ready, cpu, wall = _cpu_and_wall(selector, 0.1)
        assert ready == [] and wall >= 0.09
        assert cpu < 0.03  # slept: a poll over the 0.1 s would burn most of it
        selector.close()


def test_a_negative_window_is_refused():
    with pytest.raises(ValueError, match="at least 0 seconds, got -1"):
        PollingSelector(-1)


def test_a_polling_loop_runs_coroutines_and_socket_callbacks(pair):
    reader, writer = pair
    reader.setblocking(False)
    loop = PollingLoop(0.005)
    try:
        async def exchange() -> bytes:
            received = loop.create_future()
            loop.add_reader(reader, lambda: received.set_result(reader.recv(10)))
            loop.call_later(0.02, writer.send, b"item")
            return await asyncio.wait_for(received, 5)
        assert loop.run_until_complete(exchange()) == b"item"
    finally:
        loop.close()


def test_held_of_a_polling_loop_holds_its_selector(pair):
    reader, _ = pair
    loop = PollingLoop(0.2)
    try:
        loop.polling.register(reader, selectors.EVENT_READ)
        with held(loop):
            ready, cpu, wall = _cpu_and_wall(loop.polling, 0.1)
        assert ready == [] and wall >= 0.09 and cpu < 0.03
    finally:
        loop.polling.unregister(reader)
        loop.close()


def test_held_is_nothing_for_a_loop_that_does_not_poll():
    loop = asyncio.new_event_loop()
    try:
        with held(loop):
            pass
    finally:
        loop.close()
