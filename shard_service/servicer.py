"""ShardService over gRPC: decodes requests and hands them to the shard (shard.py), the Link loop (link_dispatch.py)
and the state RPCs (stage_state_rpcs.py). The per-call Forward, Backward, Step and FetchTensor RPCs start the same
work as the SDK's Link items."""

from __future__ import annotations

import os
import secrets

import torch

from shard_service import snapshots
from shard_service.device import peak_memory
from shard_service.layer_profiling import MAX_LAYERS, REPEATS, profile_layers
from shard_service.link_dispatch import LinkedLoop
from shard_service.peers import Peers
from shard_service.shard import Shard
from shard_service.stage import Stage
from shard_service.stage_state_rpcs import StageStateRPCs, expecting, owned
from shardtrain import auth, carrier, link_streams, rpc, shm, wire
from shardtrain.errors import InvalidArgument, PermissionDenied
from shardtrain.residuals import OUTPUT
from shardtrain.rpc import boundary
from shardtrain.rpc_streams import RequestReader
from shardtrain.settings import ShardSettings
from shardtrain.v1 import shard_pb2

# Opened by stages, with the shard role's token; the rest by the SDK, with the client's.
_STAGE_LINKS = (shard_pb2.LINK_ROLE_NEXT, shard_pb2.LINK_ROLE_RESIDUAL, shard_pb2.LINK_ROLE_TIED)


def _listener(settings: ShardSettings, address: str) -> carrier.Listener | None:
    """A Unix socket for openers on this host, a TCP one for openers on others (over TLS when the shard serves
    TLS, with the same certificate)."""
    if not (settings.local_links or settings.tcp_links):
        return None
    bind_host = settings.bind.rpartition(":")[0].strip("[]")
    return carrier.Listener(unix=settings.local_links, tcp_bind=bind_host if settings.tcp_links else "",
                            tcp_advertise=address.rpartition(":")[0].strip("[]"),
                            tls=rpc.tls_server_context(settings.security))


def _memory(stage: Stage | None, device: str) -> shard_pb2.StageMemory:
    """What the stage holds; only when asked: a health probe's Describe need not sum every tensor."""
    held, gradients, optimizer = stage.weights.memory() if stage else (0, 0, 0)
    return shard_pb2.StageMemory(weight_bytes=held, gradient_bytes=gradients, optimizer_bytes=optimizer,
                                 peak_activation_bytes=stage.peak_activation_bytes if stage else 0,
                                 peak_process_bytes=peak_memory(device))


class ShardServicer:
    """The gRPC face of one shard."""

    def __init__(self, settings: ShardSettings, address: str, device=None):
        self.settings = settings
        self.address = address
        self.instance = secrets.token_hex(8)  # what it registers with: no other shard can take its address
        self.control_key = secrets.token_urlsafe(32)  # what only the coordinator it registered with presents
        self.shard = Shard(settings, address, device)  # on a device of its own, or its process's
        self.peers = Peers(settings)  # channels to the other shards, and how tensors reach each
        self.loop = LinkedLoop(self.shard, self.peers)  # the Link items: the PyTorch-shaped loop and planned steps
        self.local_links = _listener(settings, address)  # sockets that carry Link items instead of gRPC streams
        self.snapshots = snapshots.Snapshots()  # stage states kept apart from the deployment, for a later one
        self.state = StageStateRPCs(settings, self.shard, self.peers, self.snapshots)  # the state RPCs' work
        self.health = None  # the server's grpc.health.v1 status (set by build_server)

    @property
    def location(self) -> str:
        """How errors name this shard."""
        return self.shard.location

    @boundary
    async def LoadStage(self, request, context):
        auth.check_control(context, self.control_key, "LoadStage")
        previous = self.shard.deployment_id
        response = await self.shard.load(request)
        self.snapshots.retain({previous, request.deployment_id})  # the one before: a recovery restores from it
        # The previous deployment's link work ends before anything else runs: awaited later, it could still record
        # its outcomes in the new deployment's StepOrder.
        await self.loop.reset(request.deployment_id)
        await self.peers.adopt(request.plan, request.encodings, request.deployment_secret)
        return response

    @boundary
    async def ProfileLayers(self, request, context):
        auth.check_control(context, self.control_key, "ProfileLayers")
        if len(request.layers) > MAX_LAYERS:
            raise InvalidArgument(f"{len(request.layers)} layers to measure; at most {MAX_LAYERS} at once")
        device = torch.device(self.settings.device)
        layers = await self.shard.run(profile_layers, list(request.layers), request.repeats or REPEATS, device)
        return shard_pb2.ProfileLayersResponse(layers=layers, device=str(device))

    @boundary
    async def LoadState(self, request_iterator, context):
        return await self.state.load_state(request_iterator, context)

    @boundary
    async def ReadState(self, request, context):
        async for frame in self.state.read_state(request, context):
            yield frame

    @boundary
    async def ReadOptimizerState(self, request, context):
        async for frame in self.state.read_optimizer_state(request, context):
            yield frame

    @boundary
    async def Snapshot(self, request, context):
        return await self.state.take_snapshot(request, context)

    @boundary
    async def RestoreStage(self, request, context):
        return await self.state.restore_stage(request, context)

    @boundary
    async def CopySnapshot(self, request, context):
        return await self.state.copy_snapshot(request, context)

    @boundary
    async def SaveCheckpoint(self, request, context):
        return await self.state.save_checkpoint(request, context)

    @boundary
    async def LoadCheckpoint(self, request, context):
        return await self.state.load_checkpoint(request, context)

    @boundary
    async def LoadWeights(self, request, context):
        return await self.state.load_weights(request, context)

    @boundary
    async def DropSnapshot(self, request, context):
        return await self.state.drop_snapshot(request, context)

    @boundary
    async def LoadOptimizerState(self, request_iterator, context):
        return await self.state.load_optimizer_state(request_iterator, context)

    @boundary
    async def Forward(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        stage = owned(self.shard, context, header.key.deployment_id)
        if header.HasField("plan"):
            raise InvalidArgument("a planned step's forwards travel on Links, not on Forward calls")
        # not waiting for the sender to close its side
        checked = expecting(self.shard, stage.expect_input) if stage.index == 0 else self.shard.fits  # else refused
        tensors = await reader.tensors(count=1, expect=checked)
        if len(tensors) != 1:
            raise InvalidArgument(f"Forward carries exactly one activation tensor, got {len(tensors)}")
        if header.HasField("step_first"):
            await self.loop.per_call.step_call(header.step_first)
            header.ClearField("step_first")
        await self.loop.per_call.forward_call(header, next(iter(tensors.values())))
        return shard_pb2.ForwardResponse()

    @boundary
    async def Backward(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        owned(self.shard, context, header.key.deployment_id)
        await self.loop.per_call.backward_call(header, (await reader.tensors(expect=self.shard.fits)).get("gradient"))
        return shard_pb2.BackwardResponse()

    @boundary
    async def Step(self, request, context):
        owned(self.shard, context, request.deployment_id)
        await self.loop.per_call.step_call(request)
        return shard_pb2.StepResponse()

    @boundary
    async def GradientNorm(self, request, context):
        owned(self.shard, context, request.deployment_id)
        norm, parameter_norms = await self.loop.per_call.gradient_norm_call(request)
        return shard_pb2.GradientNormResponse(norm=norm, parameter_norms=parameter_norms)

    @boundary
    async def FetchTensor(self, request, context):
        owned(self.shard, context, request.key.deployment_id)
        residuals = tuple(self.shard.stage_for(request.key.deployment_id).residuals.incoming)
        tensor = await self.loop.calls.fetch(request.key, request.name, self.settings.timeouts.peer_wait, residuals)
        kind = "activations" if request.name == OUTPUT else "residuals" if request.name in residuals else "gradients"
        options = self.peers.options(request.shared_memory, kind)
        for frame in wire.tensor_frames(tensor, request.name, options, start=request.offset):
            yield frame
        self.loop.calls.fetched(request.key, request.name)  # kept until then, so a broken stream can resume

    @boundary
    async def AccumulateGradient(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        owned(self.shard, context, header.key.deployment_id)
        grad = (await reader.tensors(expect=self.shard.fits)).get(header.name) if header.has_gradient else None
        await self.shard.accumulate(header.key, header.name, grad)
        return shard_pb2.AccumulateGradientResponse()

    @boundary
    async def Link(self, request_iterator, context):
        roles = auth.caller_roles(context, self.settings.security)

        def opened(opening: shard_pb2.LinkOpen, end: link_streams.LinkEnd) -> None:
            needed = auth.SHARD if opening.role in _STAGE_LINKS else auth.CLIENT
            if needed not in roles:
                raise PermissionDenied(f"a {shard_pb2.LinkRole.Name(opening.role)} link takes the {needed} role's "
                                       f"token; this caller has the {' or '.join(sorted(roles))} role")
            owned(self.shard, context, opening.deployment_id)
            self.loop.opened(opening, end)
        await link_streams.serve(request_iterator, context, f"link to {self.shard.location}", opened,
                                 self.loop.on_item, self.loop.closed, self.local_links)

    @boundary
    async def Describe(self, request, context):
        stage = self.shard.stage
        memory = _memory(stage, self.settings.device) if request.memory else None
        return shard_pb2.DescribeResponse(
            address=self.address, device=self.settings.device, deployment_id=self.shard.deployment_id,
            stage=stage.index if stage else -1, layer_indexes=stage.layer_indexes if stage else [],
            in_flight_steps=[key[0] for key in stage.in_flight_steps] if stage else [],
            parameter_count=stage.weights.parameter_count if stage else 0, flush_denormal=self.settings.flush_denormal,
            instance=self.instance, checkpoint_dir=self.settings.checkpoint_dir,
            client_attached=self.loop.client_attached, memory=memory)

    @boundary
    async def ProbeSharedMemory(self, request, context):
        return shard_pb2.ProbeSharedMemoryResponse(token=shm.read_probe(request.path), uid=os.getuid())

    async def close(self) -> None:
        """Ends the links, closes peer channels, the compute thread and this shard's shared segments."""
        await self.loop.close()
        await self.shard.close()
        await self.peers.close()
        if self.local_links is not None:
            await self.local_links.close()
