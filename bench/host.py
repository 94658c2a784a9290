"""How much two of this host's cores do at once, against one: the context every pipeline figure needs.

    python -m bench.host

A stage of the seed model at batch 32 is small matrix products. Each of two processes runs the
same fixed amount of them on one intra-op thread, first one process alone, then two at once;
the result is the work per second of the two together over that of one alone (2.0: two real
cores; 1.0: no more than one). The 2-core development machine is a VM on a shared host, and this
varies: at one time two at once did 1.17x the work of one alone (6.9 ms each for what took
4.0 ms alone), forty minutes later 1.96-1.99x. While it is low, shards gain little from
overlapping their work and every process hand-off takes a core from the critical path;
`python -m bench.train_step` prints it before and after its rounds, so its ratios can be read
against it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

PRODUCTS = 2000  # 32x512 @ 512x512 products per run: about 0.4 s on the development machine


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ratio, one, two = parallel_throughput(args.rounds)
    print(f"two processes at once do {ratio:.2f}x the work of one alone "
          f"({PRODUCTS} products of 32x512 by 512x512: {one * 1e3:.0f} ms alone, {two * 1e3:.0f} ms each at once)")


if __name__ == "__main__":
    main()
