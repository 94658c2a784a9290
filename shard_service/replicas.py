"""Data parallelism for one stage: its replicas sum their gradients with gloo, bucket by bucket, during backward.

Every replica's loss is already weighted by its share of the whole batch, so the sum of the
replicas' gradients is the full batch's gradient, and replicas that step on it stay identical.
Buckets are launched while backward still runs (as DistributedDataParallel does): a parameter's
post-accumulate-grad hook marks it ready on the last micro-batch's backward, and a bucket goes out
as soon as it and every bucket before it are ready, so all replicas issue the same collectives in
the same order. Every wait has a deadline: a replica that dies makes the others' step fail.
"""

from __future__ import annotations

import datetime
import logging
import threading

import torch
import torch.distributed as dist

from shardtrain.errors import DeadlineExceeded, Unavailable

log = logging.getLogger("shardtrain.shard.replicas")
BUCKET_BYTES = 4 << 20  # small enough to overlap with the rest of backward, big enough to amortise a call


class GradientAverager:
    """The gradient all-reduce of one stage's replicas (rank = replica index)."""

    @classmethod
    def for_plan(cls, plan, stage, address: str, timeout: float) -> GradientAverager | None:
        """An averager when the plan has several replicas, else None; replica 0 hosts the rendezvous store."""
        if plan.num_replicas <= 1:
            return None
        return cls(plan.replica, plan.num_replicas, plan.rendezvous, address.rsplit(":", 1)[0],
                   stage.parameters, timeout)

    def __init__(self, rank: int, size: int, rendezvous: str, host: str, parameters: list, timeout: float):
        self.rank, self.size, self._host = rank, size, host
        self._timeout = datetime.timedelta(seconds=timeout)
        if rank == 0:
            self._store = dist.TCPStore(host, 0, size, True, self._timeout, wait_for_workers=False)
            self.hosted = f"{host}:{self._store.port}"
        else:
            store_host, port = rendezvous.rsplit(":", 1)
            self._store = dist.TCPStore(store_host, int(port), size, False, self._timeout)
            self.hosted = ""
        self._group = None
        self._buckets = _buckets(parameters)
        self._lock = threading.Lock()
        self._armed = False
        self._ready: set[int] = set()
        self._works: list = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in parameters]

    def connect(self) -> None:
        """Joins the replicas' gloo group (once; every replica must call it within the timeout)."""
        if self._group is not None:
            return
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self._timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]
        try:
            self._group = dist.ProcessGroupGloo(dist.PrefixStore("gradients", self._store), self.rank, self.size,
                                                options)
        except RuntimeError as error:
            raise DeadlineExceeded(f"replica {self.rank}: the other {self.size - 1} replicas of this stage did not "
                                   f"join within {self._timeout.total_seconds():g} s: {error}") from None

    def arm(self, last_microbatch: bool) -> None:
        """Called before each backward: only the last micro-batch's gradients are final."""
        with self._lock:
            self._armed = last_microbatch

    def _on_grad(self, parameter: torch.Tensor) -> None:
        with self._lock:
            if not self._armed or self._group is None:
                return
            self._ready.add(id(parameter))
            self._launch_ready()

    def _launch_ready(self) -> None:
        while len(self._works) < len(self._buckets):
            bucket = self._buckets[len(self._works)]
            if not all(id(p) in self._ready for p in bucket.parameters):
                return
            self._works.append(bucket.launch(self._group))

    def finish(self) -> None:
        """Sends the buckets still waiting (parameters without a gradient count as zeros), waits for
        every all-reduce and writes the summed gradients back."""
        with self._lock:
            self._ready.update(id(p) for bucket in self._buckets for p in bucket.parameters)
            self._launch_ready()
            works, self._works, self._ready, self._armed = self._works, [], set(), False
        for bucket, work in zip(self._buckets, works):
            try:
                work.wait(self._timeout)
            except RuntimeError as error:
                self._group = None  # a broken group is not reused; the next step rejoins
                raise Unavailable(f"replica {self.rank}: the gradient all-reduce with the other {self.size - 1} "
                                  f"replicas of this stage failed: {error}") from None
            bucket.write_back()

    def close(self) -> None:
        """Removes the hooks; the group and store go with the averager."""
        for hook in self._hooks:
            hook.remove()
        self._group = None


class _Bucket:
    """Parameters whose gradients travel in one flat tensor."""

    def __init__(self, parameters: list):
        self.parameters = parameters
        self.flat: torch.Tensor | None = None

    def launch(self, group):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters]
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        return group.allreduce([self.flat])

    def write_back(self) -> None:
        offset = 0
        for parameter in self.parameters:
            size = parameter.numel()
            parameter.grad = self.flat[offset:offset + size].view_as(parameter).clone()
            offset += size


def _buckets(parameters: list) -> list[_Bucket]:
    """Parameters in reverse order (backward finishes the last layers first), cut into BUCKET_BYTES pieces."""
    buckets, current, size = [], [], 0
    for parameter in reversed(parameters):
        current.append(parameter)
        size += parameter.numel() * parameter.element_size()
        if size >= BUCKET_BYTES:
            buckets.append(_Bucket(current))
            current, size = [], 0
    if current:
        buckets.append(_Bucket(current))
    return buckets
