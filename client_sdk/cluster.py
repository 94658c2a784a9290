"""Cluster: a connection to a coordinator (started locally or already running) that deploys models."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import secrets
import warnings
from collections.abc import Sequence

import torch

from client_sdk import deploy_steps as steps
from client_sdk import layers as layer_tools
from client_sdk.deploy_steps import DeployOptions, PhaseClock, Shipped
from client_sdk.event_loop import shared_loop
from client_sdk.model import DistributedModel
from client_sdk.processes import LocalServices
from client_sdk.reports import DeploymentReport, ShardInfo, Table
from client_sdk.transport import StageClients
from shardtrain import auth, deploy_deadlines
from shardtrain.capture import CAPTURING
from shardtrain.errors import InvalidArgument, Unavailable
from shardtrain.rpc import COORDINATOR_SERVICE, Peer
from shardtrain.settings import Security, Timeouts, security_env, security_from_env, timeouts_env
from shardtrain.v1 import coordinator_pb2



class Cluster:
    """A coordinator and its shards, seen from a script or notebook. Use as a context manager."""

    def __init__(self, address: str, security: Security | None = None, timeouts: Timeouts | None = None,
                 services: LocalServices | None = None):
        self.address = address
        self.security = security_from_env() if security is None else security
        self.timeouts = timeouts or Timeouts()
        self._services = services
        self._io = shared_loop()
        self._models: list[DistributedModel] = []
        self._secret = ""  # of the deployment this client made last: the coordinator lets it replace that one
        self.spares = 0  # shards Cluster.local started beyond those a deploy uses by default
        self._coordinator = self._io.run(self._open_coordinator())

    async def _open_coordinator(self) -> Peer:
        return Peer(f"coordinator at {self.address}", self.address, COORDINATOR_SERVICE,
                    self.security, self.timeouts.control)

    @classmethod
    def local(cls, num_shards: int = 3, device: str = "cpu", security: Security | None = None,
              startup_timeout: float = 120.0, flush_denormal: bool = False,
              timeouts: Timeouts | None = None, hosts=None, metrics: bool = False,
              virtual_stages: int = 1, spares: int = 0, checkpoint_dir: str | os.PathLike | None = None,
              data_roots: Sequence[str | os.PathLike] = ()) -> Cluster:
        """Starts a coordinator and `num_shards` shard processes on 127.0.0.1; close() stops them.

        `security` (a token, TLS files) applies to the services and to this client alike. Without a token
        of yours the cluster makes a random one, so no other user of this host can call its services;
        `cluster.security` carries it, for another client: Cluster.connect(address, cluster.security).
        `flush_denormal`: the shards' CPU arithmetic treats denormal floats as zero, as
        torch.set_flush_denormal(True) does in one process (`shardtrain shard --flush-denormal on`).
        `timeouts`: the deadlines of this client and of the services (`--timeout-*`), e.g.
        Timeouts(rpc=30, peer_wait=20) to hear of a stopped shard within half a minute.
        `hosts`: where the services run instead (bench.namespaces.SeparateHosts: a network namespace per
        shard, standing for machines of their own; needs root).
        `metrics`: every service serves Prometheus metrics, at `cluster.metrics_urls`.
        `virtual_stages`: each shard process serves that many shards on its one device (num_shards x v register),
        for deploy(virtual_stages=v) and the interleaved schedule.
        `spares`: that many more shard processes, which a deploy leaves idle unless told to use them; one takes the
        place of a shard that dies under a replicated deployment (deploy(replicas=2)) and training goes on.
        `checkpoint_dir`: the shards write and read checkpoints under it themselves, every stage at once
        (`shardtrain shard --checkpoint-dir`); model.save_checkpoint(path) with `path` under it uses them.
        `data_roots`: directories and URL prefixes ("s3://bucket/train/") the shards read a DataSource's rows from
        themselves (`shardtrain shard --data-root`); s3:// takes its credentials from this process's AWS_*
        environment, which the shards inherit.
        """
        if isinstance(data_roots, (str, os.PathLike)):
            data_roots = [data_roots]
        security = security or Security()
        if not security.token:
            security = dataclasses.replace(security, token=secrets.token_urlsafe(32))
        flags = (["--flush-denormal", "on"] if flush_denormal else []) + \
            (["--virtual-stages", str(virtual_stages)] if virtual_stages != 1 else []) + \
            (["--checkpoint-dir", os.path.abspath(checkpoint_dir)] if checkpoint_dir else []) + \
            [flag for root in data_roots for flag in ("--data-root", _root(root))]
        timeouts = timeouts or Timeouts()
        if not isinstance(spares, int) or spares < 0:
            raise InvalidArgument(f"spares must be a whole number >= 0, got {spares!r}")
        services = LocalServices(num_shards + spares, device, env={**security_env(security), **timeouts_env(timeouts)},
                                 startup_timeout=startup_timeout, shard_flags=flags, hosts=hosts, metrics=metrics)
        try:
            cluster = cls(services.coordinator_address, security=security, timeouts=timeouts, services=services)
            cluster.wait_for_shards((num_shards + spares) * virtual_stages, startup_timeout)
            cluster.spares = spares * virtual_stages
            return cluster
        except BaseException:
            services.stop()
            raise

    @classmethod
    def connect(cls, address: str, security: Security | None = None) -> Cluster:
        """Attaches to a running coordinator; close() leaves the services running."""
        cluster = cls(address, security)
        cluster.shards()  # fail now, with the address, if nothing answers
        return cluster

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Where the services Cluster.local started serve Prometheus metrics (with metrics=True), by the address
        of each service (`cluster.address`, a placement's `shard_address`); empty otherwise."""
        return self._services.metrics_urls if self._services is not None else {}

    def shards(self) -> Table:
        """The registered shards (ShardInfo), in registration order; prints as a table."""
        answer = self._io.run(self._coordinator.call("ListShards", coordinator_pb2.ListShardsRequest()))
        return Table(map(ShardInfo.from_message, answer.shards))

    def deployment(self) -> DeploymentReport:
        """The deployment the coordinator shipped last, whoever deployed it: its stages' shards per replica and the
        model's inputs and outputs (names, dtypes, shapes); NotFound before any deploy."""
        request = coordinator_pb2.DescribeDeploymentRequest()
        return DeploymentReport.from_message(self._io.run(self._coordinator.call("DescribeDeployment", request)))

    def wait_for_shards(self, count: int, timeout: float = 60.0) -> None:
        """Blocks until `count` shards have registered; Unavailable after `timeout` seconds."""
        async def wait() -> None:
            request = coordinator_pb2.ListShardsRequest()
            for _ in range(int(timeout / 0.1)):
                if len((await self._coordinator.call("ListShards", request)).shards) >= count:
                    return
                await asyncio.sleep(0.1)
            raise Unavailable(f"fewer than {count} shards registered with {self.address} within {timeout:g} s")
        self._io.run(wait())

    def deploy(self, model, optimizer: tuple = (torch.optim.SGD, {"lr": 0.01}),
               example_input: torch.Tensor | None = None, split_points: Sequence[int | str] = (),
               layers_per_stage: Sequence[int] = (), num_stages: int = 0,
               compression: str | dict[str, str] = "none", replicas: int = 1,
               dynamic_shapes=None, balance: str = "", example_inputs: tuple = (),
               example_kwargs: dict | None = None, virtual_stages: int = 1,
               snapshot_every: int = 0, take_over: bool = False,
               weights: str | os.PathLike | None = None, recompute: str | Sequence[str] = "never",
               precision: str = "fp32") -> DistributedModel:
        """Splits `model` into stages over the shards, ships them, loads its current weights, returns a handle.

        model: any nn.Module torch.export can capture. An nn.Sequential, a LayerList or a seed layer list
        [(layer_class, kwargs, input_shape), ...] is split between its layers; any other module is captured whole
        from `example_input` (a tensor shaped like one batch), or `example_inputs=(...)` and `example_kwargs={...}`
        for a forward of several tensors, and split between its submodules (items of a ModuleList, ModuleDict or
        Sequential count one by one), with the values that cross each cut (any number, any dtype) sent straight to
        the stages that read them. It may return a tensor, or tensors in a tuple, list or dict (a loss among them).
        Dim 0 of every input is the batch; `dynamic_shapes` names other dims that vary, in torch.export's form,
        e.g. {"idx": {1: torch.export.Dim("seq", max=block_size)}}.
        optimizer: (torch.optim class or name, kwargs), (class, param groups, kwargs) with each group's "params" a
        list of state-dict keys or parameters or a filter f(key, parameter), or an optimizer instance built over
        the model's parameters (its state, if it stepped, comes along). Each shard steps the same class over the
        weights it holds; model.optimizer stands for it here (bind lr schedulers to it).
        Partitioning: over `num_stages` (default: every shard), contiguous stages balanced by `balance`: "time"
        (each layer's forward and backward measured by the shards the stages go to, on their own devices, with
        inputs shaped as the example's: the default for a model captured whole; give an example the size of a
        micro-batch) or "parameters" (the default for an nn.Sequential or a layer list), within each shard's
        memory, unless split_points (where stages start: layer indexes, or submodule names such as
        "transformer.h.2") or layers_per_stage say otherwise. model.placements says what went where, and the
        costs the partitioner balanced.
        compression: the wire encoding of the tensors that move between shards and this client:
        "none" (exact, the default), "fp16", "bf16" (half the bytes of float32) or "int8" (blockwise,
        about a quarter), for every kind, or a dict by kind: {"activations": ..., "gradients": ...,
        "residuals": ...} (kinds left out stay exact). Only floating-point tensors are compressed.
        replicas: copies of the pipeline (replicas x stages shards) for data parallelism; they train
        together through model.train_step, summing gradients with NCCL (a GPU each) or gloo collectives.
        virtual_stages: stages per device, for train_step's "interleaved" schedule: stage s goes to device
        s mod (stages / v), each device a shard process serving v shards (`shardtrain shard --virtual-stages v`,
        Cluster.local(virtual_stages=v)); the stages count must be a multiple of v.
        snapshot_every: without replicas, every stage snapshots its weights and optimizer state every that many
        train_step calls (and before the first), and the next stage's shard keeps a copy; when a shard dies, a spare
        takes its place, every stage goes back to the snapshots and train_step raises RolledBack naming the step to
        train again from (fit does that itself). 0: none. With replicas a dead shard costs no step at all.
        weights: where the weights lie (a safetensors file, a directory, a Hugging Face sharded checkpoint, locally
        or on s3://, under the shards' --data-root): each shard reads only its own stage's tensors
        (model.load_weights), so a model built on the meta device never holds a weight here. Without it, the
        model's own weights are sent, or, for a model on meta, initialised here one part at a time.
        recompute: activation recomputation, to hold less memory on the shards: "always" (every micro-batch keeps
        only its inputs and outputs and its forward runs again in its backward, with the same random numbers),
        "except_last" (all but each step's last micro-batch) or "never"; or a list of submodule names (those
        layers alone keep only their inputs, as torch.utils.checkpoint around each). The results are the same.
        precision: "bf16" has every stage compute under torch.autocast in bfloat16, weights and optimizer state
        kept in float32 (state_dict() returns them so), and the tensors between stages and this client travel
        in bfloat16 (compression="bf16" for every kind, unless `compression` says otherwise); "fp16" the same
        in float16, with dynamic loss scaling (model.loss_scaler: a step whose gradients overflow is skipped on
        every stage and the scale halves); "fp32" (the default) computes as the model is.
        A deploy replaces the cluster's previous deployment; its handle stops working once the coordinator took
        the new one. A model refused before that (it cannot be captured, a bad argument, too few shards) leaves
        the previous deployment training. Another client's deployment that its client still uses (its Links are
        open) is PERMISSION_DENIED, unless `take_over` and this client's token holds the shard role (the
        operator's); this Cluster's own last deployment, or one whose client is gone, it replaces.
        The handle starts in the model's mode (training, or eval after model.eval()); its train() and eval()
        switch it. Deploying leaves `model` as it was: weights, buffers, modes and torch's random stream.
        """
        options = DeployOptions.checked(
            optimizer=optimizer, compression=compression, replicas=replicas, balance=balance,
            split_points=split_points, layers_per_stage=layers_per_stage, num_stages=num_stages,
            virtual_stages=virtual_stages, snapshot_every=snapshot_every, take_over=take_over, weights=weights,
            recompute=recompute, precision=precision)
        module = layer_tools.as_module(model)
        clock = PhaseClock()
        with CAPTURING:  # one capture at a time in this process: deploys from several threads take turns here
            captured = steps.capture(module, example_input, example_inputs, example_kwargs, dynamic_shapes, weights)
            clock.done("capture whole")
            request = steps.plan(captured, options)
            clock.done("capture units")
        self._describe(request, captured, options)
        clock.done("describe")
        response = self._io.run(self._deploy_call(request))  # the coordinator partitions, places and ships
        clock.done("partition and load stages")
        shipped = Shipped.of(request, captured)
        distributed = self._take_over(response, shipped, options)
        try:
            steps.load(distributed, captured, request, options)
            clock.done("send weights")
            steps.ready(distributed, captured, request, options, clock)
        except BaseException:
            distributed.close()  # never handed out: its open links would hold the shards for nobody
            raise
        distributed._redeploy = functools.partial(self._redeploy, shipped)
        self._models.append(distributed)
        return distributed

    def _describe(self, request: coordinator_pb2.DeployRequest, captured: steps.Captured,
                  options: DeployOptions) -> None:
        """Describes the layers for the partitioner, over the shards a default deploy uses (the spares stay idle),
        and lets the previous deployment's calls end: shards hold one deployment at a time."""
        if self.spares and not options.chooses_stages:
            in_use = len(self.shards()) - self.spares
            request.partition.num_stages = max(1, min(in_use // options.replicas, len(request.layers)))
        with CAPTURING:
            steps.describe(request, captured, options)
        for previous in self._models:
            previous._settle()

    def _take_over(self, response: coordinator_pb2.DeployResponse, shipped: Shipped,
                   options: DeployOptions) -> DistributedModel:
        """The handle to the new deployment, once the previous one's handles are closed (only now: a deploy the
        coordinator refused leaves the previous model training)."""
        if not options.chooses_stages:
            self._warn_idle(response, len(shipped.request.layers), options.replicas)
        self._close_models()
        return self._io.run(steps.connect(response, shipped, self._io, self.security, self.timeouts))

    async def _redeploy(self, shipped: Shipped, prefer: list[str],
                        layers_per_stage: list[int]) -> tuple[list[StageClients], DistributedModel]:
        """Deploys `shipped` again with the same split, each stage on `prefer`'s shard where it lives (a spare
        elsewhere); the new deployment's replicas and a handle to it (whose weights are still to be restored)."""
        request = shipped.request
        again = coordinator_pb2.DeployRequest()
        again.CopyFrom(request)
        again.partition.CopyFrom(coordinator_pb2.PartitionSpec(layers_per_stage=layers_per_stage,
                                                               virtual_stages=request.partition.virtual_stages))
        again.prefer_addresses[:] = prefer
        response = await self._deploy_call(again)
        handle = await steps.connect(response, shipped, self._io, self.security, self.timeouts)
        return handle._trainer.replicas, handle

    def _warn_idle(self, response: coordinator_pb2.DeployResponse, layer_count: int, replicas: int) -> None:
        """Warns when a default deploy leaves shards (beyond the spares) without a stage, saying why."""
        used = len({stage.shard_address for stage in response.stages})
        idle = len(self.shards()) - self.spares - used
        if idle > 0:
            why = (f"the model has {layer_count} parts to cut between" if layer_count * replicas < used + idle
                   else "a stage of every shard would not balance better")
            warnings.warn(f"the deployment uses {used} of {used + idle} shards and leaves {idle} idle: {why}; "
                          "num_stages= or split_points= choose the stages", stacklevel=4)

    async def _deploy_call(self, request: coordinator_pb2.DeployRequest) -> coordinator_pb2.DeployResponse:
        """Deploy, carrying the secret of this client's last deployment, which the new one may replace."""
        metadata = auth.with_deployment(self._coordinator.metadata, self._secret)
        # The coordinator has the shards measure the layers and load their stages: the deadline grows with both.
        listed = await self._coordinator.call("ListShards", coordinator_pb2.ListShardsRequest())
        deadline = deploy_deadlines.deploy(self.timeouts.rpc, request.layers, len(listed.shards),
                                           request.partition.balance_by_time)
        response = await self._coordinator.call("Deploy", request, timeout=deadline, metadata=metadata)
        self._secret = response.deployment_secret
        return response

    def _close_models(self) -> None:
        models, self._models = self._models, []
        for model in models:
            model.close()

    def close(self) -> None:
        """Closes connections; stops the services only if Cluster.local started them."""
        try:
            self._close_models()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._io.run(self._coordinator.close())
        if self._services is not None:
            self._services.stop()
            self._services = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _root(root: str | os.PathLike) -> str:
    """A data root as a shard flag: a URL as it is, a local directory absolute."""
    root = os.fspath(root)
    return root if "://" in root else os.path.abspath(root)
