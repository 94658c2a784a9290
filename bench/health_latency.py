"""Benchmark: how fast a shard answers health checks and Describe while it does heavy work.

    python -m bench.health_latency [--stage-mb 200] [--steps 5]

A probe in a process of its own asks one shard of a two-shard local cluster, every 10 ms, for its
grpc.health.v1 status (no token, as a load balancer or Kubernetes would) and for Describe (with the token), and
records how long each answer took. It does so while the cluster is idle (the baseline), while a deploy loads
a model of `--stage-mb` MiB of weights per stage (the stage programs are built and the weights streamed in),
while training steps run, and while the shard's stage writes a checkpoint. Printed per phase: the median, the
99th percentile and the slowest answer of each, against the 100 ms a probe should never wait.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

from client_sdk import Cluster

WIDTH = 1024
PROBE = r"""
import asyncio, json, sys, time
import grpc
from shardtrain.settings import Security
from shardtrain import rpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardtrain.v1 import shard_pb2

async def main(address, token):
    channel = grpc.aio.insecure_channel(address)
    check = health_pb2_grpc.HealthStub(channel).Check
    peer = rpc.Peer("shard", address, rpc.SHARD_SERVICE, Security(token=token), 10)
    stop = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    health, describe = [], []
    print("ready", flush=True)
    while not stop.done():
        start = time.perf_counter()
        await check(health_pb2.HealthCheckRequest(), timeout=30)
        middle = time.perf_counter()
        await peer.call("Describe", shard_pb2.DescribeRequest())
        end = time.perf_counter()
        health.append(middle - start)
        describe.append(end - middle)
        await asyncio.sleep(0.01)
    print(json.dumps({"health": health, "describe": describe}), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


class Probe:
    """The probe process, asking `address` from start() until stop()."""

    def __init__(self, address: str, token: str):
        self._process = subprocess.Popen([sys.executable, "-c", PROBE, address, token], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(
                                             os.path.abspath(__file__))))
        assert self._process.stdout.readline().strip() == "ready"

    def stop(self) -> dict[str, list[float]]:
        out, _ = self._process.communicate("", timeout=120)
        return json.loads(out.strip().splitlines()[-1])


def summary(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{statistics.median(ordered) * 1e3:6.1f} {p99 * 1e3:7.1f} {ordered[-1] * 1e3:7.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage-mb", type=int, default=200, help="weights per stage, MiB")
    parser.add_argument("--steps", type=int, default=5, help="training steps in the training phase")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    per_stage = max(1, round(args.stage_mb / 4))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(2 * per_stage)])
    x, y = torch.randn(64, WIDTH), torch.randn(64, WIDTH)
    phases: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as root, Cluster.local(num_shards=2, checkpoint_dir=root) as cluster:
        target = cluster._services.shard_addresses[0]
        token = cluster.security.token

        def phase(name: str, work) -> None:
            probe = Probe(target, token)
            time.sleep(0.3)
            work()
            time.sleep(0.1)
            phases[name] = probe.stop()

        phase("idle", lambda: time.sleep(2))
        holder = {}
        phase("deploy", lambda: holder.update(model=cluster.deploy(
            net, optimizer=(torch.optim.Adam, {"lr": 1e-4}), split_points=[per_stage])))
        model = holder["model"]

        def train() -> None:
            for _ in range(args.steps):
                model.train_step(x, y, "MSELoss")
            model.synchronize()
        phase("train", train)
        phase("checkpoint", lambda: model.save_checkpoint(os.path.join(root, "step"), on_shards=True))
    print(f"{2 * per_stage * 4} MiB of weights on two shards; probes of the first shard every 10 ms, milliseconds")
    print(f"{'phase':>11} {'probes':>7} | {'health: median':>14} {'p99':>7} {'max':>7} | {'Describe: median':>16} "
          f"{'p99':>7} {'max':>7}")
    for name, times in phases.items():
        print(f"{name:>11} {len(times['health']):>7} | {summary(times['health']):>30} | "
              f"{summary(times['describe']):>32}", flush=True)
    slowest = max(max(times["health"]) for times in phases.values())
    print(f"slowest health answer {slowest * 1e3:.1f} ms: {slowest / 0.1:.2f}x the 100 ms budget")


if __name__ == "__main__":
    main()
