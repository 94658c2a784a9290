"""Baseline: the seed residual model trained with classic PyTorch RPC model parallelism.

Four real processes talk over TensorPipe on 127.0.0.1: a master (rank 0, no layers)
and three workers, each owning one stage of the seed residual model through an RRef.
The master drives forward through the stages, computes an MSE loss, and trains with
``torch.distributed.autograd`` plus a ``DistributedOptimizer`` wrapping Adam — the
"model parallel with distributed autograd" recipe from the PyTorch RPC tutorials.

Run as a script to print the median step time for batch sizes 32 and 256.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import statistics
import time
import traceback
import warnings

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from client_sdk.layer_list import LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL

NUM_STAGES = 3
WORLD_SIZE = NUM_STAGES + 1
STAGE_BOUNDS = [(0, 3), (3, 5), (5, 10)]  # layer slices owned by workers 1, 2, 3: shardtrain's balanced plan
LEARNING_RATE = 3e-3
RPC_TIMEOUT_S = 60
GLOBAL_TIMEOUT_S = 300.0
SHUTDOWN_GRACE_S = 10.0
POLL_INTERVAL_S = 0.5


def build_seed_layers() -> list[nn.Module]:
    """Return the seed residual model's ten layers, in order (client_sdk.seed_models, the seed verbatim)."""
    return list(LayerList(TEST_RESIDUAL_SMALL).children())


class Stage(nn.Module):
    """A contiguous slice of the seed layers, owned by one worker."""

    def __init__(self, seed: int, stage: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # every worker builds the same full model, keeps its slice
        start, stop = STAGE_BOUNDS[stage]
        self.layers = nn.ModuleList(build_seed_layers()[start:stop])

    def forward(
        self, x: torch.Tensor, saved: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the slice; return the activation and any newly produced saved tensors."""
        produced: dict[str, torch.Tensor] = {}
        for layer in self.layers:
            deps = [saved[name] for name in getattr(layer, "dependencies", [])]
            out = layer(x, *deps)
            if getattr(layer, "out_variables", []):
                x, pairs = out
                produced.update(pairs)
            else:
                x = out
        return x, produced

    def parameter_rrefs(self) -> list[rpc.RRef]:
        """RRefs to this stage's parameters, for the DistributedOptimizer."""
        return [rpc.RRef(p) for p in self.parameters()]


def _make_data(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(batch_size, 1, generator=gen) * 2 - 1
    return x, (torch.sin(3 * x) + 1) / 2


def _train_step(stages: list[rpc.RRef], opt: DistributedOptimizer, x: torch.Tensor,
                y: torch.Tensor) -> float:
    """One forward/backward/step under a fresh distributed autograd context; returns loss.

    The residual is never detached: it travels, autograd-recorded, in the same RPC
    message as the activation (stage0's reply, then the master's request to stage2).
    That matters because distributed autograd's FAST mode waits for a gradient on every
    recorded send, and the seed's consuming layer drops ``linear(x) + res_1``: shipped
    in an RPC of its own, the residual's send would never get one and ``backward``
    would hang. Sharing a message, one send/recv pair is reached via the activation and
    the residual simply gets the zero gradient the seed layer implies.
    """
    with dist_autograd.context() as context_id:
        act, saved = x, {}
        for stage in stages:
            act, produced = stage.rpc_sync().forward(act, saved)
            saved.update(produced)
        loss = nn.functional.mse_loss(act, y)
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)
    return loss.item()


class _PythonAdam(torch.optim.Adam):
    """torch.optim.Adam under a name DistributedOptimizer has no TorchScript version of."""


def _run_master(batch_size: int, steps: int, warmup: int, seed: int, adam: dict) -> list[float]:
    """Build remote stages, train, and return timed per-step wall times (seconds)."""
    stages = [rpc.remote(f"worker{i + 1}", Stage, args=(seed, i)) for i in range(NUM_STAGES)]
    param_rrefs = [p for s in stages for p in s.rpc_sync().parameter_rrefs()]
    # DistributedOptimizer runs Adam as a TorchScript functional optimizer, which cannot be fused; a
    # subclass it does not know gets torch.optim.Adam itself on each worker.
    adam_class = _PythonAdam if adam.get("fused") else torch.optim.Adam
    opt = DistributedOptimizer(adam_class, param_rrefs, lr=LEARNING_RATE, **adam)
    x, y = _make_data(batch_size, seed)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        _train_step(stages, opt, x, y)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _backend_options(port: int) -> rpc.TensorPipeRpcBackendOptions:
    # TensorPipe's defaults work here: shm and cma are permitted (ibv is absent and
    # skipped), so no `_transports=["uv"]` / `_channels=["basic"]` fallback is needed.
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT_S
    )


def _process_main(rank: int, port: int, threads: int, job: tuple[int, int, int, int, dict],
                  results: mp.Queue) -> None:
    """Entry point of every process; rank 0 trains and reports to ``results``."""
    # torch's own rpc.init_rpc/shutdown trip this deprecation warning; it is not ours to fix.
    # (DistributedOptimizer's TorchScript warning forces "always" and cannot be filtered.)
    warnings.filterwarnings("ignore", message="You are using a Backend")
    torch.set_num_threads(threads)
    name = "master" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=WORLD_SIZE,
                 rpc_backend_options=_backend_options(port))
    try:
        if rank == 0:
            results.put(("ok", _run_master(*job)))
    except Exception:  # report, then still shut down so the workers can exit
        results.put(("error", traceback.format_exc()))
    finally:
        rpc.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _await_result(procs: list[mp.Process], results: mp.Queue, deadline: float) -> list[float]:
    """Wait for the master's result, failing fast if any process dies or time runs out."""
    while time.monotonic() < deadline:
        try:
            status, payload = results.get(timeout=POLL_INTERVAL_S)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"process {dead[0].name} exited with {dead[0].exitcode}") from None
            continue
        if status == "error":
            raise RuntimeError(f"RPC baseline master failed:\n{payload}")
        return payload
    raise TimeoutError(f"RPC baseline did not finish within {GLOBAL_TIMEOUT_S} s")


def _reap(procs: list[mp.Process], deadline: float) -> None:
    """Join every process until ``deadline``, then kill whatever is left."""
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def run_rpc_baseline(batch_size: int, steps: int, warmup: int, seed: int = 0,
                     threads_per_process: int = 1, adam: dict | None = None) -> list[float]:
    """Train the seed residual model over RPC and return per-step wall times.

    Starts a master and three workers as real processes, trains ``warmup`` then
    ``steps`` steps on fixed data (x ~ U(-1, 1) of shape (batch_size, 1),
    y = (sin(3x) + 1) / 2) and returns the master-measured wall time, in seconds,
    of each of the ``steps`` timed steps. ``adam``: keyword arguments for Adam besides
    the learning rate (say ``{"fused": True}``). RPC is always shut down and every process
    reaped, also on error; a hang becomes a ``TimeoutError`` after
    ``GLOBAL_TIMEOUT_S`` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (_free_port(), threads_per_process, (batch_size, steps, warmup, seed, adam or {}), results)
    procs = [ctx.Process(target=_process_main, args=(rank, *args), name=f"rpc-rank{rank}")
             for rank in range(WORLD_SIZE)]
    deadline = time.monotonic() + GLOBAL_TIMEOUT_S
    try:
        for proc in procs:
            proc.start()
        return _await_result(procs, results, deadline)
    finally:
        _reap(procs, time.monotonic() + SHUTDOWN_GRACE_S)


if __name__ == "__main__":
    for batch in (32, 256):
        step_times = run_rpc_baseline(batch_size=batch, steps=50, warmup=5)
        print(f"batch {batch:4d}: median step {statistics.median(step_times) * 1e3:.2f} ms")
