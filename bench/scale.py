"""Benchmark: how a deployment's costs grow with its size.

    python -m bench.scale [--registered 4 100 1000] [--stages 4 16 64] [--microbatches 256] [--shards 16]

1. The coordinator with N registered shards: 4 live local shards, then N - 4 registrations from this
   client at addresses where nothing listens (a crowd of registered hosts with no processes behind
   them). Median time of one registration, of ListShards, and of a deploy of a small model on the 4
   live shards, which registered first (the coordinator probes only the shards a deploy takes).
2. Planning a step of p stages and m micro-batches under 1F1B: every stage's action list, as the
   shards compute it, and the timeline simulator's makespan of the whole schedule.
3. `--shards` local shard processes (8 stages x 2 replicas by default) train a 16-layer MLP with
   train_step, checked against one process: seconds to start and to deploy, and the median step.
Each figure is printed with its growth against the smallest size beside the size's own growth
(so linear growth shows as equal columns).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.floor import median_time  # noqa: E402
from client_sdk import Cluster  # noqa: E402
from shardtrain import rpc, schedule  # noqa: E402
from shardtrain.v1 import coordinator_pb2, shard_pb2  # noqa: E402

LIVE = 4


def _small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(LIVE) for layer in (nn.Linear(16, 16), nn.Tanh())])


def coordinator_rows(counts: list[int], repeats: int) -> list[tuple[int, float, float, float]]:
    """(registered, one registration, ListShards, deploy) in seconds, medians."""
    rows = []
    with Cluster.local(num_shards=LIVE) as cluster:
        def call(method, request):
            return cluster._io.run(cluster._coordinator.call(method, request))
        live = call("ListShards", coordinator_pb2.ListShardsRequest()).shards[0]

        async def instance() -> str:  # what the live shard registers with, as its Describe says
            peer = rpc.Peer("live shard", live.address, rpc.SHARD_SERVICE, cluster.security, 10)
            try:
                return (await peer.call("Describe", shard_pb2.DescribeRequest())).instance
            finally:
                await peer.close()
        heartbeat = coordinator_pb2.RegisterShardRequest(address=live.address, device=live.device,
                                                         memory_bytes=live.memory_bytes,
                                                         instance=cluster._io.run(instance()))
        fake = 0
        for count in counts:
            while len(cluster.shards()) < count:  # 127.0.0.2: loopback, where nothing listens
                call("RegisterShard", coordinator_pb2.RegisterShardRequest(address=f"127.0.0.2:{10000 + fake}",
                                                                         device="cpu"))
                fake += 1
            register = median_time(lambda: call("RegisterShard", heartbeat), repeats * 10)  # a live shard's heartbeat
            listing = median_time(lambda: call("ListShards", coordinator_pb2.ListShardsRequest()), repeats * 10)
            deploy = median_time(lambda: cluster.deploy(_small_model(), num_stages=LIVE), repeats)
            assert len(cluster.shards()) == count, "a deploy probed (and dropped) registrations it does not take"
            rows.append((count, register, listing, deploy))
    return rows


def planning_rows(stages: list[int], microbatches: int) -> list[tuple[int, int, float, float]]:
    """(p, m, every stage's action list, the simulated makespan) in seconds."""
    rows = []
    for p in stages:
        actions = median_time(lambda: [schedule.stage_actions("1f1b", s, p, microbatches) for s in range(p)], 3)
        simulated = median_time(lambda: schedule.makespan("1f1b", p, microbatches), 3)
        rows.append((p, microbatches, actions, simulated))
    return rows


def many_shards(shards: int, replicas: int, steps: int) -> dict[str, float]:
    """Starts `shards` local shards, deploys 16 layers over shards / replicas stages, trains `steps` steps of
    train_step and compares the weights with one process's full-batch steps."""
    torch.manual_seed(0)
    net = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(16, 16), nn.Tanh())])
    local = copy.deepcopy(net)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 16, generator=generator), torch.randn(64, 16, generator=generator))
               for _ in range(steps)]
    start = time.perf_counter()
    with Cluster.local(num_shards=shards) as cluster:
        started = time.perf_counter() - start
        start = time.perf_counter()
        model = cluster.deploy(net, optimizer=(torch.optim.SGD, {"lr": 0.05}), num_stages=shards // replicas,
                               replicas=replicas)
        deployed = time.perf_counter() - start
        times = []
        for x, y in batches:
            begin = time.perf_counter()
            model.train_step(x, y, "MSELoss", microbatches=4)
            times.append(time.perf_counter() - begin)
            nn.functional.mse_loss(local(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        trained = model.state_dict()
    difference = max((trained[k] - v).abs().max().item() for k, v in local.state_dict().items())
    return {"start": started, "deploy": deployed, "step": statistics.median(times[1:]), "difference": difference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--registered", type=int, nargs="+", default=[4, 100, 1000])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--shards", type=int, default=16, help="local shards for part 3 (0: skip it)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = coordinator_rows(sorted(args.registered), args.repeats)
    base = rows[0]
    print("1. the coordinator with N registered shards (deploys on the 4 that registered first)")
    print(f"{'N':>6} {'x N':>6} {'register':>10} {'x':>6} {'ListShards':>11} {'x':>6} {'deploy':>10} {'x':>6}")
    for count, register, listing, deploy in rows:
        print(f"{count:6d} {count / base[0]:6.1f} {register * 1e3:8.2f}ms {register / base[1]:6.2f} "
              f"{listing * 1e3:9.2f}ms {listing / base[2]:6.2f} {deploy * 1e3:8.1f}ms {deploy / base[3]:6.2f}")
    plans = planning_rows(sorted(args.stages), args.microbatches)
    first = plans[0]
    print(f"2. planning a 1F1B step of m = {args.microbatches} micro-batches")
    print(f"{'p':>6} {'x p':>6} {'actions':>10} {'every stage':>12} {'x':>6} {'simulated':>10} {'x':>6}")
    for p, m, actions, simulated in plans:
        print(f"{p:6d} {p / first[0]:6.1f} {2 * p * m:10d} {actions * 1e3:10.1f}ms {actions / first[2]:6.2f} "
              f"{simulated * 1e3:8.1f}ms {simulated / first[3]:6.2f}")
    if args.shards:
        result = many_shards(args.shards, args.replicas, args.steps)
        print(f"3. {args.shards} local shards, {args.shards // args.replicas} stages x {args.replicas} replicas: "
              f"started in {result['start']:.1f} s, deployed in {result['deploy']:.1f} s, a train_step (m = 4) "
              f"{result['step'] * 1e3:.0f} ms; largest weight difference from one process "
              f"{result['difference']:.1e}")


if __name__ == "__main__":
    main()
