"""CoordinatorService over gRPC: registration, listing, and deploys that ship stages to shards."""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Callable

from coordinator.placement import StagePlacement, place, tied_stages
from coordinator.registry import ShardRecord, ShardRegistry
from shardtrain import (auth, deploy_deadlines, logs, metrics, optim, partition, precision, recompute_modes, schedule,
                        wire)
from shardtrain.capture import CapturedProgram
from shardtrain.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
                               ShardtrainError)
from shardtrain.residuals import Wiring, route
from shardtrain.rpc import SHARD_SERVICE, Peer, boundary
from shardtrain.settings import CoordinatorSettings
from shardtrain.v1 import coordinator_pb2, shard_pb2

log = logging.getLogger("shardtrain.coordinator")


class CoordinatorServicer:
    """The gRPC face of the coordinator."""

    def __init__(self, settings: CoordinatorSettings, address: str):
        self.settings = settings
        self.location = f"coordinator {address}"
        self.registry = ShardRegistry(expiry=settings.timeouts.expiry)
        self.health = None  # the server's grpc.health.v1 status (set by build_server)
        # Per shard address: (the shard's instance, deployment id, secret) of the deployment shipped there last.
        self._owners: dict[str, tuple[str, str, str]] = {}
        self._deployment: coordinator_pb2.DescribeDeploymentResponse | None = None  # the last deploy's, for anyone

    @boundary
    async def RegisterShard(self, request, context):
        holder = self.registry.holder(request.address)
        if holder is not None and holder.instance != request.instance:
            await self._check_takeover(holder, request.instance)
        record = self.registry.register(request.address, request.device, request.memory_bytes, request.instance,
                                        request.device_group, request.control_key, request.compute)
        metrics.registered_shards(len(self.registry.shards()))  # heartbeats keep it current as others expire
        # A heartbeat registers again every few seconds: only a shard new at this address is worth a line.
        log.log(logging.INFO if holder is None or holder.instance != request.instance else logging.DEBUG,
                "registered %s at %s (%s)", record.shard_id, record.address, record.device)
        return coordinator_pb2.RegisterShardResponse(shard_id=record.shard_id)

    @boundary
    async def ListShards(self, request, context):
        return coordinator_pb2.ListShardsResponse(shards=[
            coordinator_pb2.ShardInfo(shard_id=s.shard_id, address=s.address, device=s.device,
                                      memory_bytes=s.memory_bytes, device_group=s.device_group)
            for s in self.registry.shards()])

    @boundary
    async def Deploy(self, request, context):
        layers = list(request.layers)
        _check_layers(layers)
        if request.optimizer.name not in optim.ALLOWED:
            raise InvalidArgument(f"optimizer {request.optimizer.name!r} is not allowed; choose one of {optim.ALLOWED}")
        recompute_modes.check(request.recompute)
        precision.check(request.precision)
        spec, replicas = request.partition, max(request.replicas, 1)
        per_device = max(spec.virtual_stages, 1)

        def stage_count(registered: int) -> int:
            # By default one stage per shard (of a replica), but never an empty stage when there are fewer layers.
            num_stages = spec.num_stages or min(registered // replicas, len(layers))
            return len(spec.split_points) + 1 if spec.split_points else len(spec.layers_per_stage) or num_stages
        prefer = list(request.prefer_addresses) if per_device == 1 else []
        await self._forget_silent_shards(
            lambda registered: self.registry.take(min(stage_count(len(registered)) * replicas, len(registered)),
                                                  prefer))
        available = len(self.registry.shards()) // replicas
        if available < 1:
            raise FailedPrecondition(f"{replicas} replicas need at least {replicas} shards; "
                                     f"{len(self.registry.shards())} have registered")
        num_stages = spec.num_stages or min(available, len(layers))
        count = stage_count(available * replicas)
        costs, memory, unit = [layer.cost for layer in layers], [max(layer.memory_bytes, 0) for layer in layers], \
            PARAMETERS
        candidates = self._stage_shards(count, replicas, per_device)
        if spec.balance_by_time and not (spec.split_points or spec.layers_per_stage) and candidates:
            # another client's deployment is refused before its shards measure anything for this one
            await self._check_owners(context, request, list({id(s): s for group in candidates for s in group}.values()))
            costs, memory, unit = *await self._measure(layers, candidates), MEASURED
        capacities = [min(shard.memory_bytes for shard in shards) for shards in candidates]
        ranges = partition.plan(costs, num_stages, spec.split_points, spec.layers_per_stage, memory, capacities)
        routes = route([Wiring(tuple(layer.dependencies), tuple(layer.out_variables)) for layer in layers], ranges,
                       request.inputs, request.outputs)
        shards = self.registry.take(len(ranges) * replicas, prefer) if per_device == 1 else \
            self.registry.by_device(len(ranges), replicas, per_device)
        await self._check_owners(context, request, shards)
        tied = tied_stages(ranges, [[entry.tied_to for entry in layer.state if entry.tied_to] for layer in layers])
        pipelines = [place(ranges, routes, shards[r * len(ranges):(r + 1) * len(ranges)], tied)
                     for r in range(replicas)]
        deployment_id, secret = uuid.uuid4().hex[:12], auth.new_deployment_secret()
        await self._ship_all((deployment_id, secret), pipelines, layers, request)
        replaced = self._record_owners(deployment_id, secret, shards)
        metrics.deployed()
        log.info("deployed %s%s: %s", deployment_id, f" in place of {', '.join(sorted(replaced))}" if replaced else "",
                 [[(p.shard.address, p.first_layer, p.end_layer) for p in pipeline] for pipeline in pipelines],
                 extra=logs.fields(deployment=deployment_id))
        stage_costs = [row[first:end] for row, (first, end) in zip(partition.rows(costs, len(ranges)), ranges)]
        stages = [
            coordinator_pb2.StageAssignment(stage=p.stage, shard_id=p.shard.shard_id, shard_address=p.shard.address,
                                            first_layer=p.first_layer, end_layer=p.end_layer, replica=replica,
                                            cost=sum(stage_costs[p.stage]), layer_costs=stage_costs[p.stage])
            for replica, pipeline in enumerate(pipelines) for p in pipeline]
        self._deployment = _description(deployment_id, len(ranges), replicas, stages, layers, request)
        return coordinator_pb2.DeployResponse(deployment_id=deployment_id, deployment_secret=secret, cost_unit=unit,
                                              stages=stages)

    @boundary
    async def DescribeDeployment(self, request, context):
        if self._deployment is None:
            raise NotFound("nothing has been deployed through this coordinator since it started")
        return self._deployment

    async def _check_owners(self, context, request, shards: list[ShardRecord]) -> None:
        """PermissionDenied when a shard the deploy takes holds a deployment whose client is still there (its SDK
        has a Link open on one of its shards), unless the call carries that deployment's secret, or asks to take
        over and the caller has the shard role (the operator). A deployment whose client went away is free."""
        presented = dict(context.invocation_metadata() or ()).get(auth.DEPLOYMENT_METADATA, "")
        held: dict[str, ShardRecord] = {}
        for shard in shards:
            owner = self._owners.get(shard.address)
            if owner is None or owner[0] != shard.instance:  # nothing shipped there, or the process restarted since
                continue
            if not hmac.compare_digest(presented.encode(), owner[2].encode()):
                held.setdefault(owner[1], shard)
        if not held or request.take_over and auth.SHARD in auth.caller_roles(context, self.settings.security):
            for deployment_id, shard in held.items():
                log.warning("deploy takes over deployment %s (on %s) without its secret", deployment_id, shard.address)
            return
        for deployment_id, shard in held.items():
            addresses = [address for address, owner in self._owners.items() if owner[1] == deployment_id]
            answers = await asyncio.gather(*(self._describe(address) for address in addresses))
            if any(a is not None and a.deployment_id == deployment_id and a.client_attached for a in answers):
                raise PermissionDenied(
                    f"{shard.shard_id} at {shard.address} holds deployment {deployment_id}, whose client is still "
                    f"attached: a deploy replaces it only when it carries that deployment's secret as the "
                    f"{auth.DEPLOYMENT_METADATA!r} metadata (the SDK sends its last deployment's). Close the model "
                    "that holds it (model.close(), or its Cluster), or deploy with take_over=True under a token "
                    "that holds the shard role (the operator's)")
            log.debug("deploy replaces deployment %s: its client is gone", deployment_id)  # its info line says so

    def _record_owners(self, deployment_id: str, secret: str, shards: list[ShardRecord]) -> set[str]:
        """The deployment now owns `shards`; one that lost any shard to it is gone everywhere. Returns those."""
        taken = {shard.address for shard in shards}
        replaced = {owner[1] for address, owner in self._owners.items() if address in taken}
        self._owners = {address: owner for address, owner in self._owners.items() if owner[1] not in replaced}
        for shard in shards:
            self._owners[shard.address] = (shard.instance, deployment_id, secret)
        return replaced

    async def _measure(self, layers, candidates: list[list[ShardRecord]]) -> tuple[list[list[int]], list[list[int]]]:
        """Per stage, each layer's measured microseconds and memory (its weights, and the activations it saved)
        on that stage's shards (`candidates`), the slowest replica's. Of the shards that time a layer alike (one
        host, one kind of compute) one measures for all; shards on one host measure one after another, so that
        they do not slow each other; hosts measure at once."""
        shards = [shard for stage_shards in candidates for shard in stage_shards]
        request = shard_pb2.ProfileLayersRequest(layers=layers, repeats=PROFILE_REPEATS)
        groups: dict[tuple[str, str], list[ShardRecord]] = {}
        for shard in shards:
            groups.setdefault(shard.measures_like, []).append(shard)
        by_host: dict[str, list[list[ShardRecord]]] = {}
        for group in groups.values():
            by_host.setdefault(group[0].address.rpartition(":")[0], []).append(group)
        deadline = deploy_deadlines.profile(self.settings.timeouts.rpc, layers)

        async def measure_host(host_groups) -> dict[str, list]:
            answers = {}
            for group in host_groups:
                profile = list((await self._call(group[0], "ProfileLayers", request, deadline)).layers)
                answers.update({shard.address: profile for shard in group})
            return answers
        measured = {}
        for answers in await asyncio.gather(*(measure_host(host_groups) for host_groups in by_host.values())):
            measured.update(answers)
        costs, memory = [], []
        for stage_shards in candidates:
            profiles = [measured[shard.address] for shard in stage_shards]
            costs.append([max(p[i].microseconds for p in profiles) for i in range(len(layers))])
            memory.append([max(layer.memory_bytes, 0) + max(p[i].activation_bytes for p in profiles)
                           for i, layer in enumerate(layers)])
        log.debug("measured %d layers on %d of %d shards: %s us per stage's shard", len(layers), len(groups),
                  len(shards), [sum(row) for row in costs])
        return costs, memory

    def _stage_shards(self, count: int, replicas: int, per_device: int = 1) -> list[list[ShardRecord]]:
        """Per stage of `count`, the shards its replicas will run on (replica r's stage i goes to the
        (r x count + i)-th shard, as registry.take or by_device hand them out); none when too few have registered."""
        registered = self.registry.shards()
        if per_device > 1:
            try:
                registered = self.registry.by_device(count, replicas, per_device)
            except ShardtrainError:
                return []  # by_device refuses the deploy, with the numbers
        if count * replicas > len(registered):
            return []  # take() refuses the deploy, with the numbers
        return [[registered[r * count + i] for r in range(replicas)] for i in range(count)]

    async def _forget_silent_shards(self, wanted: Callable[[list[ShardRecord]], list[ShardRecord]]) -> None:
        """Probes the shards a deploy will take (`wanted(the registered shards)`) and drops each that does not answer
        now (it died, or its registration was never a shard's), then probes the ones that take their place, until
        the shards it will take all answer or too few are left. Only those are probed, however many have
        registered; a live one that was dropped registers again at its next heartbeat."""
        answered: set[str] = set()
        while True:
            shards = [shard for shard in wanted(self.registry.shards()) if shard.address not in answered]
            if not shards:
                return
            for shard, answer in zip(shards, await asyncio.gather(*(self._describe(s.address) for s in shards))):
                if answer is not None:
                    answered.add(shard.address)
                else:
                    log.warning("forgetting %s at %s: it did not answer", shard.shard_id, shard.address)
                    self.registry.forget(shard.address)

    async def _check_takeover(self, holder: ShardRecord, instance: str) -> None:
        """Another process registers an address that a shard holds: that is a restart when the process answering
        at the address is the one registering (or nothing answers there any more); otherwise ALREADY_EXISTS."""
        answer = await self._describe(holder.address)
        if answer is not None and answer.instance != instance:  # None: the holder is gone, the address is free
            raise AlreadyExists(f"{holder.address} is registered by a live shard ({holder.shard_id}) that answers "
                                "there; another process cannot register that address")

    async def _describe(self, address: str) -> shard_pb2.DescribeResponse | None:
        """The shard at `address` describing itself within the probe deadline, or None."""
        peer = Peer(f"shard at {address}", address, SHARD_SERVICE, self.settings.security, self.settings.timeouts.probe)
        try:
            return await peer.call("Describe", shard_pb2.DescribeRequest())
        except ShardtrainError:  # nothing there, too slow, or not a shard of this cluster (other service, token)
            return None
        finally:
            await peer.close()

    async def _ship_all(self, deployment: tuple[str, str], pipelines, layers, request) -> None:
        """Replica 0 first: its shards host the rendezvous where each stage's other replicas meet. Every stage
        learns every registered shard of the deployment: the only ones it reads snapshots from."""
        members = [p.shard.address for pipeline in pipelines for p in pipeline]
        first = await asyncio.gather(*(self._ship(deployment, p, len(pipelines[0]), layers, request,
                                                  0, len(pipelines), "", members) for p in pipelines[0]))
        await asyncio.gather(*(self._ship(deployment, p, len(pipeline), layers, request, replica, len(pipelines),
                                          first[p.stage].rendezvous, members)
                               for replica, pipeline in enumerate(pipelines) if replica for p in pipeline))

    @boundary
    async def PlanSchedule(self, request, context):
        per_microbatch = 3 if request.schedule in schedule.SPLIT_BACKWARD else 2
        if per_microbatch * request.num_stages * request.microbatches > schedule.MAX_PLAN_ACTIONS:
            raise InvalidArgument(f"a plan of {request.num_stages} stages x {request.microbatches} micro-batches has "
                                  f"{per_microbatch * request.num_stages * request.microbatches} actions; at most "
                                  f"{schedule.MAX_PLAN_ACTIONS} are planned at once")
        per_device = max(request.virtual_stages, 1)
        plans = [schedule.stage_actions(request.schedule, stage, request.num_stages, request.microbatches, per_device)
                 for stage in range(max(request.num_stages, 1))]
        return coordinator_pb2.PlanScheduleResponse(stages=[
            coordinator_pb2.StageActions(stage=stage, actions=[
                shard_pb2.PipelineAction(backward=a.op == schedule.BACKWARD, weight=a.op == schedule.WEIGHT,
                                         microbatch=a.microbatch) for a in plan])
            for stage, plan in enumerate(plans)])

    async def _ship(self, deployment: tuple[str, str], placement: StagePlacement, num_stages: int, layers, deploy,
                    replica: int, num_replicas: int, rendezvous: str,
                    members: list[str]) -> shard_pb2.LoadStageResponse:
        plan = shard_pb2.StagePlan(
            stage=placement.stage, num_stages=num_stages, previous_address=placement.previous_address,
            next_address=placement.next_address, replica=replica, num_replicas=num_replicas, rendezvous=rendezvous,
            virtual_stages=max(deploy.partition.virtual_stages, 1),
            incoming_residuals=[shard_pb2.ResidualSource(name=n, producer_stage=s, producer_address=a)
                                for n, (s, a) in placement.incoming.items()],
            outgoing_residuals=[shard_pb2.ResidualSink(name=n, consumer_stages=c,
                                                       consumer_addresses=placement.consumers.get(n, []))
                                for n, c in placement.outgoing.items()],
            tied=[shard_pb2.TiedWeight(key=key, stages=[s for s, _ in holders], addresses=[a for _, a in holders])
                  for key, holders in placement.tied.items()],
            shard_addresses=members)
        request = shard_pb2.LoadStageRequest(deployment_id=deployment[0], deployment_secret=deployment[1], plan=plan,
                                             optimizer=deploy.optimizer,
                                             layers=layers[placement.first_layer:placement.end_layer],
                                             encodings=deploy.encodings, recompute=deploy.recompute,
                                             precision=deploy.precision)
        return await self._call(placement.shard, "LoadStage", request,
                                deploy_deadlines.load(self.settings.timeouts.control, request.layers))

    async def _call(self, shard: ShardRecord, method: str, request, timeout: float = 0.0):
        peer = Peer(f"shard {shard.shard_id} at {shard.address}", shard.address, SHARD_SERVICE,
                    self.settings.security, timeout or self.settings.timeouts.control)
        try:
            return await peer.call(method, request, metadata=auth.with_control(peer.metadata, shard.control_key))
        finally:
            await peer.close()


MEASURED, PARAMETERS = "us of forward and backward", "parameters"  # what a deploy's costs count
PROFILE_REPEATS = 3  # timed runs of each layer on each shard, after a warm-up; the median counts

MAX_LAYERS = 10_000  # layers in one deploy; each is checked and shipped, so the count bounds the work


def _check_layers(layers) -> None:
    if not layers:
        raise InvalidArgument("a deploy needs at least one layer")
    if len(layers) > MAX_LAYERS:
        raise InvalidArgument(f"a deploy of {len(layers)} layers; at most {MAX_LAYERS} are allowed")
    indexes = [layer.index for layer in layers]
    if indexes != list(range(len(layers))):
        raise InvalidArgument(f"layers must be numbered 0..{len(layers) - 1} in order, got {indexes[:10]}")


def _description(deployment_id: str, num_stages: int, replicas: int, stages: list, layers: list,
                 request: coordinator_pb2.DeployRequest) -> coordinator_pb2.DescribeDeploymentResponse:
    """What DescribeDeployment tells: the stages, and the model's inputs and outputs as the captured graphs take
    and give them (read from the first layer, the layers that read the other inputs, and the last layer)."""
    description = coordinator_pb2.DescribeDeploymentResponse(deployment_id=deployment_id, num_stages=num_stages,
                                                             replicas=replicas, stages=stages)
    try:
        description.inputs.append(_named("input", CapturedProgram(layers[0].program).input_specs()[0]))
        for name in request.inputs:
            reader = next(layer for layer in layers if name in layer.dependencies)
            spec = CapturedProgram(reader.program).input_specs()[1 + list(reader.dependencies).index(name)]
            description.inputs.append(_named(name, spec))
        last = CapturedProgram(layers[-1].program).output_specs()
        description.outputs.append(_named("output", last[0]))
        saved = list(layers[-1].out_variables)
        for name in request.outputs:
            description.outputs.append(_named(name, last[1 + saved.index(name)]))
    except (ShardtrainError, StopIteration, IndexError, ValueError) as error:  # the shards ran it: describe less
        log.warning("deployment %s: its inputs and outputs could not be read from its layers: %r", deployment_id,
                    error)
        del description.inputs[:], description.outputs[:]
    return description


def _named(name: str, spec) -> coordinator_pb2.NamedTensorSpec:
    return coordinator_pb2.NamedTensorSpec(name=name, dtype=wire.dtype_code(spec.dtype),
                                           shape=[-1 if size is None else size for size in spec.shape])
