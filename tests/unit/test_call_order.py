"""client_sdk.call_order: the call orders a script may make, checked without a shard (docs/architecture.md)."""

from __future__ import annotations

import pytest

from client_sdk.call_order import MAX_AWAITING, CallOrder
from shardtrain.errors import FailedPrecondition


def test_steps_are_numbered_in_order_and_the_last_is_kept():
    calls = CallOrder()
    assert [calls.next_step() for _ in range(3)] == [0, 1, 2]
    assert calls.last_step == 2


def test_each_forward_takes_one_backward():
    calls = CallOrder()
    calls.await_backward(0)
    calls.check_backward(0)
    with pytest.raises(FailedPrecondition, match="step 0's output was already backpropagated"):
        calls.check_backward(0)
    with pytest.raises(FailedPrecondition, match="step 7's output was already backpropagated, or never ran"):
        calls.check_backward(7)


def test_an_optimizer_step_outdates_the_graphs_awaiting_their_backward():
    calls = CallOrder()
    calls.await_backward(0)
    calls.outdate_awaiting_backward()
    assert calls.awaiting_backward == []
    with pytest.raises(FailedPrecondition, match="step 0's output cannot be backpropagated: an optimizer step"):
        calls.check_backward(0)


def test_beyond_max_awaiting_forwards_the_oldest_graph_is_given_up():
    calls = CallOrder()
    for step in range(MAX_AWAITING + 1):
        calls.await_backward(step)
    with pytest.raises(FailedPrecondition, match=f"more than {MAX_AWAITING} later forwards"):
        calls.check_backward(0)
    calls.check_backward(MAX_AWAITING)


def test_a_zero_grad_rides_on_one_item_only():
    calls = CallOrder()
    calls.zero_grad_pending = True
    assert [calls.take_zero_grad(), calls.take_zero_grad()] == [True, False]


def test_a_failure_abandons_the_steps_owed():
    calls = CallOrder()
    calls.settle_before_forward, calls.backward_steps = 3, [4, 5]
    calls.abandon_deferred_work()
    assert (calls.settle_before_forward, calls.backward_steps) == (0, [])
