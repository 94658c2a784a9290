"""How much two of this host's cores do at once, and how soon a process runs once another wakes it.

    python -m bench.host [--rounds 3]

Both are the context every pipeline figure needs.

Parallel throughput. A stage of the seed model at batch 32 is small matrix products. Each of two
processes runs the same fixed amount of them on one intra-op thread, first one process alone,
then two at once; the result is the work per second of the two together over that of one alone
(2.0: two real cores; 1.0: no more than one). The 2-core development machine is a VM on a shared
host, and this varies: at one time two at once did 1.17x the work of one alone (6.9 ms each for
what took 4.0 ms alone), forty minutes later 1.96-1.99x. While it is low, shards gain little from
overlapping their work and every process hand-off takes a core from the critical path.

Wake-up. Every hand-off between two processes of a pipeline is one process waking another: a
Link item written to a socket that the other end sleeps on. Here a waker writes one byte to a
Unix socket and goes on working for WAKER_WORK (as a stage goes on after sending: more items,
bookkeeping), then pauses; the sleeper notes when it runs again, and on which core. Latency is
the time from the write to the sleeper running (perf_counter is CLOCK_MONOTONIC on Linux: one
clock for every process). It is measured as the scheduler places the two, then with each pinned
to its own core. On the development machine (six runs): left to the scheduler, the sleeper ran
on the core the waker wrote from in 90-95% of wake-ups, 0.13-0.44 ms after the write (median);
pinned apart, 0.14-0.21 ms after it. (Its kernel's command line carries `sched_vcpu_pack=15`,
which mainline Linux does not have.) A loop step of the seed's 3-stage pipeline has six hand-offs
between processes on its critical path.

`python -m bench.train_step` prints both before its rounds (and the throughput again after), so
its ratios can be read against them.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch

PRODUCTS = 2000  # 32x512 @ 512x512 products per run: about 0.4 s on the development machine
WAKES = 300            # wake-ups per measurement
WAKER_WORK = 0.5e-3    # seconds the waker works after each write
SLEEPER_WORK = 0.2e-3  # seconds the sleeper works after each wake-up (handling the item)
PAUSE = 2e-3           # seconds the waker then sleeps: the sleeper is asleep again before the next write


def _work(ready: mp.Barrier, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    a, w = torch.randn(32, 512), torch.randn(512, 512)
    for _ in range(50):  # warm-up
        a @ w
    ready.wait()  # every process warm: all start together
    began = time.perf_counter()
    for _ in range(PRODUCTS):
        a @ w
    results.put(time.perf_counter() - began)


def _run_at_once(count: int) -> list[float]:
    """Seconds each of `count` processes took for the same work, started together."""
    context = mp.get_context("spawn")
    ready, results = context.Barrier(count), context.Queue()
    processes = [context.Process(target=_work, args=(ready, results)) for _ in range(count)]
    for process in processes:
        process.start()
    seconds = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join()
    return seconds


def parallel_throughput(rounds: int = 3) -> tuple[float, float, float]:
    """(work per second of two processes at once over one alone, one alone's seconds, two's median seconds);
    medians over `rounds` alternating rounds."""
    alone, together = [], []
    for _ in range(rounds):
        alone += _run_at_once(1)
        together += _run_at_once(2)
    one, two = statistics.median(alone), statistics.median(together)
    return 2 * one / two, one, two


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _core() -> int:
    """The core this thread runs on (field 39 of /proc/thread-self/stat)."""
    with open("/proc/thread-self/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[36])


def _sleeper(connection, core: int | None, results: mp.Queue) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    woke = []
    for _ in range(WAKES):
        connection.recv_bytes()
        woke.append((time.perf_counter(), _core()))
        _spin(SLEEPER_WORK)
    results.put(("sleeper", woke))


def _waker(connection, core: int | None, results: mp.Queue) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    time.sleep(0.2)  # the sleeper is waiting by now
    sent = []
    for _ in range(WAKES):
        sent.append((time.perf_counter(), _core()))
        connection.send_bytes(b"x")
        _spin(WAKER_WORK)
        time.sleep(PAUSE)
    results.put(("waker", sent))


def _wakes(pinned: bool) -> tuple[list[float], float]:
    """(seconds from each write to the sleeper running, fraction of wake-ups on the waker's core)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    ours, theirs = context.Pipe()  # a Unix socket pair
    cores = (0, 1) if pinned else (None, None)
    processes = [context.Process(target=_sleeper, args=(theirs, cores[1], results)),
                 context.Process(target=_waker, args=(ours, cores[0], results))]
    for process in processes:
        process.start()
    found = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join()
    pairs = list(zip(found["waker"], found["sleeper"]))
    return [woke - sent for (sent, _), (woke, _) in pairs], sum(a == b for (_, a), (_, b) in pairs) / len(pairs)


def wake_up(rounds: int = 1) -> dict[str, float] | None:
    """Median wake-up latency (seconds) left to the scheduler and pinned apart, and the share of wake-ups on the
    waker's core; None where this cannot be measured (not Linux, or cores 0 and 1 not both ours)."""
    if not os.path.exists("/proc/thread-self/stat") or not {0, 1} <= os.sched_getaffinity(0):
        return None
    free, pinned, same = [], [], []
    for _ in range(rounds):
        latencies, share = _wakes(pinned=False)
        free += latencies
        same.append(share)
        pinned += _wakes(pinned=True)[0]
    return {"free": statistics.median(free), "pinned": statistics.median(pinned), "same_core": statistics.median(same)}


def describe_wake_up(found: dict[str, float] | None) -> str:
    """One line for a wake_up() result."""
    if found is None:
        return "wake-up: not measured here (needs Linux and cores 0 and 1)"
    return (f"wake-up: a process woken over a Unix socket runs {found['free'] * 1e3:.2f} ms after the write "
            f"(on the waker's core in {found['same_core']:.0%} of wake-ups); pinned to another core, "
            f"{found['pinned'] * 1e3:.2f} ms (median; the waker works {WAKER_WORK * 1e3:g} ms after writing)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ratio, one, two = parallel_throughput(args.rounds)
    print(f"two processes at once do {ratio:.2f}x the work of one alone "
          f"({PRODUCTS} products of 32x512 by 512x512: {one * 1e3:.0f} ms alone, {two * 1e3:.0f} ms each at once)")
    print(describe_wake_up(wake_up(args.rounds)))


if __name__ == "__main__":
    main()
