"""A deploy's work, bounded and not repeated: its deadlines grow with its size (a stage of many layers loads under a
control-plane deadline far shorter than its work, and the coordinator answers and keeps its shards meanwhile), and
shards that compute alike measure the layers once for all; deploys from several threads of one process take turns
capturing."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from torch import nn

from client_sdk import Cluster
from client_sdk import deploy_steps as steps
from coordinator.servicer import MEASURED
from shardtrain import deploy_deadlines, rpc
from shardtrain.settings import Timeouts
from shardtrain.v1 import coordinator_pb2
from tests.integration.test_metrics import scrape, total

LAYERS = 300
CONTROL = 2.0  # seconds: shorter than loading LAYERS layers on any machine, so a fixed deadline fails


def many_layers(count: int) -> coordinator_pb2.DeployRequest:
    """A raw DeployRequest of `count` copies of one captured Linear layer, all on one stage."""
    module = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    captured = steps.capture(module, torch.randn(4, 16), (), None, None, None)
    options = steps.DeployOptions.checked(
        optimizer=(torch.optim.SGD, {"lr": 0.1}), compression="none", replicas=1, balance="parameters",
        split_points=(), layers_per_stage=(), num_stages=1, virtual_stages=1, snapshot_every=0, take_over=False,
        weights=None, recompute="never", precision="fp32")
    request = steps.plan(captured, options)
    one = request.layers[0]
    del request.layers[:]
    for index in range(count):
        layer = request.layers.add()
        layer.CopyFrom(one)
        layer.index = index
    return request


def slowest_answer_while(cluster: Cluster, work) -> float:
    """Runs `work()` while polling the coordinator's ListShards; the slowest answer's seconds."""
    done, answers = threading.Event(), []

    async def poll() -> None:
        peer = rpc.Peer("probe", cluster.address, rpc.COORDINATOR_SERVICE, cluster.security, timeout=30)
        try:
            while not done.is_set():
                started = time.monotonic()
                await peer.call("ListShards", coordinator_pb2.ListShardsRequest())
                answers.append(time.monotonic() - started)
        finally:
            await peer.close()
    poller = threading.Thread(target=lambda: asyncio.run(poll()))
    poller.start()
    try:
        work()
    finally:
        done.set()
        poller.join()
    return max(answers)


def test_a_stage_of_many_layers_loads_under_a_short_control_deadline():
    request = many_layers(LAYERS)
    assert deploy_deadlines.load(CONTROL, request.layers) > 20 * CONTROL
    with Cluster.local(2, timeouts=Timeouts(control=CONTROL)) as cluster:
        responses = []
        slowest = slowest_answer_while(cluster, lambda: responses.append(
            cluster._io.run(cluster._deploy_call(request))))
        assert [(s.first_layer, s.end_layer) for s in responses[0].stages] == [(0, LAYERS)]
        assert slowest < 1.0, f"the coordinator took {slowest:.2f} s to answer ListShards during the deploy"
        assert len(cluster.shards()) == 2  # neither shard's heartbeat went unanswered long enough to expire


def test_deadlines_grow_with_layers_program_bytes_and_measuring_shards():
    small, large = many_layers(2), many_layers(20)
    assert deploy_deadlines.load(5.0, small.layers) > 5.0
    assert deploy_deadlines.load(5.0, large.layers) > deploy_deadlines.load(5.0, small.layers)
    assert deploy_deadlines.profile(5.0, large.layers) > deploy_deadlines.load(5.0, large.layers)
    assert deploy_deadlines.deploy(5.0, large.layers, 4, measured=True) > \
        deploy_deadlines.deploy(5.0, large.layers, 2, measured=True) > \
        deploy_deadlines.deploy(5.0, large.layers, 2, measured=False)
    bigger = large.layers[0].program + b" " * (1 << 20)
    assert deploy_deadlines.program_bytes([type(large.layers[0])(program=bigger)]) == len(bigger)


def test_shards_of_one_host_that_compute_alike_measure_the_layers_once():
    torch.manual_seed(0)
    with Cluster.local(3, metrics=True) as cluster:
        model = cluster.deploy(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 1)),
                               example_input=torch.randn(4, 8), balance="time")
        assert len(model.placements) == 3 and {p.cost_unit for p in model.placements} == {MEASURED}
        calls = [total(scrape(url), "shardtrain_requests_total", method="ProfileLayers", code="OK")
                 for url in cluster.metrics_urls.values()]
        assert sorted(calls) == [0, 0, 0, 1], calls  # the coordinator's, and one shard's


def test_deploys_and_custom_losses_from_several_threads_at_once_each_train_as_one_process():
    """torch.export's tracing state is global to a process: two threads capturing at once broke each other's traces,
    and a deploy was refused as a model that cannot be captured. Each thread here drives its own cluster: deploys
    (a whole model, whose capture traces it) and train_steps under a loss of its own (captured at the first step)."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))

    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(2)]
    local = net()
    optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
    for x, y in batches:
        optimizer.zero_grad()
        ((local(x) - y) ** 2).mean().backward()
        optimizer.step()
    results: dict[int, object] = {}

    def train(index: int) -> None:
        try:
            with Cluster.local(num_shards=2) as cluster:
                for _ in range(3):
                    model = cluster.deploy(net(), (torch.optim.SGD, {"lr": 0.1}), example_inputs=(batches[0][0],))
                    for x, y in batches:
                        model.train_step(x, y, lambda out, target: ((out - target) ** 2).mean())
                    results[index] = model.state_dict()
        except Exception as error:  # noqa: BLE001 - reported by the test's thread
            results[index] = error

    threads = [threading.Thread(target=train, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert sorted(results) == [0, 1], "a thread did not finish"
    for index, result in results.items():
        assert isinstance(result, dict), f"thread {index}: {result!r}"
        for key, value in local.state_dict().items():
            torch.testing.assert_close(result[key], value, rtol=1e-5, atol=1e-6)
