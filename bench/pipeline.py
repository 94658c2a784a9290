"""Benchmark: pipeline bubbles of GPipe, 1F1B and ZB-H1, data-parallel scaling, activation memory.

    python -m bench.pipeline [--delay-ms 40] [--steps 3]

Every shard adds a fixed delay to each pipelined forward and backward (`--simulate-compute-ms`),
standing for GPU work, so this 2-core machine does not limit how many stages work at once; the
layers themselves are real (small) and run as usual. Printed, with the ideal beside each figure:

1. p = 4 devices, m = 8 micro-batches: median step time against the schedule's ideal (its simulated
   makespan: (m + p - 1) x (t_forward + t_backward) for GPipe and 1F1B; ZB-H1 splits each backward
   into halves and fills the bubble with the weight halves; interleaved runs 2 stages of half the
   work on each device, on a second cluster of 4 processes serving 2 shards each), and the measured
   bubble (1 - a device's busy time / the step time, mean over the devices) against the simulated
   one; each schedule's step against 1F1B's in the same run. Then where the time beyond the
   ideal goes, from the last step's timeline (every stage's spans on one clock, model.timeline()):
   the median time an action took beyond its simulated time (the layers' real compute and the hand-off
   to the compute thread), the median hand-off between stages (from an action's input being ready
   on the stage before, or after, until it starts, where the stage was idle), and the part of the
   step outside the timeline (the SDK's sends, the loss's return, the settle); and the timeline
   itself as a picture.
2. data parallel, p = 1: samples per second with R = 4 replicas against R = 1, each replica
   taking the same batch per step (weak scaling).
3. the peak saved-activation bytes per stage, 1F1B against GPipe, for m = 16 (real layers, no delay
   needed: autograd's saved tensors are counted as they are saved).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from client_sdk import Cluster  # noqa: E402
from shardtrain import schedule as schedules  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb-h1")

FEATURES = 64


def stage_model(stages: int) -> nn.Sequential:
    """`stages` equal blocks of Linear + Tanh."""
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(stages) for layer in (nn.Linear(FEATURES, FEATURES), nn.Tanh())])


def timed_steps(model, batch: int, microbatches: int, schedule: str, steps: int) -> tuple[float, list[dict]]:
    """Median step time of `steps` train_steps after one warm-up, and the last step's per-shard stats."""
    x, y = torch.randn(batch, FEATURES), torch.randn(batch, FEATURES)
    model.train_step(x, y, "MSELoss", microbatches=microbatches, schedule=schedule)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.train_step(x, y, "MSELoss", microbatches=microbatches, schedule=schedule)
        times.append(time.perf_counter() - start)
    return statistics.median(times), model.stats()


def bubbles(cluster: Cluster, delay: float, steps: int) -> None:
    """Part 1: p = 4, m = 8, every schedule."""
    p, m = 4, 8
    model = cluster.deploy(stage_model(p), optimizer=(torch.optim.SGD, {"lr": 0.01}), num_stages=p)
    print(f"1. p={p} stages, m={m} micro-batches, {delay * 1e3:.0f} ms per forward and per backward")
    print(f"   {'schedule':>11} {'step':>9} {'ideal':>9} {'ratio':>6} {'bubble':>7} {'theory':>7} {'/1f1b':>6}")
    pictures, base = [], None
    for schedule in ("1f1b", "gpipe", "zb-h1"):  # 1F1B first: the others are compared with it
        step, stats = timed_steps(model, 8 * m, m, schedule, steps)
        base = base or step
        report(schedule, step, stats, base, p, m, delay)
        pictures.append((schedule, step, model.timeline()))
    step, stats, timeline = interleaved(delay, steps, p, m)
    report("interleaved", step, stats, base, p, m, delay, virtual_stages=2)
    pictures.append(("interleaved", step, timeline))
    for schedule, step, timeline in pictures:
        per_action = delay / 2 if schedule in schedules.INTERLEAVED else delay  # a stage is half a device's share
        extra, handoffs = overheads(timeline, per_action, schedule in schedules.SPLIT_BACKWARD)
        print(f"   {schedule}, the last step: an action took {statistics.median(extra) * 1e3:.2f} ms beyond its "
              f"simulated time (median); a hand-off between stages {statistics.median(handoffs) * 1e3:.2f} ms "
              f"(median of {len(handoffs)}); the timeline spans {timeline.makespan * 1e3:.1f} ms of the "
              f"{step * 1e3:.1f} ms step")
        print("   " + timeline.text(88).replace("\n", "\n   "))
    print(f"   of an action's time beyond the simulated: time.sleep({delay:g}) itself overshoots by "
          f"{timer_overshoot(delay) * 1e3:.2f} ms here (median)")


def report(schedule: str, step: float, stats: list[dict], base: float, p: int, m: int, delay: float,
           virtual_stages: int = 1) -> None:
    """One row of part 1: the step against the schedule's ideal and against 1F1B's (`base`), and the measured
    bubble (1 - a device's busy time / the step, mean over the p devices) against the simulated one."""
    stages = p * virtual_stages
    ideal = schedules.makespan(schedule, stages, m, delay, delay, virtual_stages=virtual_stages)
    theory = schedules.bubble_fraction(schedule, stages, m, delay, delay, virtual_stages=virtual_stages)
    busy = [sum(s["forward_s"] + s["backward_s"] for s in stats if s["stage"] % p == device) for device in range(p)]
    note = f"   v={virtual_stages}: {stages} stages, {virtual_stages} per shard process" if virtual_stages > 1 else ""
    print(f"   {schedule:>11} {step * 1e3:7.1f}ms {ideal * 1e3:7.1f}ms {step / ideal:6.3f} "
          f"{statistics.mean(1 - b / step for b in busy):7.3f} {theory:7.3f} {step / base:6.3f}{note}")


def interleaved(delay: float, steps: int, p: int, m: int) -> tuple[float, list[dict], object]:
    """The interleaved schedule on a cluster of its own: p shard processes serving 2 shards each, 2p stages of
    half a device's share each (delay / 2 of simulated device time per action). (step, stats, timeline)."""
    os.environ["SHARDTRAIN_SIMULATE_COMPUTE_MS"] = str(delay * 1e3 / 2)
    try:
        with Cluster.local(num_shards=p, virtual_stages=2) as cluster:
            model = cluster.deploy(stage_model(2 * p), optimizer=(torch.optim.SGD, {"lr": 0.01}), num_stages=2 * p,
                                   virtual_stages=2)
            step, stats = timed_steps(model, 8 * m, m, "interleaved", steps)
            return step, stats, model.timeline()
    finally:
        os.environ["SHARDTRAIN_SIMULATE_COMPUTE_MS"] = str(delay * 1e3)


def timer_overshoot(delay: float, repeats: int = 20) -> float:
    """How much later than asked time.sleep(delay) returns in this process: the simulation's own share of each
    action's extra time (a shard sleeps so on its compute thread), which device work would not have."""
    late = []
    for _ in range(repeats):
        start = time.perf_counter()
        time.sleep(delay)
        late.append(time.perf_counter() - start - delay)
    return statistics.median(late)


def overheads(timeline, delay: float, split: bool) -> tuple[list[float], list[float]]:
    """(each action's time beyond its simulated time, each hand-off between stages that a stage waited
    for): the framework's own time per action and per hop, from one step's timeline. With a `split` backward,
    its halves are simulated as delay / 2 each."""
    lanes = timeline.lanes()
    ends = {(span.stage, span.kind, span.microbatch): span.end for spans in lanes.values() for span in spans}
    simulated = {"forward": delay, "backward": delay / 2 if split else delay, "weight": delay / 2}
    extra, handoffs = [], []
    for (_, stage), spans in lanes.items():
        work = [span for span in spans if span.kind in simulated]
        for before, span in zip([None, *work], work):
            extra.append(span.end - span.start - simulated[span.kind])
            if span.kind == "weight":  # waits only on its own stage's backward
                continue
            source = stage - 1 if span.kind == "forward" else stage + 1
            ready = ends.get((source, span.kind, span.microbatch))
            if ready is not None and (before is None or before.end <= ready):  # idle until the input was ready
                handoffs.append(span.start - ready)
    return extra, handoffs or [0.0]


def data_parallel(cluster: Cluster, steps: int, per_replica: int = 64) -> None:
    """Part 2: R = 1 against R = 4 replicas of a one-stage model, the same batch per replica."""
    throughput = {}
    for replicas in (1, 4):
        model = cluster.deploy(stage_model(2), optimizer=(torch.optim.SGD, {"lr": 0.01}), num_stages=1,
                               replicas=replicas)
        step, _ = timed_steps(model, per_replica * replicas, 1, "1f1b", steps)
        throughput[replicas] = per_replica * replicas / step
        print(f"   R={replicas}: {step * 1e3:7.1f} ms a step, {throughput[replicas]:8.0f} samples/s")
    print(f"   R=4 / R=1 throughput: {throughput[4] / throughput[1]:.2f}x (ideal 4.00x)")


def activation_memory(cluster: Cluster) -> None:
    """Part 3: peak saved-activation bytes per stage for m = 16."""
    p, m = 4, 16
    model = cluster.deploy(stage_model(p), optimizer=(torch.optim.SGD, {"lr": 0.01}), num_stages=p)
    peaks = {}
    for schedule in SCHEDULES:
        _, stats = timed_steps(model, 64 * m, m, schedule, 1)
        peaks[schedule] = {s["stage"]: s["peak_activation_bytes"] for s in stats}
    print(f"3. peak saved activations per stage, p={p}, m={m}, {64} rows per micro-batch")
    for stage in range(p):
        gpipe, one, zero = (peaks[name][stage] for name in SCHEDULES)
        print(f"   stage {stage}: gpipe {gpipe / 1024:8.1f} KiB   1f1b {one / 1024:8.1f} KiB   "
              f"zb-h1 {zero / 1024:8.1f} KiB   1f1b/gpipe {one / gpipe:.3f}   zb-h1/1f1b {zero / one:.3f} "
              f"(1f1b in flight: {min(p - stage, m)} of {m})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=40.0)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ["SHARDTRAIN_SIMULATE_COMPUTE_MS"] = str(args.delay_ms)  # read by the shards Cluster.local starts
    with Cluster.local(num_shards=4) as cluster:
        bubbles(cluster, args.delay_ms / 1e3, args.steps)
        print("2. data parallel, p=1, 64 rows per replica")
        data_parallel(cluster, args.steps)
        activation_memory(cluster)


if __name__ == "__main__":
    main()
