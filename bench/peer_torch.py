"""bench.peer's torch side: the same GPT under torch.distributed.pipelining and DistributedDataParallel.

A pool of gloo processes (torch.multiprocessing spawn, 127.0.0.1, a free port) lives for the whole run and
takes jobs: each job builds the model afresh from the seed, cuts it by hand into the stage modules the
shardtrain side deploys, and trains the run's batches with SGD, reporting per-step times, its CPU and the loss.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, _Action,
                                                    _PipelineScheduleRuntime)
from torch.nn.parallel import DistributedDataParallel

from bench.peer_model import Config, batches, build, lm_loss, pieces, timed_run
from shardtrain import schedule as schedules

DP_RANKS = 2  # DistributedDataParallel runs on ranks 0 and 1 of the pool; the others sit the job out
JOB_TIMEOUT = 900.0  # seconds; a hung collective is a failure, not a wait


class ScheduleZBH1(_PipelineScheduleRuntime):
    """ZB-H1 with one stage per rank, in exactly shardtrain's order: each stage's forwards (F), input-gradient
    halves (I) and weight-gradient halves (W) as shardtrain.schedule writes them. torch ships zero-bubble
    schedules only for several stages per rank (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble); its
    runtime adds the sends and receives to a compute-only order."""

    _KINDS = {schedules.FORWARD: FORWARD, schedules.BACKWARD: BACKWARD_INPUT, schedules.WEIGHT: BACKWARD_WEIGHT}

    def __init__(self, stages: list, n_microbatches: int, loss_fn=None):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
        ranks = self.pp_group_size
        self.pipeline_order = {rank: [_Action(rank, self._KINDS[a.op], a.microbatch)
                                      for a in schedules.stage_actions("zb-h1", rank, ranks, n_microbatches)]
                               for rank in range(ranks)}
        self._prepare_schedule_with_comms(self.pipeline_order)


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb-h1": ScheduleZBH1,
             "interleaved": ScheduleInterleaved1F1B}
MULTI = ("zb-h1", "interleaved")  # schedules taking a list of stages


class DelayedStage(PipelineStage):
    """A stage that sleeps `delay` after each forward and each whole backward of a micro-batch, and half of it
    after each input-gradient and each weight-gradient half, as a shard with --simulate-compute-ms does."""

    def __init__(self, *args, delay: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay = delay

    def forward_one_chunk(self, *args, **kwargs):
        output = super().forward_one_chunk(*args, **kwargs)
        time.sleep(self.delay)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        result = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        time.sleep(self.delay if full_backward else self.delay / 2)
        return result

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        result = super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        time.sleep(self.delay / 2)
        return result


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps first: the simulated device time of a whole model's backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, delay: float) -> torch.Tensor:
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.delay)
        return grad, None


class Delayed(nn.Module):
    """A whole model that sleeps `delay` after its forward and before its backward (data parallel)."""

    def __init__(self, module: nn.Module, delay: float):
        super().__init__()
        self.module, self.delay = module, delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.module(x)
        time.sleep(self.delay)
        return _SleepInBackward.apply(output, self.delay)


@dataclass(frozen=True)
class Job:
    """One turn of the torch side: `kind` "pipeline" (under `schedule`) or "ddp"; `delay` seconds simulated per
    forward and per backward of a stage (or of the whole model, for ddp); `threads` intra-op threads per rank."""

    kind: str
    config: Config
    schedule: str = ""
    delay: float = 0.0
    threads: int = 1


def pipeline_job(job: Job, rank: int, world: int) -> dict:
    """Trains the run's batches with torch.distributed.pipelining: stage rank (and rank + world, interleaved)."""
    config = job.config
    per_rank = 2 if job.schedule == "interleaved" else 1
    total = world * per_rank
    cut = pieces(build(config), total)
    indices = [rank + world * j for j in range(per_rank)]
    stages = [DelayedStage(cut[i], i, total, torch.device("cpu"), delay=job.delay) if job.delay
              else PipelineStage(cut[i], i, total, torch.device("cpu")) for i in indices]
    optimizer = torch.optim.SGD([p for i in indices for p in cut[i].parameters()], lr=config.lr)
    schedule = SCHEDULES[job.schedule](stages if job.schedule in MULTI else stages[0], config.microbatches,
                                       loss_fn=lm_loss)
    first, last = any(stage.is_first for stage in stages), any(stage.is_last for stage in stages)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if first else ()), **({"target": y, "losses": losses} if last else {}))
        optimizer.step()
        optimizer.zero_grad()
        return sum(loss.item() for loss in losses) / config.microbatches if last else None
    return timed_run(step, batches(config), config.warmup, time.process_time)


def ddp_job(job: Job, rank: int, group) -> dict:
    """Trains the run's batches with DistributedDataParallel, each of 2 ranks on its half of every batch."""
    if rank >= DP_RANKS:
        return {}
    config = job.config
    model = build(config)
    ddp = DistributedDataParallel(Delayed(model, job.delay) if job.delay else model, process_group=group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(ddp(x.chunk(DP_RANKS)[rank]), y.chunk(DP_RANKS)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()
    return timed_run(step, batches(config), config.warmup, time.process_time)


def _worker(rank: int, world: int, port: int, commands, results) -> None:
    """One rank: joins the gloo group, then runs jobs until it gets None (or its parent is gone)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=JOB_TIMEOUT))
    dp_group = dist.new_group(list(range(DP_RANKS)))
    parent = os.getppid()
    results.put((rank, "ready"))
    while True:
        try:
            job = commands[rank].get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:
                break
            continue
        if job is None:
            break
        torch.set_num_threads(job.threads)
        try:
            out = pipeline_job(job, rank, world) if job.kind == "pipeline" else ddp_job(job, rank, dp_group)
        except Exception:  # reported to the parent, which fails the run with it
            out = {"error": traceback.format_exc()}
        results.put((rank, out))
    dist.destroy_process_group()
    results.close()
    results.join_thread()  # everything this rank put is on its way
    os._exit(0)  # the interpreter's own teardown (gloo's native state) takes seconds and has nothing left to do


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TorchPool:
    """`world` gloo processes that take Jobs; start() returns at once, so they start while the clusters do."""

    def __init__(self, world: int):
        self.world = world
        context = mp.get_context("spawn")
        self._commands = [context.Queue() for _ in range(world)]
        self._results = context.Queue()
        self._processes = None

    def start(self) -> None:
        """Spawns the ranks; they join their group in the background (ready() waits for them)."""
        self._processes = mp.start_processes(_worker, args=(self.world, free_port(), self._commands, self._results),
                                             nprocs=self.world, join=False, daemon=True, start_method="spawn")

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids."""
        return self._processes.pids()

    def ready(self) -> None:
        """Waits until every rank joined the group."""
        self._collect(JOB_TIMEOUT)

    def run(self, job: Job) -> list[dict]:
        """Every rank's result of `job`, by rank; RuntimeError with a rank's traceback if one failed."""
        for commands in self._commands:
            commands.put(job)
        out = self._collect(JOB_TIMEOUT)
        for rank, result in enumerate(out):
            if "error" in result:
                raise RuntimeError(f"torch rank {rank} failed on {job.kind} {job.schedule}:\n{result['error']}")
        return out

    def _collect(self, timeout: float) -> list:
        out: list = [None] * self.world
        deadline = time.monotonic() + timeout
        while any(result is None for result in out):
            if time.monotonic() > deadline:
                raise RuntimeError(f"torch ranks {[r for r, v in enumerate(out) if v is None]} silent for {timeout} s")
            try:
                rank, result = self._results.get(timeout=1.0)
                out[rank] = result
            except queue.Empty:
                dead = [p.exitcode for p in self._processes.processes if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"a torch rank exited (exit codes {dead})") from None
        return out

    def close(self) -> None:
        """Asks every rank to leave, then ends those that did not within 30 s."""
        if self._processes is None:
            return
        for commands in self._commands:
            commands.put(None)
        for process in self._processes.processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes = None
