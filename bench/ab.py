"""A/B of shardtrain revisions: the PyTorch-shaped loop of each, timed in alternating rounds.

    python -m bench.ab [--model seed|tiny] [--batch 32] [--rounds 12] [--steps 200] REV [REV ...]

Each REV (a git revision; "." for the working tree as it is; or the directory of another checkout, such
as a worktree with an experiment not committed yet; with "+NAME=VALUE" after it, its cluster's services
get that environment variable too: `. .+SHARDTRAIN_METRICS_PORT=0` is metrics off against on) gets its own
local cluster (coordinator and 3 shards) in a child process, from a git worktree of that revision. In each round
every revision trains `--steps` steps; the order of the revisions is reversed every other round,
because on a shared host whichever cluster runs second in a round tends to be slower, and every
revision's cluster is started afresh every `--rounds-per-cluster` rounds, because one cluster can be
steadily a few percent faster than another of the same code. No round is timed while a cluster
starts up, and which revision runs first after a restart alternates as well: a fresh cluster's
first timed round tends to be its slowest, and until this was balanced a revision run against itself
(`HEAD HEAD`) came out 4-8% faster in second place, run after run. Run `HEAD HEAD` to see what the
host gives when nothing differs. What it
prints, for every revision against the first: the median of the per-round ratios of step time and
of CPU (all threads of the SDK's process and of the shards), their range, and in how many rounds
the revision was faster. A ratio of two runs minutes apart says little on a host whose speed
swings by a fifth between runs; a ratio of two runs side by side, repeated, says more.

`--model tiny` trains 6 Linear(1, 1) layers, where a step is nearly all framework (framing, the
event loop, the SDK): the model to judge a change to that machinery by. `--model seed` trains the
seed's residual model, as bench.train_step does.

A trap this avoids: the package installed for development (`pip install -e .`) finds `shardtrain`
in this checkout whatever the current directory, so a child pointed at another worktree by its
directory alone runs this checkout's shardtrain (and with PYTHONPATH set to this checkout, all of
it). Each child here has PYTHONPATH set to its worktree (and its `protos/`, for trees of the older layout).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
_MARK = "bench.ab:"  # starts the child's lines of figures
WARMUP = 100  # untimed steps before the first round: optimizer state, thread choices, caches


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time of every thread of these processes, so far. (Not bench.rpc_overhead's: the child runs this file
    against its revision's tree, whose bench/ may differ.)"""
    ticks = 0
    for pid in pids:
        for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
            with contextlib.suppress(OSError):
                fields = pathlib.Path(stat).read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _child(model_name: str, batch: int, steps: int) -> None:
    """One revision's cluster: on each line from stdin, times `steps` steps and prints [median s, CPU s] per step."""
    import torch  # the revision's torch setup happens in its own client_sdk; torch itself is shared

    from client_sdk import Cluster
    from client_sdk.seed_models import TEST_RESIDUAL_SMALL

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model_name == "tiny":
        net = torch.nn.Sequential(*[torch.nn.Linear(1, 1) for _ in range(6)])
    else:
        net = TEST_RESIDUAL_SMALL
    x, y = torch.rand(batch, 1), torch.rand(batch, 1)
    with Cluster.local(num_shards=3) as cluster:
        model = cluster.deploy(net, optimizer=(torch.optim.Adam, {"lr": 1e-3}))

        def step() -> None:
            torch.nn.functional.mse_loss(model(x), y).backward()
            model.step()
            model.zero_grad()
        for _ in range(WARMUP):
            step()
        model.synchronize()
        print(_MARK, json.dumps("ready"), flush=True)
        pids = [service.process.pid for service in cluster._services.services] + [os.getpid()]
        for _ in sys.stdin:
            cpu, times = _cpu_seconds(pids), []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            model.synchronize()
            print(_MARK, json.dumps([statistics.median(times), (_cpu_seconds(pids) - cpu) / steps]), flush=True)


def child_env(tree: pathlib.Path) -> dict[str, str]:
    """The environment of a process that must run `tree`'s code: the tree itself, and its protos/ (where older
    trees kept `shardtrain`), come before the development install's finder, which would find this checkout's."""
    return {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'protos'}"}


class Variant:
    """One revision: its worktree (made for the run, unless it is the working tree) and its cluster's process."""

    def __init__(self, revision: str, args: argparse.Namespace, scratch: pathlib.Path):
        self.revision = revision
        revision, *assignments = revision.split("+")
        self._env = dict(assignment.split("=", 1) for assignment in assignments)
        self.tree = ROOT if revision == "." else pathlib.Path(revision).resolve()
        self._made = False
        if revision != "." and not self.tree.is_dir():
            self.tree = scratch / f"rev-{len(list(scratch.iterdir()))}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(self.tree),
                            revision], check=True)
            self._made = True
        self._argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", "--model", args.model,
                      "--batch", str(args.batch), "--steps", str(args.steps)]
        self.process: subprocess.Popen | None = None
        self.times: list[float] = []
        self.cpu: list[float] = []

    def start(self) -> None:
        """Starts a fresh cluster (the previous one, if any, is stopped first)."""
        self.stop()
        self.process = subprocess.Popen(self._argv, cwd=self.tree, env={**child_env(self.tree), **self._env},
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ready(self) -> None:
        """Waits until the cluster is up and warmed up."""
        if self._figures() != "ready":
            raise RuntimeError(f"the cluster of {self.revision} did not say it was ready")

    def round(self) -> None:
        """Times one round; RuntimeError if the child died."""
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        median, cpu = self._figures()
        self.times.append(median)
        self.cpu.append(cpu)

    def _figures(self):
        """The next thing the child reports: "ready", or a round's [median s, CPU s] per step."""
        line = ""
        while not line.startswith(_MARK):  # anything else the child printed is not ours
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"the cluster of {self.revision} exited with code {self.process.wait()}")
        return json.loads(line[len(_MARK):])

    def stop(self) -> None:
        """Stops the cluster: its child closes it when stdin ends."""
        if self.process is None:
            return
        # Imported here, in the parent only: the child runs this file against its revision's SDK, which may lack it.
        from client_sdk.processes import reap
        process, self.process = self.process, None
        process.stdin.close()
        reap(process, 60)

    def close(self) -> None:
        self.stop()
        if self._made:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(self.tree)], check=False)


def running_order(variants: list, number: int, rounds_per_cluster: int) -> list:
    """The order of round `number`: reversed every other round, and after every restart (each
    `rounds_per_cluster` rounds) the other way round than after the one before, so that each revision's
    place in a cluster's life (the first timed round after a restart tends to be the slowest) evens out."""
    return variants if (number + number // rounds_per_cluster) % 2 == 0 else variants[::-1]


def paired(variant: Variant, base: Variant) -> dict:
    """Per-round ratios of `variant` to `base`, summed up."""
    times = [v / b for v, b in zip(variant.times, base.times)]
    # CPU is counted in clock ticks (10 ms): a round too short to count any has no CPU ratio.
    cpu = [v / b for v, b in zip(variant.cpu, base.cpu) if b > 0] or [math.nan]
    return {"time": statistics.median(times), "time_range": (min(times), max(times)),
            "cpu": statistics.median(cpu), "cpu_range": (min(cpu), max(cpu)),
            "faster": sum(ratio < 1 for ratio in times), "rounds": len(times)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revisions", nargs="*", help='git revisions, "." for the working tree, or checkouts\' '
                        'directories')
    parser.add_argument("--model", choices=("seed", "tiny"), default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds-per-cluster", type=int, default=2,
                        help="rounds before each revision's cluster is started afresh (one cluster can be a few "
                             "percent faster or slower than the next of the same code)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.model, args.batch, args.steps)
        return
    if len(args.revisions) < 2:
        parser.error("give at least two revisions to compare")
    variants: list[Variant] = []
    with tempfile.TemporaryDirectory(prefix="shardtrain-ab-") as scratch:
        try:
            for revision in args.revisions:
                variants.append(Variant(revision, args, pathlib.Path(scratch)))
            for number in range(args.rounds):
                order = running_order(variants, number, args.rounds_per_cluster)
                if number % args.rounds_per_cluster == 0:
                    for variant in order:
                        variant.start()
                    for variant in order:  # none is timed while another starts up
                        variant.ready()
                for variant in order:
                    variant.round()
                figures = (f"{v.revision} {v.times[-1] * 1e3:.2f} ms ({v.cpu[-1] * 1e3:.2f} ms CPU)" for v in variants)
                print(f"round {number + 1}: " + "  ".join(figures), flush=True)
        finally:
            for variant in variants:
                variant.close()
    base = variants[0]
    print(f"{args.model} model, batch {args.batch}, {args.rounds} rounds of {args.steps} steps, order reversed "
          f"every other round, a fresh cluster every {args.rounds_per_cluster}; per-round ratios to {base.revision}:")
    for variant in variants:
        line = (f"  {variant.revision:12s} median step {statistics.median(variant.times) * 1e3:6.2f} ms, "
                f"CPU {statistics.median(variant.cpu) * 1e3:6.2f} ms a step")
        if variant is not base:
            ratio = paired(variant, base)
            cpu = "n/a (no CPU counted)" if math.isnan(ratio["cpu"]) else \
                f"{ratio['cpu']:.3f}x ({ratio['cpu_range'][0]:.2f}-{ratio['cpu_range'][1]:.2f})"
            line += (f"; step time {ratio['time']:.3f}x ({ratio['time_range'][0]:.2f}-{ratio['time_range'][1]:.2f}), "
                     f"CPU {cpu}, faster in {ratio['faster']} of {ratio['rounds']} rounds")
        print(line)


if __name__ == "__main__":
    main()
