"""CoordinatorService over gRPC: registration, listing, and deploys that ship stages to shards."""

from __future__ import annotations

import asyncio
import logging
import uuid

from coordinator.placement import StagePlacement, place
from coordinator.registry import ShardRegistry
from shardtrain import optim, partition
from shardtrain.errors import InvalidArgument
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
        self.registry = ShardRegistry()

    @boundary
    async def RegisterShard(self, request, context):
        record = self.registry.register(request.address, request.device)
        log.info("registered %s at %s (%s)", record.shard_id, record.address, record.device)
        return coordinator_pb2.RegisterShardResponse(shard_id=record.shard_id)

    @boundary
    async def ListShards(self, request, context):
        return coordinator_pb2.ListShardsResponse(shards=[
            coordinator_pb2.ShardInfo(shard_id=s.shard_id, address=s.address, device=s.device)
            for s in self.registry.shards()])

    @boundary
    async def Deploy(self, request, context):
        layers = list(request.layers)
        _check_layers(layers)
        if request.optimizer.name not in optim.ALLOWED:
            raise InvalidArgument(f"optimizer {request.optimizer.name!r} is not allowed; choose one of {optim.ALLOWED}")
        spec = request.partition
        available = len(self.registry.shards())
        # By default one stage per shard, but never an empty stage when there are fewer layers than shards.
        ranges = partition.plan([layer.cost for layer in layers], spec.num_stages or min(available, len(layers)),
                                spec.split_points, spec.layers_per_stage)
        routes = route([Wiring(tuple(l.dependencies), tuple(l.out_variables)) for l in layers], ranges)
        placements = place(ranges, routes, self.registry.take(len(ranges)))
        deployment_id = uuid.uuid4().hex[:12]
        await asyncio.gather(*(self._ship(deployment_id, p, len(placements), layers, request)
                               for p in placements))
        log.info("deployed %s: %s", deployment_id,
                 [(p.shard.address, p.first_layer, p.end_layer) for p in placements])
        return coordinator_pb2.DeployResponse(deployment_id=deployment_id, stages=[
            coordinator_pb2.StageAssignment(stage=p.stage, shard_id=p.shard.shard_id, shard_address=p.shard.address,
                                            first_layer=p.first_layer, end_layer=p.end_layer)
            for p in placements])

    async def _ship(self, deployment_id: str, placement: StagePlacement, num_stages: int, layers, deploy) -> None:
        plan = shard_pb2.StagePlan(
            stage=placement.stage, num_stages=num_stages, previous_address=placement.previous_address,
            next_address=placement.next_address,
            incoming_residuals=[shard_pb2.ResidualSource(name=n, producer_stage=s, producer_address=a)
                                for n, (s, a) in placement.incoming.items()],
            outgoing_residuals=[shard_pb2.ResidualSink(name=n, consumer_stages=c)
                                for n, c in placement.outgoing.items()])
        request = shard_pb2.LoadStageRequest(deployment_id=deployment_id, plan=plan, optimizer=deploy.optimizer,
                                             layers=layers[placement.first_layer:placement.end_layer],
                                             encodings=deploy.encodings)
        shard = Peer(f"shard {placement.shard.shard_id} at {placement.shard.address}", placement.shard.address,
                     SHARD_SERVICE, self.settings.security, self.settings.timeouts.control)
        try:
            await shard.call("LoadStage", request)
        finally:
            await shard.close()


def _check_layers(layers) -> None:
    if not layers:
        raise InvalidArgument("a deploy needs at least one layer")
    indexes = [layer.index for layer in layers]
    if indexes != list(range(len(layers))):
        raise InvalidArgument(f"layers must be numbered 0..{len(layers) - 1} in order, got {indexes[:10]}")
