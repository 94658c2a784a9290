"""A deploy's deadlines grow with its size: a stage of many layers loads under a control-plane deadline far shorter
than its work, and the coordinator answers (and keeps its shards) while it runs."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from torch import nn

from client_sdk import Cluster
from client_sdk import deploy_steps as steps
from shardtrain import deploy_deadlines, rpc
from shardtrain.settings import Timeouts
from shardtrain.v1 import coordinator_pb2

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
