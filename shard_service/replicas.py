"""Data parallelism for one stage: its replicas sum their gradients, bucket by bucket, during backward.

Every replica's loss is already weighted by its share of the whole batch, so the sum of the
replicas' gradients is the full batch's gradient, and replicas that step on it stay identical.
Buckets are launched while backward still runs (as DistributedDataParallel does): a parameter's
post-accumulate-grad hook marks it ready on the last micro-batch's backward, and a bucket goes out
as soon as it and every bucket before it are ready, so all replicas issue the same collectives in
the same order. Every wait has a deadline: a replica that dies makes the others' step fail.

The collectives run on NCCL when the stage is on CUDA and every replica has a GPU of its own (NCCL
refuses two ranks on one GPU), and on gloo otherwise; gloo takes CUDA tensors too, through host memory.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import socket
import threading

import torch
import torch.distributed as dist

from shardtrain.errors import DeadlineExceeded, Unavailable

log = logging.getLogger("shardtrain.shard.replicas")
BUCKET_BYTES = 4 << 20  # small enough to overlap with the rest of backward, big enough to amortise a call


class GradientAverager:
    """The gradient all-reduce of one stage's replicas (rank = replica index)."""

    @classmethod
    def for_plan(cls, plan, stage, address: str, timeout: float, secret: str = "") -> GradientAverager | None:
        """An averager when the plan has several replicas, else None; replica 0 hosts the rendezvous store."""
        if plan.num_replicas <= 1:
            return None
        return cls(plan.replica, plan.num_replicas, plan.rendezvous, address.rsplit(":", 1)[0],
                   stage.weights.parameters, timeout, secret)

    def __init__(self, rank: int, size: int, rendezvous: str, host: str, parameters: list, timeout: float,
                 secret: str = ""):
        self.rank, self.size, self._host = rank, size, host
        self._timeout = datetime.timedelta(seconds=timeout)
        if rank == 0:
            listener = _listener(host)
            server = dist.TCPStore(host, listener.getsockname()[1], size, True, self._timeout, wait_for_workers=False,
                                   master_listen_fd=listener.detach())  # the store owns and closes the socket now
            self.hosted = f"{host}:{server.port}"
        else:
            store_host, port = rendezvous.rsplit(":", 1)
            server = dist.TCPStore(store_host, int(port), size, False, self._timeout)
            self.hosted = ""
        # The store has no password: the replicas publish their devices and addresses under keys named after the
        # deployment's secret, so that only its shards find one another (a digest: the keys travel in the clear).
        self._store = dist.PrefixStore(hashlib.sha256(f"shardtrain {secret}".encode()).hexdigest(), server)
        self._group = None
        self._device = parameters[0].device if parameters else torch.device("cpu")
        self.backend = ""  # nccl or gloo, chosen with the other replicas on the first connect
        self._buckets = _buckets(parameters)
        self._lock = threading.Lock()
        self._armed = False
        self._ready: set[int] = set()
        self._works: list = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in parameters]

    @property
    def connected(self) -> bool:
        """Whether this replica is in the group (joined, and not broken since)."""
        return self._group is not None

    def connect(self) -> str:
        """Joins the replicas' group (once; every replica must call it within the timeout); answers its backend."""
        if self._group is not None:
            return self.backend
        try:
            self.backend = self.backend or self._agree_on_backend()
            store = dist.PrefixStore("gradients", self._store)
            if self.backend == "nccl":
                # A timed-out collective aborts its communicator instead of ending the process: the shard keeps serving.
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self._timeout
                self._group = dist.ProcessGroupNCCL(store, self.rank, self.size, options)
            else:
                options = dist.ProcessGroupGloo._Options()
                options._timeout = self._timeout
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]
                self._group = dist.ProcessGroupGloo(store, self.rank, self.size, options)
        except RuntimeError as error:  # DistStoreError (a replica missing from the store) is one too
            raise DeadlineExceeded(f"replica {self.rank}: the other {self.size - 1} replicas of this stage did not "
                                   f"join within {self._timeout.total_seconds():g} s: {error}") from None
        log.info("replica %d of %d: gradients are summed with %s", self.rank, self.size, self.backend)
        return self.backend

    def _agree_on_backend(self) -> str:
        """nccl when every replica's parameters are on a CUDA device no other replica uses, else gloo;
        every replica publishes its GPU's UUID and reads the others', so all of them choose alike."""
        mine = "cpu"
        if self._device.type == "cuda" and dist.is_nccl_available():
            mine = str(torch.cuda.get_device_properties(self._device).uuid)
        self._store.set(f"device/{self.rank}", mine)
        devices = [self._store.get(f"device/{rank}").decode() for rank in range(self.size)]
        return "nccl" if "cpu" not in devices and len(set(devices)) == self.size else "gloo"

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
        """Removes the hooks and lets go of the group and its store on a thread of their own: a group with a
        collective still pending (a replica died mid-step) is destroyed only once its peers hang up or its timeout
        passes, and the caller (a LoadStage on the event loop) must not wait for that."""
        for hook in self._hooks:
            hook.remove()
        held = [self._group, self._store, self._works]
        self._group = self._store = None
        self._works = []
        threading.Thread(target=held.clear, name="replica-group-release", daemon=True).start()


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


def _listener(host: str) -> socket.socket:
    """A socket bound to this replica's own address (`host`, as its peers reach it) on a port the OS picks, for the
    rendezvous store: left to itself, TCPStore listens on every interface. gloo binds its pairs to the same host."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, protocol)
        try:
            listener.bind(address)
        except OSError:
            listener.close()
            raise
    except OSError as error:
        raise Unavailable(f"replica 0: cannot serve the replicas' rendezvous store on {host}: {error}") from None
    return listener


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
