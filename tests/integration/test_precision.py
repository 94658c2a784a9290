"""Mixed precision: deploy(precision="bf16") has every stage compute under autocast with float32 weights, and the
tensors between stages travel in bfloat16, half the bytes; training equals the same autocast training in one
process within bf16's rounding of the values that cross each cut. precision="fp16" scales the loss as
torch.amp.GradScaler does, and a step whose gradients overflow is skipped on every stage."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from shardtrain.errors import InvalidArgument
from tests.integration.test_library_models import SGD, deploy, largest_difference, llama, text_batches, \
    train_in_the_loop
from tests.integration.test_metrics import scrape, total

# The cuts round what crosses them (a residual stream autocast keeps in float32) to bfloat16, which one process
# does not: 8 bits of mantissa, about 4e-3 of a value, on the activations and gradients of a step.
LOSS_TOLERANCE = 1e-3  # relative, over 5 steps
WEIGHT_TOLERANCE = 1e-3  # absolute, against SGD steps of up to 5e-2


@pytest.fixture(scope="module")
def cluster():
    with Cluster.local(num_shards=4, metrics=True) as cluster:
        yield cluster


def test_a_llama_in_bf16_trains_as_autocast_does_in_one_process_with_float32_weights(cluster):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = llama()
    batches = text_batches(5)
    local = copy.deepcopy(model)
    optimizer = SGD[0](local.parameters(), **SGD[1])
    expected = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = local(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    remote = deploy(cluster, model, batches, optimizer=SGD, precision="bf16", balance="parameters")
    assert len(remote.placements) == 4
    losses = train_in_the_loop(remote, batches, remote)
    assert losses == pytest.approx(expected, rel=LOSS_TOLERANCE)
    state = remote.state_dict()
    assert all(value.dtype == local.state_dict()[key].dtype for key, value in state.items())
    difference, key = largest_difference(state, local.state_dict())
    assert difference < WEIGHT_TOLERANCE, key


def two_layers() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def sent_bytes(cluster) -> float:
    return sum(total(scrape(url), "shardtrain_tensor_bytes_total", direction="sent", kind="forward")
               for url in cluster.metrics_urls.values())


def test_stages_compute_under_autocast_and_send_half_the_bytes(cluster):
    x = torch.randn(32, 64)
    net = two_layers()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_output = net(x).float()
    exact = {"activations": "none", "gradients": "none", "residuals": "none"}
    model = cluster.deploy(two_layers(), layers_per_stage=[2, 1], precision="bf16", compression=exact)
    with torch.no_grad():
        assert torch.allclose(model(x), autocast_output, atol=1e-6)  # bf16 products, not float32's
        assert not torch.allclose(model(x), net(x), atol=1e-4)

    sent = {}
    for precision in ("fp32", "bf16"):
        model = cluster.deploy(two_layers(), layers_per_stage=[2, 1], precision=precision)
        before = sent_bytes(cluster)
        with torch.no_grad():
            model(x)
        sent[precision] = sent_bytes(cluster) - before
    assert sent["bf16"] * 2 == sent["fp32"] > 0, sent


def scaled_locally(steps: int, x, y):
    """One process under fp16 autocast with torch.amp.GradScaler: the losses, the weights, the final scale."""
    local = two_layers()
    optimizer, scaler, losses = torch.optim.SGD(local.parameters(), lr=0.1), torch.amp.GradScaler("cpu"), []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(local(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, local.state_dict(), scaler.get_scale()


def test_fp16_scales_the_loss_as_grad_scaler_does_and_skips_a_step_that_overflows_on_every_stage(cluster):
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    expected, weights, scale = scaled_locally(4, x, y)
    model = cluster.deploy(two_layers(), optimizer=(torch.optim.SGD, {"lr": 0.1}), layers_per_stage=[2, 1],
                           precision="fp16")
    losses = []
    for _ in range(4):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        model.step()
        model.zero_grad()
        losses.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-6)
    assert largest_difference(model.state_dict(), weights)[0] < 1e-6
    assert model.loss_scaler.scale == scale and model.loss_scaler.skipped == 0

    model.loss_scaler.scale = 1e38  # the gradients overflow float16 on their way between stages
    before = model.state_dict()
    nn.functional.mse_loss(model(x), y).backward()
    model.step()
    assert model.loss_scaler.skipped == 1 and model.loss_scaler.scale == 5e37
    assert largest_difference(model.state_dict(), before)[0] == 0

    pipelined = cluster.deploy(two_layers(), optimizer=(torch.optim.SGD, {"lr": 0.1}), layers_per_stage=[2, 1],
                               precision="fp16")
    losses = [pipelined.train_step(x, y, "MSELoss", microbatches=2) for _ in range(4)]
    assert losses == pytest.approx(expected, rel=1e-4)  # micro-batches sum their float16 gradients in another order
    assert largest_difference(pipelined.state_dict(), weights)[0] < 1e-4


def test_an_unknown_precision_is_refused(cluster):
    with pytest.raises(InvalidArgument, match=r"precision must be one of \['fp32', 'bf16', 'fp16'\]"):
        cluster.deploy(two_layers(), precision="fp8")
