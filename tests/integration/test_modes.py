"""Training and eval modes on shards: BatchNorm and Dropout behave as in one process, in train() and eval()."""

from __future__ import annotations

import copy
import pathlib
import runpy
import warnings

import pytest
import torch
from torch import nn

from shardtrain import auth, rpc, wire
from shardtrain.errors import InvalidArgument
from shardtrain.residuals import OUTPUT
from shardtrain.v1 import shard_pb2
from tests.integration.training import largest_difference, regression_batches, train_locally, train_remotely

SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def batchnorm_net() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                         nn.Tanh(), nn.Linear(8, 1))


def dropout_net() -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in module.state_dict().items()}


def trained_batchnorm(cluster, steps: int):
    """(the deployed batchnorm_net trained `steps` steps on 3 shards, a local copy holding what it learnt)."""
    net = batchnorm_net()
    model = cluster.deploy(net, optimizer=SGD, split_points=[1, 4])
    train_remotely(model, regression_batches(steps=steps, batch=16, features=3))
    local = copy.deepcopy(net)
    local.load_state_dict(model.state_dict())
    return model, local


def test_batchnorm_trains_like_one_process_running_statistics_included(cluster4):
    net = batchnorm_net()
    batches = regression_batches(steps=20, batch=16, features=3)
    model = cluster4.deploy(net, optimizer=SGD, split_points=[1, 4])  # each BatchNorm on a shard of its own
    assert model.training
    train_remotely(model, batches)
    trained = model.state_dict()
    expected = train_locally(net, batches, SGD)
    assert largest_difference(trained, expected) <= 1e-5
    assert trained["1.num_batches_tracked"].item() == trained["4.num_batches_tracked"].item() == 20


def test_a_batch_of_one_row_through_batchnorm_in_training_is_refused_as_pytorch_refuses_it(cluster4):
    """Capture drops F.batch_norm's Python check; the stage makes it before anything runs, so the running
    statistics stay finite and unchanged, in the loop and in pipelined micro-batches of one row."""
    model, local = trained_batchnorm(cluster4, steps=2)
    before = model.state_dict()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        local(torch.ones(1, 3))
    with pytest.raises(InvalidArgument, match=r"layer 1 \(BatchNorm1d.*Expected more than 1 value per channel when "
                                              r"training, got input size \[1, 8\]"):
        torch.nn.functional.mse_loss(model(torch.ones(1, 3)), torch.ones(1, 1)).backward()
        model.synchronize()
    with pytest.raises(InvalidArgument, match="Expected more than 1 value per channel"):
        model.train_step(torch.ones(4, 3), torch.ones(4, 1), microbatches=4)
    assert largest_difference(model.state_dict(), before) == 0
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(torch.ones(1, 3)), local.eval()(torch.ones(1, 3)), atol=1e-6)


def test_eval_mode_normalises_by_the_running_statistics_and_leaves_them_alone(cluster4):
    model, local = trained_batchnorm(cluster4, steps=5)
    trained = state_of(local)
    x = regression_batches(steps=1, batch=5, features=3, seed=9)[0][0]

    assert model.eval() is model and not model.training
    with torch.no_grad():
        outputs = [model(x) for _ in range(3)]
        expected = local.eval()(x)
    assert all(torch.equal(output, outputs[0]) for output in outputs)
    assert (outputs[0] - expected).abs().max().item() <= 1e-6
    assert largest_difference(model.state_dict(), trained) == 0  # inference moved no running statistic

    assert model.train() is model and model.training
    with torch.no_grad():  # training mode normalises by the batch and counts it, as one process does
        assert (model(x) - local.train()(x)).abs().max().item() <= 1e-6
    assert largest_difference(model.state_dict(), state_of(local)) <= 1e-6
    assert model.state_dict()["1.num_batches_tracked"].item() == trained["1.num_batches_tracked"].item() + 1


def test_training_in_eval_mode_keeps_batchnorm_frozen_as_one_process_does(cluster4):
    net = batchnorm_net()
    batches = regression_batches(steps=8, batch=16, features=3)
    model = cluster4.deploy(net.eval(), optimizer=SGD, split_points=[2, 5])
    assert not model.training  # the handle starts in the model's mode
    train_remotely(model, batches)
    local = copy.deepcopy(net).eval()
    expected = train_locally(local, batches, SGD)
    trained = model.state_dict()
    assert largest_difference(trained, expected) <= 1e-5
    assert torch.equal(trained["1.running_mean"], net.state_dict()["1.running_mean"])  # frozen
    assert not torch.equal(trained["0.weight"], net.state_dict()["0.weight"])          # trained


def test_dropout_drops_in_training_mode_only_and_backward_uses_the_forwards_mask(cluster4):
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16))
    with torch.no_grad():
        for linear in (net[0], net[2]):  # identities: the output is the dropped input, scaled by 2
            linear.weight.copy_(torch.eye(16))
            linear.bias.zero_()
    model = cluster4.deploy(net, optimizer=(torch.optim.SGD, {"lr": 0.0}), split_points=[1, 2])
    x = (torch.rand(8, 16) + 0.5).requires_grad_(True)
    pred = model(x)
    pred.sum().backward()
    kept = pred.detach() != 0
    assert 0.2 < kept.float().mean().item() < 0.8
    assert torch.allclose(pred.detach()[kept], 2 * x.detach()[kept])
    assert torch.equal(x.grad, kept * 2.0)  # the backward on the Dropout's shard used the forward's mask
    model.step()
    with torch.no_grad():
        assert not torch.equal(model(x), model(x))  # a fresh mask each forward

    model.eval()
    with torch.no_grad():
        outputs = [model(x) for _ in range(2)]
    assert torch.equal(outputs[0], outputs[1])
    assert torch.allclose(outputs[0], x.detach())


def test_train_step_follows_the_mode(cluster4):
    net = batchnorm_net()
    x, y = regression_batches(steps=1, batch=16, features=3)[0]
    model = cluster4.deploy(net, optimizer=SGD, split_points=[1, 4])
    model.train_step(x, y, loss_fn="MSELoss")
    expected = train_locally(net, [(x, y)], SGD)
    assert largest_difference(model.state_dict(), expected) <= 1e-5

    frozen = model.state_dict()
    model.eval().train_step(x, y, loss_fn="MSELoss")
    after = model.state_dict()
    assert torch.equal(after["1.running_var"], frozen["1.running_var"])
    assert after["1.num_batches_tracked"].item() == frozen["1.num_batches_tracked"].item()
    assert not torch.equal(after["0.weight"], frozen["0.weight"])


def test_deploy_leaves_the_model_its_modes_and_the_random_stream_as_they_were(cluster4):
    net = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 1))
    net[1].eval()  # a frozen BatchNorm inside a model in training mode
    before = state_of(net)
    torch.manual_seed(5)
    expected_draw = torch.rand(4)
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = cluster4.deploy(net, optimizer=SGD)
    assert torch.equal(torch.rand(4), expected_draw)
    assert any("['1']" in str(warning.message) for warning in caught)  # the mixed mode is not kept: said so
    assert largest_difference(state_of(net), before) == 0
    assert net.training and not net[1].training and net[2].training
    assert model.training


def test_a_forward_call_in_eval_mode_from_another_language(cluster4):
    """The one-call Forward RPC takes eval_mode as the SDK's Links do (what a client in another language sends)."""
    model, local = trained_batchnorm(cluster4, steps=3)
    x = regression_batches(steps=1, batch=4, features=3, seed=2)[0][0]

    async def forward_by_call() -> torch.Tensor:
        addresses = [placement.shard_address for placement in model.placements]
        first = rpc.Peer("stage 0", addresses[0], rpc.SHARD_SERVICE, cluster4.security, timeout=30)
        last = rpc.Peer("last stage", addresses[-1], rpc.SHARD_SERVICE, cluster4.security, timeout=30)
        for peer in (first, last):
            peer.metadata = auth.with_deployment(peer.metadata, model._clients.secret)
        try:
            key = shard_pb2.StepKey(deployment_id=model.deployment_id, step=10_000)
            header = shard_pb2.ForwardHeader(key=key, eval_mode=True)
            await first.call("Forward", wire.framed(shard_pb2.ForwardRequest, header, {"activation": x}))
            return await rpc.fetch_tensor(last, key, OUTPUT)
        finally:
            await first.close()
            await last.close()
    output = model._io.run(forward_by_call())
    with torch.no_grad():
        assert (output - local.eval()(x)).abs().max().item() <= 1e-6


def test_train_takes_a_bool(cluster4):
    model = cluster4.deploy(dropout_net(), optimizer=SGD)
    for mode in ("yes", 1, None):
        with pytest.raises(InvalidArgument, match=r"train\(mode\) takes True or False"):
            model.train(mode)
    assert model.training


def test_the_validation_example_runs_and_its_held_out_loss_is_the_one_of_its_gathered_weights():
    example = runpy.run_path(str(pathlib.Path(__file__).parents[2] / "examples" / "validation.py"))
    on_shards, here = example["main"](epochs=2, batches_per_epoch=3)
    assert abs(on_shards - here) <= 1e-6
