"""model.fit: epochs of train_step or the loop equal the hand-written loop, with validation, checkpoints, callbacks
and a progress bar; its history and the timeline draw as figures."""

from __future__ import annotations

import copy
import io
import json

import matplotlib
import pytest
import torch
from torch import nn

from shardtrain.errors import InvalidArgument
from tests.integration.training import interrupted_script, largest_difference, regression_batches

matplotlib.use("Agg")
SGD = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


def net() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def by_hand(module: nn.Module, batches, epochs: int) -> tuple[dict, list[float]]:
    local = copy.deepcopy(module)
    optimizer = SGD[0](local.parameters(), **SGD[1])
    losses = []
    for _ in range(epochs):
        for x, y in batches:
            loss = nn.functional.mse_loss(local(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return local.state_dict(), losses


@pytest.mark.parametrize("how", [{"microbatches": 4, "schedule": "1f1b"}, {"loop": True}])
def test_fit_equals_the_hand_written_loop_and_validates_each_epoch(cluster4, how):
    module, batches = net(), regression_batches(steps=5, batch=16, features=4, outputs=2)
    held_out = regression_batches(steps=2, batch=10, features=4, outputs=2)
    expected, expected_losses = by_hand(module, batches, epochs=2)
    model = cluster4.deploy(copy.deepcopy(module), optimizer=SGD, num_stages=3)
    bar = io.StringIO()
    history = model.fit(batches, epochs=2, loss_fn="MSELoss", validation=held_out, progress=bar, **how)
    assert history.losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-7)
    assert largest_difference(model.state_dict(), expected) <= 1e-5
    assert [r.step for r in history.steps] == list(range(1, 11))
    assert [r.epoch for r in history.steps] == [1] * 5 + [2] * 5
    with torch.no_grad():  # the last epoch's validation used the weights as they were then, which are final
        reference = copy.deepcopy(module)
        reference.load_state_dict(expected)
        want = sum(nn.functional.mse_loss(reference(x), y).item() * len(x) for x, y in held_out) / 20
    assert history.epochs[-1]["val_loss"] == pytest.approx(want, rel=1e-5)
    assert history.epochs[0]["loss"] == pytest.approx(sum(expected_losses[:5]) / 5, rel=1e-5)
    assert model.training and not history.interrupted
    assert "10/10" in bar.getvalue() and "loss=" in bar.getvalue()


def test_checkpoints_callbacks_and_a_stop(cluster4, tmp_path):
    module, batches = net(), regression_batches(steps=6, batch=8, features=4, outputs=2)
    model = cluster4.deploy(copy.deepcopy(module), optimizer=SGD, num_stages=2)
    seen = []

    def stop_at_four(history, record):
        seen.append((record.epoch, record.step))
        return record.step == 4

    history = model.fit(batches, epochs=3, loss_fn=nn.MSELoss(), checkpoint_every=2, checkpoint_dir=tmp_path,
                        callbacks=[stop_at_four], progress=False)
    assert seen == [(1, 1), (1, 2), (1, 3), (1, 4)] and len(history.steps) == 4 and history.epochs == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]
    trained = model.state_dict()
    other = cluster4.deploy(copy.deepcopy(module), optimizer=SGD, num_stages=3)
    other.load_checkpoint(tmp_path / "step-4")
    assert largest_difference(other.state_dict(), trained) == 0


def test_fit_refuses_what_it_cannot_do(cluster4):
    model = cluster4.deploy(net(), optimizer=SGD, num_stages=2)
    batches = regression_batches(steps=1, batch=8, features=4, outputs=2)
    with pytest.raises(InvalidArgument, match="epochs must be a whole number >= 1, got 0"):
        model.fit(batches, epochs=0, progress=False)
    with pytest.raises(InvalidArgument, match="checkpoint_every=3 needs a count >= 1 and a checkpoint_dir"):
        model.fit(batches, checkpoint_every=3, progress=False)
    with pytest.raises(InvalidArgument, match="takes neither microbatches nor loss_output"):
        model.fit(batches, loop=True, microbatches=2, progress=False)
    with pytest.raises(InvalidArgument, match=r"\(x, y\) batches.*got a Tensor"):
        model.fit([torch.zeros(8, 4)], progress=False)


def test_the_history_and_the_timeline_draw_figures(cluster4, tmp_path):
    model = cluster4.deploy(net(), optimizer=SGD, num_stages=3)
    batches = regression_batches(steps=4, batch=16, features=4, outputs=2)
    history = model.fit(batches, epochs=2, microbatches=4, schedule="zb-h1", validation=batches[:1],
                        progress=False)
    figure = history.plot(tmp_path / "loss.png")
    lines = figure.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["training loss", "validation loss"]
    assert list(lines[0].get_ydata()) == history.losses and len(lines[1].get_ydata()) == 2
    assert (tmp_path / "loss.png").stat().st_size > 1000
    timeline = model.timeline()
    figure = timeline.plot(tmp_path / "timeline.png")
    bars = [patch for patch in figure.axes[0].patches]
    assert len(bars) == len(timeline.spans)  # one bar per span: forward, backward, weight, optimizer
    for patch, span in zip(bars, timeline.spans):
        assert patch.get_x() == pytest.approx(span.start * 1e3) and patch.get_width() == pytest.approx(
            (span.end - span.start) * 1e3)
    assert (tmp_path / "timeline.png").stat().st_size > 1000


INTERRUPTED_FIT = """
import itertools, json, sys
import torch
from torch import nn
from client_sdk import Cluster
with Cluster.local(num_shards=2) as cluster:
    torch.manual_seed(0)
    model = cluster.deploy(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
    x, y = torch.randn(256, 64), torch.randn(256, 1)
    def started(history, record):
        if record.step == 1:
            print("training", flush=True)
    history = model.fit(itertools.repeat((x, y), 10**6), microbatches=2, callbacks=[started], progress=False)
    before = model.state_dict()
    more = model.fit([(x, y)], progress=False)  # goes on from where it stopped
    print(json.dumps({"interrupted": history.interrupted, "steps": len(history.steps), "keys": sorted(before),
                      "more": len(more.steps)}), flush=True)
"""


def test_ctrl_c_stops_fit_after_the_step_under_way_and_training_goes_on(tmp_path):
    script = tmp_path / "interrupted_fit.py"
    script.write_text(INTERRUPTED_FIT)
    output = interrupted_script(script)
    assert "fit interrupted after step" in output and "call fit again to go on" in output
    result = json.loads(output.strip().splitlines()[-1])
    assert result["interrupted"] and result["steps"] >= 1 and result["more"] == 1
    assert result["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
