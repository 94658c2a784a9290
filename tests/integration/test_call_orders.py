"""Every order of calls a script can make on a deployed model does what PyTorch does in one process, or raises at
once; none waits for a deadline, and afterwards every stage holds the weights one process would hold."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from shardtrain import errors
from tests.integration.training import largest_difference, regression_batches

SECONDS = 15.0  # far below any deadline: a sequence that takes longer waited for something that never came
BATCHES = regression_batches(steps=3, batch=4, features=3, seed=5)


def mse(prediction, target):
    return nn.functional.mse_loss(prediction, target)


def step_before_backward(model, step, zero_grad):
    x, y = BATCHES[0]
    prediction = model(x)
    step()
    mse(prediction, y).backward()
    step()


def backward_twice(model, step, zero_grad):
    """PyTorch accumulates the gradient twice; the shards refuse the second backward at once (see REFUSED)."""
    x, y = BATCHES[0]
    loss = mse(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    step()


def backward_once(model, step, zero_grad):
    x, y = BATCHES[0]
    mse(model(x), y).backward()


def step_between_forward_and_backward(model, step, zero_grad):
    """A step that changes weights a pending graph holds: PyTorch's backward then raises, and so do the shards."""
    x, y = BATCHES[0]
    mse(model(x), y).backward()
    prediction = model(BATCHES[1][0])
    step()
    mse(prediction, BATCHES[1][1]).backward()


def forward_never_backpropagated(model, step, zero_grad):
    x, y = BATCHES[0]
    model(x)
    prediction = model(BATCHES[1][0])
    mse(prediction, BATCHES[1][1]).backward()
    step()


def zero_grad_between_forward_and_backward(model, step, zero_grad):
    x, y = BATCHES[0]
    mse(model(x), y).backward()
    step()
    prediction = model(BATCHES[1][0])
    zero_grad()
    mse(prediction, BATCHES[1][1]).backward()
    step()


def step_with_no_gradients(model, step, zero_grad):
    step()
    x, y = BATCHES[0]
    mse(model(x), y).backward()
    step()
    zero_grad()
    step()


def accumulate_two_forwards_then_step(model, step, zero_grad):
    (x1, y1), (x2, y2) = BATCHES[:2]
    first, second = mse(model(x1), y1), mse(model(x2), y2)
    first.backward()
    second.backward()
    step()


def backwards_in_reverse_order(model, step, zero_grad):
    (x1, y1), (x2, y2) = BATCHES[:2]
    first, second = mse(model(x1), y1), mse(model(x2), y2)
    second.backward()
    first.backward()
    step()


def one_backward_through_two_outputs(model, step, zero_grad):
    (x1, y1), (x2, y2) = BATCHES[:2]
    (mse(model(x1), y1) + mse(model(x2), y2)).backward()
    step()


def inference_between_forward_and_backward(model, step, zero_grad):
    x, y = BATCHES[0]
    prediction = model(x)
    with torch.no_grad():
        model(BATCHES[1][0])
    mse(prediction, y).backward()
    step()


def plain_loop_with_zero_grad_first(model, step, zero_grad):
    for x, y in BATCHES:
        zero_grad()
        mse(model(x), y).backward()
        step()


SEQUENCES = [step_before_backward, backward_twice, step_between_forward_and_backward, forward_never_backpropagated,
             zero_grad_between_forward_and_backward, step_with_no_gradients, accumulate_two_forwards_then_step,
             backwards_in_reverse_order, one_backward_through_two_outputs, inference_between_forward_and_backward,
             plain_loop_with_zero_grad_first]
# Orders PyTorch runs but the shards refuse at once: (what the refusal says, what one process must run to end
# where the shards end).
REFUSED = {backward_twice: ("already backpropagated", backward_once)}


def one_more_iteration(model, step, zero_grad) -> None:
    x, y = BATCHES[2]
    zero_grad()
    mse(model(x), y).backward()
    step()


def one_process(net: nn.Module, sequence, optimizer) -> tuple[dict, Exception | None, dict]:
    """What one process ends with: the weights, the error PyTorch raised if it did, and the weights after one
    more plain iteration."""
    local = copy.deepcopy(net)
    opt = optimizer[0](local.parameters(), **optimizer[1])
    error = None
    try:
        sequence(local, opt.step, opt.zero_grad)
    except RuntimeError as raised:
        error = raised
    after = copy.deepcopy(local.state_dict())
    one_more_iteration(local, opt.step, opt.zero_grad)
    return after, error, local.state_dict()


@pytest.mark.parametrize("sequence", SEQUENCES, ids=lambda s: s.__name__)
def test_a_call_order_does_what_one_process_does_without_waiting(cluster4, sequence):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = (torch.optim.Adam, {"lr": 0.01})
    refusal, local_sequence = REFUSED.get(sequence, (None, sequence))
    expected, local_error, expected_later = one_process(net, local_sequence, optimizer)
    model = cluster4.deploy(net, optimizer=optimizer, num_stages=3)
    started = time.monotonic()
    try:
        sequence(model, model.step, model.zero_grad)
        model.synchronize()
        outcome = None
    except errors.ShardtrainError as error:
        outcome = error
    took = time.monotonic() - started
    assert took < SECONDS, f"{sequence.__name__} took {took:.0f} s: it waited for something that never came"
    if refusal is not None:
        assert isinstance(outcome, errors.FailedPrecondition) and refusal in str(outcome), outcome
    elif local_error is not None:
        assert isinstance(outcome, errors.FailedPrecondition), \
            f"one process raised {local_error!r}, shards: {outcome!r}"
    else:
        assert outcome is None, f"one process trained on, shards raised {outcome!r}"
    assert largest_difference(model.state_dict(), expected) <= 1e-5  # every stage, as one process ends
    one_more_iteration(model, model.step, model.zero_grad)  # and training goes on in step with one process
    assert largest_difference(model.state_dict(), expected_later) <= 1e-5
