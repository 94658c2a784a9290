"""Benchmark: median training-step time of the seed residual model, several ways, in one run.

    python -m bench.train_step [--batches 32 256] [--steps 40] [--rounds 3] [--adam JSON] [--grpc-links]
                               [--between-hosts]

1. one process (the baseline; its best of 1 and 2 torch threads),
2. shardtrain on 3 local shard processes: the PyTorch-shaped loop, and model.train_step
   (--microbatches micro-batches pipelined under 1F1B, the loss on the last stage),
3. torch.distributed.rpc + distributed autograd + DistributedOptimizer on 3 worker processes,
4. the floor (bench/floor.py): the same loop on 3 processes in the leanest Python that keeps its
   rules, raw bytes on Unix socket pairs, each stage with the intra-op thread count that was faster
   for one process in the same round; what is left of shardtrain's time above it is the
   framework's own cost, and what is left of the floor's above one process is the host's.
The four take turns for --rounds rounds, every other round in the opposite order (this machine is
shared and noisy, and which runs after which matters there); each figure is the median of every
timed step of its rounds. Prints the medians and the ratios shardtrain/one-process and
shardtrain/torch.rpc, then the floor against one process and the loop against the floor. With
--grpc-links, a second cluster whose shards keep every Link item on the gRPC stream (--local-links
off --tcp-links off) takes its turn too, and the loop's time there is printed against the loop's with local links.
With --between-hosts, a cluster whose shards each run in a network namespace of their own (bench/namespaces.py:
own addresses on veth pairs, own /dev/shm; root only) takes its turn as well, and the loop's time there is
printed against the loop's on one host: what separate machines add, on the same cores.
Every way steps with torch.optim.Adam(lr=3e-3), plus --adam's keyword arguments. With the defaults,
Adam is most of one process's step on CPU: its sqrt goes through MKL's vector math, which takes a
slow path for every exact zero (the second moments of units that never get a gradient), so the
split's three optimizers, which run at once, hide much of the framework's cost; `--adam
'{"fused": true}'` times every way with PyTorch's fused Adam, which takes no such path, and shows
that cost against a much shorter step.
Before and after the rounds it measures how much two of the host's cores do at once against one,
and before them how soon a process runs once another wakes it (bench/host.py): on a shared host
both change, and with them what the shards can overlap and what each hand-off costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

# Every process of the run (this one, the torch.rpc workers it spawns, the local shards) gets the
# OpenMP setting Cluster.local gives its shards, so the comparison is like for like.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 - after the OpenMP setting, which is read when torch loads

from bench.floor import LR, Floor  # noqa: E402
from bench.namespaces import SeparateHosts, unavailable  # noqa: E402
from bench.floor import one_process as seed_model_and_adam  # noqa: E402
from bench.host import describe_wake_up, parallel_throughput, wake_up  # noqa: E402
from bench.rpc_baseline import _make_data, run_rpc_baseline  # noqa: E402
from client_sdk import Cluster  # noqa: E402
from client_sdk.seed_models import TEST_RESIDUAL_SMALL  # noqa: E402


def timed_steps(step: Callable[[], None], steps: int, warmup: int) -> list[float]:
    """Wall time of each of `steps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def single_process(batch: int, steps: int, warmup: int, threads: int, adam: dict) -> list[float]:
    """Step times of the whole model in this process with `threads` intra-op threads."""
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    model, optimizer = seed_model_and_adam(adam)
    x, y = _make_data(batch, 0)

    def step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    try:
        return timed_steps(step, steps, warmup)
    finally:
        torch.set_num_threads(default)


def shardtrain(model, batch: int, steps: int, warmup: int) -> list[float]:
    """Step times of the model deployed over the cluster's shards."""
    x, y = _make_data(batch, 0)

    def step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.step()
        model.zero_grad()
    return timed_steps(step, steps, warmup)


def shardtrain_pipelined(model, batch: int, steps: int, warmup: int, microbatches: int) -> list[float]:
    """Step times of model.train_step: micro-batches pipelined over the stages, loss on the last stage."""
    x, y = _make_data(batch, 0)
    return timed_steps(lambda: model.train_step(x, y, "MSELoss", microbatches=microbatches), steps, warmup)


def deploy(cluster: Cluster, adam: dict):
    """The seed model on the cluster's shards, from the same initial weights every time."""
    torch.manual_seed(0)
    return cluster.deploy(TEST_RESIDUAL_SMALL, optimizer=(torch.optim.Adam, {"lr": LR, **adam}))


def grpc_links_cluster() -> Cluster:
    """A local cluster whose shards carry every Link item on the gRPC stream (no local or TCP links)."""
    os.environ["SHARDTRAIN_LOCAL_LINKS"] = os.environ["SHARDTRAIN_TCP_LINKS"] = "off"  # read as services start
    try:
        return Cluster.local(num_shards=3)
    finally:
        del os.environ["SHARDTRAIN_LOCAL_LINKS"], os.environ["SHARDTRAIN_TCP_LINKS"]


def floor_steps(floor: Floor, batch: int, steps: int, warmup: int, threads: int) -> list[float]:
    """Step times of the floor's loop (bench/floor.py), its stages on `threads` intra-op threads."""
    x, y = _make_data(batch, 0)
    floor.set_threads(threads)
    return timed_steps(lambda: floor.train_step(x, y), steps, warmup)


def measure(cluster: Cluster, floor: Floor, batch: int, args,
            grpc_cluster: Cluster | None = None, hosts_cluster: Cluster | None = None) -> dict[str, float]:
    """Median step time of each way, the ways taking turns for args.rounds rounds.

    Every other round runs the ways in the opposite order: on the development machine, of two
    clusters taking turns, the one that ran second in a round was 0.3-1 ms a step slower whichever
    it was (two A/Bs of 6 and 8 rounds), as large as the differences being measured.
    """
    model = deploy(cluster, args.adam)
    grpc_model = deploy(grpc_cluster, args.adam) if grpc_cluster is not None else None
    hosts_model = deploy(hosts_cluster, args.adam) if hosts_cluster is not None else None
    times: dict[str, list[float]] = {"shardtrain": [], "train_step": [], "1 thread": [], "2 threads": [],
                                     "torch.rpc": [], "floor": [], "gRPC links": [], "between hosts": []}

    def one_process() -> None:  # then the floor, on the thread count one process was faster with
        one = single_process(batch, args.steps, args.warmup, 1, args.adam)
        two = single_process(batch, args.steps, args.warmup, 2, args.adam)
        times["1 thread"] += one
        times["2 threads"] += two
        times["floor"] += floor_steps(floor, batch, args.steps, args.warmup,
                                      1 if statistics.median(one) <= statistics.median(two) else 2)

    def loop() -> None:
        times["shardtrain"] += shardtrain(model, batch, args.steps, args.warmup)

    def grpc_loop() -> None:
        times["gRPC links"] += shardtrain(grpc_model, batch, args.steps, args.warmup)

    def hosts_loop() -> None:
        times["between hosts"] += shardtrain(hosts_model, batch, args.steps, args.warmup)

    def pipelined() -> None:
        times["train_step"] += shardtrain_pipelined(model, batch, args.steps, args.warmup, args.microbatches)

    def rpc() -> None:
        # Same intra-op threads as the shards get (torch's default: one per core), same OpenMP policy.
        times["torch.rpc"] += run_rpc_baseline(batch, args.steps, args.warmup, threads_per_process=os.cpu_count() or 1,
                                               adam=args.adam)

    ways = ([loop] + ([grpc_loop] if grpc_model is not None else []) + ([hosts_loop] if hosts_model is not None else [])
            + [pipelined, one_process, rpc])
    for round_ in range(args.rounds):
        for way in ways if round_ % 2 == 0 else reversed(ways):
            way()
    return {name: statistics.median(values) for name, values in times.items() if values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4, help="for the model.train_step row")
    parser.add_argument("--adam", type=json.loads, default={}, metavar="JSON",
                        help="keyword arguments for every way's Adam besides the learning rate, "
                             "e.g. '{\"fused\": true}'")
    parser.add_argument("--grpc-links", action="store_true",
                        help="also time the loop with every Link item on gRPC (shards with --local-links off)")
    parser.add_argument("--between-hosts", action="store_true",
                        help="also time the loop with each shard in a network namespace of its own (root only)")
    args = parser.parse_args()
    if args.between_hosts and (reason := unavailable()):
        parser.error(f"--between-hosts: {reason}")
    host_before = parallel_throughput(rounds=1)[0]
    wake = wake_up()
    grpc_cluster = grpc_links_cluster() if args.grpc_links else None
    hosts = SeparateHosts(3).__enter__() if args.between_hosts else None
    hosts_cluster = None
    try:
        hosts_cluster = Cluster.local(num_shards=3, hosts=hosts) if hosts is not None else None
        with Cluster.local(num_shards=3) as cluster, Floor(adam=args.adam) as floor:
            results = [(batch, measure(cluster, floor, batch, args, grpc_cluster, hosts_cluster))
                       for batch in args.batches]
    finally:
        for extra in (grpc_cluster, hosts_cluster):
            if extra is not None:
                extra.close()
        if hosts is not None:
            hosts.close()
    print(f"{'batch':>5} {'1 process':>10} {'(1 thr / 2 thr)':>16} {'shardtrain':>11} {'train_step':>11} "
          f"{'torch.rpc':>10} {'st/1proc':>9} {'st/rpc':>7} {'ts/1proc':>9} {'ts/rpc':>7}")
    for batch, m in results:
        single = min(m["1 thread"], m["2 threads"])
        print(f"{batch:5d} {single * 1e3:8.2f}ms {m['1 thread'] * 1e3:7.2f}/{m['2 threads'] * 1e3:.2f}ms "
              f"{m['shardtrain'] * 1e3:9.2f}ms {m['train_step'] * 1e3:9.2f}ms {m['torch.rpc'] * 1e3:8.2f}ms "
              f"{m['shardtrain'] / single:8.2f}x {m['shardtrain'] / m['torch.rpc']:6.2f}x "
              f"{m['train_step'] / single:8.2f}x {m['train_step'] / m['torch.rpc']:6.2f}x")
    for batch, m in results:
        single = min(m["1 thread"], m["2 threads"])
        above = m["shardtrain"] - m["floor"]
        print(f"batch {batch}: the floor {m['floor'] * 1e3:.2f} ms, {m['floor'] / single:.2f}x one process; "
              f"the shardtrain loop is {m['shardtrain'] / m['floor']:.2f}x the floor"
              + (f" ({above * 1e3:.2f} ms a step of the framework's own)" if above > 0 else ""))
    for batch, m in results:
        if "gRPC links" in m:
            print(f"batch {batch}: the loop with every Link item on gRPC {m['gRPC links'] * 1e3:.2f} ms, "
                  f"{m['gRPC links'] / m['shardtrain']:.2f}x the loop with local links")
        if "between hosts" in m:
            print(f"batch {batch}: the loop between hosts (a network namespace per shard) "
                  f"{m['between hosts'] * 1e3:.2f} ms, "
                  f"{m['between hosts'] / m['shardtrain']:.2f}x the loop on one host")
    print(f"shardtrain: the PyTorch-shaped loop (model(x), loss.backward(), model.step()); train_step: "
          f"model.train_step with {args.microbatches} micro-batches, 1F1B, the loss on the last stage.")
    print(f"optimizer: torch.optim.Adam with lr={LR}" + "".join(f", {k}={v!r}" for k, v in args.adam.items())
          + " in every way")
    print("floor: the same loop on 3 processes in the leanest Python that keeps its rules, each stage on the "
          "thread count one process was faster with (python -m bench.floor)")
    print(f"host: two processes at once did {host_before:.2f}x the work of one alone before the rounds, "
          f"{parallel_throughput(rounds=1)[0]:.2f}x after (2.00: two free cores; python -m bench.host)")
    print(f"host, before the rounds: {describe_wake_up(wake)}")


if __name__ == "__main__":
    main()
