"""Activation recomputation: stages that keep only each micro-batch's inputs and outputs and run its forward again
in backward train equal to one process, hold less activation memory, and replay dropout's random numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from client_sdk.seed_models import TEST_RESIDUAL_SMALL
from client_sdk import LayerList
from shardtrain.errors import InvalidArgument
from tests.integration.test_pipeline import ADAM, PIPELINE_TOLERANCE, train_full_batch, train_pipelined
from tests.integration.training import largest_difference, regression_batches


@pytest.mark.parametrize("recompute,schedule", [("always", "1f1b"), ("except_last", "gpipe"), ("always", "zb-h1")])
def test_recomputed_stages_train_equal_to_one_process(cluster4, recompute, schedule):
    torch.manual_seed(0)
    reference = LayerList(TEST_RESIDUAL_SMALL)  # its residual crosses stages: recomputed outgoing values too
    batches = regression_batches(steps=4, batch=30, features=1)
    expected, expected_losses = train_full_batch(reference, batches, ADAM)
    model = cluster4.deploy(TEST_RESIDUAL_SMALL, optimizer=ADAM, num_stages=3, recompute=recompute)
    model.load_state_dict(reference.state_dict())
    losses = train_pipelined(model, batches, microbatches=4, schedule=schedule)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-7)
    assert largest_difference(model.state_dict(), expected) <= PIPELINE_TOLERANCE


def deep(width: int = 64) -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(width, width), nn.Tanh())])


def test_recomputation_holds_only_inputs_and_outputs_in_flight(cluster4):
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    peaks = {}
    for recompute in ("never", "always"):
        model = cluster4.deploy(deep(), optimizer=ADAM, num_stages=2, recompute=recompute)
        model.train_step(x, y, "MSELoss", microbatches=8, schedule="gpipe")
        peaks[recompute] = {s["stage"]: s["peak_activation_bytes"] for s in model.stats()}
    for stage in (0, 1):  # 8 micro-batches of 8 rows in flight: 3 Linear+Tanh pairs save ~6 tensors each, against 2
        assert 0 < peaks["always"][stage] * 2.5 < peaks["never"][stage], peaks


def test_dropout_draws_the_same_mask_when_its_forward_runs_again(cluster4):
    """The middle stage drops half its input; identity weights around it show the mask the forward drew, and the
    gradients of both Linear layers must follow that same mask."""
    width = 16
    model_def = nn.Sequential(nn.Linear(width, width), nn.Dropout(0.5), nn.Linear(width, width))
    with torch.no_grad():
        for linear in (model_def[0], model_def[2]):
            linear.weight.copy_(torch.eye(width))
            linear.bias.zero_()
    model = cluster4.deploy(model_def, optimizer=(torch.optim.SGD, {"lr": 1.0}), layers_per_stage=[1, 1, 1],
                            recompute="always")
    x, direction = torch.randn(8, width), torch.randn(8, width)
    y = model(x)
    (y * direction).sum().backward()
    model.step()
    kept = (y != 0).to(torch.float32)  # where the dropout kept x (scaled by 2)
    assert 0 < kept.mean() < 1
    expected_last = torch.eye(width) - direction.T @ y.detach()
    expected_first = torch.eye(width) - (direction * kept * 2).T @ x
    state = model.state_dict()
    assert torch.allclose(state["2.weight"], expected_last, atol=1e-5)
    assert torch.allclose(state["0.weight"], expected_first, atol=1e-5)


def test_an_unknown_mode_is_refused(cluster4):
    with pytest.raises(InvalidArgument, match=r"recompute must be one of \['never', 'always', 'except_last'\]"):
        cluster4.deploy(deep(), recompute="sometimes")


def test_memory_reports_what_each_stage_holds(cluster4):
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    model = cluster4.deploy(deep(), optimizer=ADAM, num_stages=2, recompute="always")
    model.train_step(x, y, "MSELoss", microbatches=8, schedule="gpipe")
    report = model.memory()
    parameters = {0: 3 * (64 * 64 + 64) * 4, 1: 3 * (64 * 64 + 64) * 4}
    assert [entry["stage"] for entry in report] == [0, 1]
    for entry in report:
        assert entry["weights"] == entry["gradients"] == parameters[entry["stage"]]
        assert entry["optimizer"] == 2 * parameters[entry["stage"]] + 6 * 4  # Adam's moments; a step count each
        assert entry["peak_activations"] == 8 * 8 * 64 * 4 * (1 if entry["stage"] == 0 else 2)  # inputs; + outputs
        assert entry["peak_process"] > entry["weights"]


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 16),
                                                  nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_named_layers_alone_are_recomputed_and_train_equal_to_one_process(cluster4, schedule="zb-h1"):
    """Under ZB-H1, whose split backward runs each checkpointed run of layers in two passes."""
    reference = Blocks()
    batches = regression_batches(steps=3, batch=32, features=16)
    expected, expected_losses = train_full_batch(reference, batches, ADAM)
    peaks = {}
    for recompute in ((), ["blocks.0", "blocks.2"]):
        model = cluster4.deploy(reference, optimizer=ADAM, num_stages=2, recompute=recompute,
                                example_input=batches[0][0], balance="parameters")
        losses = train_pipelined(model, batches, microbatches=4, schedule=schedule)
        assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-7)
        assert largest_difference(model.state_dict(), expected) <= PIPELINE_TOLERANCE
        peaks[bool(recompute)] = {s["stage"]: s["peak_activation_bytes"] for s in model.stats()}
    assert all(peaks[True][stage] < peaks[False][stage] for stage in (0, 1)), peaks
    with pytest.raises(InvalidArgument, match=r"recompute names 'layers\.0', which is no part of the model; its "
                                              r"parts are \['blocks.0.0', 'blocks.0.1'"):
        cluster4.deploy(reference, recompute=["layers.0"], example_input=batches[0][0])
