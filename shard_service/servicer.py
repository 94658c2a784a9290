"""ShardService over gRPC: decodes requests and hands them to the shard (shard.py) and Link loop
(link_dispatch.py). The per-call Forward, Backward, Step and FetchTensor RPCs start the same work as the SDK's Link items."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import resource
import secrets

import torch

from shard_service import snapshots
from shard_service.layer_profiling import MAX_LAYERS, REPEATS, profile_layers
from shard_service.link_dispatch import LinkedLoop
from shard_service.peers import Peers
from shard_service.shard import Shard
from shard_service.stage import Stage
from shardtrain import (auth, carrier, checkpoint, checkpoint_store, checksums, data_files, link_streams, metrics, optim,
                        rpc, shm, weights, wire)
from shardtrain.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from shardtrain.residuals import OUTPUT
from shardtrain.rpc import boundary
from shardtrain.rpc_streams import RequestReader
from shardtrain.settings import ShardSettings
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.shard")

# Opened by stages, with the shard role's token; the rest by the SDK, with the client's.
_STAGE_LINKS = (shard_pb2.LINK_ROLE_NEXT, shard_pb2.LINK_ROLE_RESIDUAL, shard_pb2.LINK_ROLE_TIED)


def _stage_state(stage: Stage) -> tuple[dict[str, torch.Tensor], optim.KeyedState, int]:
    """The stage's weights, optimizer state and last optimizer step, read together under the device's lock (a
    GPU's copied to the host here: the files are written after the lock is released)."""
    held = stage.weights.state()
    weights = {key: tensor.to("cpu", copy=True) if tensor.is_cuda else tensor for key, tensor in held.items()}
    state = stage.weights.optimizer_state()
    tensors = {key: tensor.to("cpu", copy=True) if tensor.is_cuda else tensor for key, tensor in state.tensors.items()}
    return weights, optim.KeyedState(state.groups, tensors, state.values), stage.weights.applied_step


def _listener(settings: ShardSettings, address: str) -> carrier.Listener | None:
    """A Unix socket for openers on this host, a TCP one for openers on others (over TLS when the shard serves
    TLS, with the same certificate)."""
    if not (settings.local_links or settings.tcp_links):
        return None
    bind_host = settings.bind.rpartition(":")[0].strip("[]")
    return carrier.Listener(unix=settings.local_links, tcp_bind=bind_host if settings.tcp_links else "",
                            tcp_advertise=address.rpartition(":")[0].strip("[]"),
                            tls=rpc.tls_server_context(settings.security))


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
        self.health = None  # the server's grpc.health.v1 status (set by build_server)

    def _expecting(self, check):
        """A tensor header check: `check`, then no larger than a stage here may hold."""
        def expect(header) -> None:
            check(header)
            self.shard.fits(header)
        return expect

    @property
    def location(self) -> str:
        """How errors name this shard."""
        return self.shard.location

    def _owned(self, context, deployment_id: str) -> Stage:
        """The stage, for a call on its deployment that carries the deployment's secret."""
        stage = self.shard.stage_for(deployment_id)
        auth.check_deployment(context, self.shard.secret, f"deployment {deployment_id}")
        return stage

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
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        stage = self._owned(context, (await reader.header()).deployment_id)
        tensors = await reader.tensors(expect=self._expecting(stage.weights.expect_weight))
        loaded = await self.shard.run(stage.weights.load_state, tensors)
        return shard_pb2.LoadStateResponse(loaded=loaded)

    def _may_read_from(self, context, address: str) -> None:
        """PermissionDenied unless the call carries the secret of this shard's deployment and `address` is one of
        its shards: the read there carries this shard's own token, which no caller may aim elsewhere."""
        if not self.shard.secret:
            raise PermissionDenied("this shard holds no deployment with a secret: it reads no other shard's "
                                   "snapshot for a caller")
        auth.check_deployment(context, self.shard.secret, f"deployment {self.shard.deployment_id}")
        self.peers.check_member(address)

    def _snapshot(self, context, name: str) -> snapshots.Snapshot:
        """A snapshot, for a call that carries the secret of the deployment that took it."""
        snapshot = self.snapshots.get(name)
        auth.check_deployment(context, snapshot.secret, f"snapshot {name!r} of deployment {snapshot.deployment_id}")
        return snapshot

    @boundary
    async def ReadState(self, request, context):
        if request.snapshot:  # another shard restoring from it: checked chunk by chunk
            weights, checksum = self._snapshot(context, request.snapshot).weights, checksums.STRONGEST
        else:
            stage = self._owned(context, request.deployment_id)
            weights, checksum = await self.shard.run(stage.weights.state), self.settings.checksums
        options = wire.SendOptions(self.settings.chunk_bytes, checksum=checksum)
        for name, tensor in weights.items():
            for frame in wire.tensor_frames(tensor, name, options):
                yield frame  # weights always travel exact

    @boundary
    async def ReadOptimizerState(self, request, context):
        header = shard_pb2.OptimizerStateHeader(deployment_id=request.deployment_id)
        if request.snapshot:
            snapshot = self._snapshot(context, request.snapshot)
            state, checksum = snapshot.optimizer, checksums.STRONGEST
            header.deployment_id = snapshot.deployment_id
            header.snapshot_optimizer_step = snapshot.optimizer_step
            header.snapshot_layer_indexes.extend(snapshot.layer_indexes)
            header.snapshot_stage = snapshot.stage
        else:
            stage = self._owned(context, request.deployment_id)
            state, checksum = await self.shard.run(stage.weights.optimizer_state), self.settings.checksums
        header.layout = state.layout()
        for frame in wire.framed(shard_pb2.OptimizerStateMessage, header, state.tensors,
                                 wire.SendOptions(self.settings.chunk_bytes, checksum=checksum)):
            yield frame  # exact, as weights

    @boundary
    async def Snapshot(self, request, context):
        stage = self._owned(context, request.deployment_id)
        name = snapshots.Snapshots.check_name(request.name)
        snapshot = await self.shard.run(snapshots.take, stage, request.deployment_id, self.shard.secret,
                                          request.copy, self.snapshots.held(name))
        self.snapshots.keep(name, snapshot)
        return shard_pb2.SnapshotResponse(optimizer_step=snapshot.optimizer_step, bytes=snapshot.bytes,
                                          stage=snapshot.stage, layer_indexes=snapshot.layer_indexes)

    @boundary
    async def RestoreStage(self, request, context):
        stage = self._owned(context, request.deployment_id)
        if request.source_address in ("", self.address):
            snapshot = self.snapshots.get(request.snapshot)
            if not hmac.compare_digest(snapshot.secret.encode(), request.source_deployment_secret.encode()):
                raise PermissionDenied(f"snapshot {request.snapshot!r} belongs to another deployment: "
                                       "source_deployment_secret is not its secret")
            moved = 0
        else:
            self._may_read_from(context, request.source_address)
            snapshot = await self.peers.read_snapshot(request.source_address, request.snapshot,
                                                      request.source_deployment_secret)
            moved = snapshot.bytes
        if tuple(stage.layer_indexes) != snapshot.layer_indexes:
            raise InvalidArgument(f"snapshot {request.snapshot!r} holds layers {list(snapshot.layer_indexes)}; "
                                  f"this stage holds layers {stage.layer_indexes}")
        state = snapshot.optimizer
        await self.shard.run(stage.weights.load_optimizer_state, state, True)  # refused: nothing changes
        await self.shard.run(stage.weights.load_state, snapshot.weights)  # copied into the stage's tensors
        if not moved:  # torch's optimizer keeps the tensors it loads: the snapshot held here keeps its own
            state = optim.KeyedState(state.groups, {key: t.clone() for key, t in state.tensors.items()}, state.values)
        await self.shard.run(stage.weights.load_optimizer_state, state)
        log.info("restored stage %d of deployment %s from snapshot %r of %s, at optimizer step %d", stage.index,
                 request.deployment_id, request.snapshot, request.source_address or "this shard",
                 snapshot.optimizer_step, extra=self.shard.fields(step=snapshot.optimizer_step))
        return shard_pb2.RestoreStageResponse(optimizer_step=snapshot.optimizer_step, bytes=moved)

    @boundary
    async def CopySnapshot(self, request, context):
        name = snapshots.Snapshots.check_name(request.name)
        if request.source_address in ("", self.address):
            raise InvalidArgument("CopySnapshot copies another shard's snapshot: source_address must name that shard")
        self._may_read_from(context, request.source_address)
        snapshot = await self.peers.read_snapshot(request.source_address, request.snapshot,
                                                  request.source_deployment_secret)
        self.snapshots.keep(name, snapshot)
        return shard_pb2.SnapshotResponse(optimizer_step=snapshot.optimizer_step, bytes=snapshot.bytes,
                                          stage=snapshot.stage, layer_indexes=snapshot.layer_indexes)

    @boundary
    async def SaveCheckpoint(self, request, context):
        stage = self._owned(context, request.deployment_id)
        directory = checkpoint.under(self.settings.checkpoint_dir, request.directory)
        generation = checkpoint_store.check_generation(request.generation)
        access = checkpoint_store.Access(self.settings.checkpoint_group)
        if request.description:
            written = await asyncio.to_thread(checkpoint.publish, directory, generation, request.description, access)
            return shard_pb2.SaveCheckpointResponse(bytes=written, files=[checkpoint.DESCRIPTION])
        checkpoint.part_files(request.part, request.parts)  # a bad part is refused before anything is made
        if request.discard:
            await asyncio.to_thread(checkpoint.discard_part, directory, generation, request.part, request.parts,
                                    access)
            return shard_pb2.SaveCheckpointResponse()
        weights, state, step = await self.shard.run(_stage_state, stage)
        files, written = await asyncio.to_thread(checkpoint.write_part, directory, generation, request.part,
                                                 request.parts, weights, state, step, access)
        return shard_pb2.SaveCheckpointResponse(bytes=written, files=files, optimizer_step=step)

    @boundary
    async def LoadCheckpoint(self, request, context):
        stage = self._owned(context, request.deployment_id)
        directory, held = checkpoint.under(self.settings.checkpoint_dir, request.directory), stage.weights
        _, weights, state, read = await asyncio.to_thread(checkpoint.read_parts, directory, held.state(),
                                                          held.optimizer_keys, request.optimizer, request.check_only)
        missing = sorted(set(held.state()) - set(weights))
        if missing:
            raise InvalidArgument(f"checkpoint {request.directory!r} holds no weight {missing[0]!r} of stage "
                                  f"{stage.index} ({len(missing)} of its {len(held.state())} missing)")
        if request.optimizer:  # checked in full before anything changes
            await self.shard.run(held.load_optimizer_state, state, True)
        await self.shard.run(held.load_state, weights, request.check_only)
        if request.optimizer and not request.check_only:
            await self.shard.run(held.load_optimizer_state, state)
        if not request.check_only:
            log.info("stage %d of deployment %s loaded checkpoint %s (%s)", stage.index, request.deployment_id,
                     request.directory, "weights and optimizer state" if request.optimizer else "weights",
                     extra=self.shard.fields())
        return shard_pb2.LoadCheckpointResponse(bytes=read, layout=state.layout() if request.optimizer else "")

    @boundary
    async def LoadWeights(self, request, context):
        stage = self._owned(context, request.deployment_id)
        if not self.settings.data_roots:
            raise FailedPrecondition("this shard reads no weights itself: start it with --data-root DIR or URL "
                                     "prefix (or SHARDTRAIN_DATA_ROOTS) over the checkpoint, or send the weights "
                                     "from the client")
        roots = [data_files.normalized_root(root) for root in self.settings.data_roots]
        provided = set(request.provided)
        names = {key: aliases for key, aliases in stage.weights.tensor_names().items() if not provided & set(aliases)}
        held = stage.weights.state()
        located = await asyncio.to_thread(weights.plan, request.source, names, held, roots, f"stage {stage.index}")
        response = shard_pb2.LoadWeightsResponse(
            loaded=sorted(alias for key in located for alias in names[key] if alias in held),
            files=sorted({entry.url for entry in located.values()}))
        if request.check_only:
            return response
        for batch in weights.batches(located):
            tensors = await asyncio.to_thread(weights.read, batch)
            response.bytes += sum(entry.end - entry.begin for entry in batch.values())
            every_key = {alias: tensors[key] for key in tensors for alias in names[key] if alias in held}
            await self.shard.run(stage.weights.load_state, every_key)
        metrics.moved("received", "weights", "storage", response.bytes)
        return response

    @boundary
    async def DropSnapshot(self, request, context):
        if self.snapshots.held(request.name) is None:
            return shard_pb2.DropSnapshotResponse(dropped=False)
        self._snapshot(context, request.name)  # only its deployment's client may drop it
        return shard_pb2.DropSnapshotResponse(dropped=self.snapshots.drop(request.name))

    @boundary
    async def LoadOptimizerState(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        held = self._owned(context, header.deployment_id).weights
        expect = self._expecting(held.expect_optimizer_tensor)
        state = optim.KeyedState.parse(header.layout, await reader.tensors(expect=expect))
        await self.shard.run(held.load_optimizer_state, state, header.check_only)
        return shard_pb2.LoadOptimizerStateResponse()

    @boundary
    async def Forward(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        stage = self._owned(context, header.key.deployment_id)
        if header.HasField("plan"):
            raise InvalidArgument("a planned step's forwards travel on Links, not on Forward calls")
        # not waiting for the sender to close its side
        checked = self._expecting(stage.expect_input) if stage.index == 0 else self.shard.fits  # else refused
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
        self._owned(context, header.key.deployment_id)
        await self.loop.per_call.backward_call(header, (await reader.tensors(expect=self.shard.fits)).get("gradient"))
        return shard_pb2.BackwardResponse()

    @boundary
    async def Step(self, request, context):
        self._owned(context, request.deployment_id)
        await self.loop.per_call.step_call(request)
        return shard_pb2.StepResponse()

    @boundary
    async def GradientNorm(self, request, context):
        self._owned(context, request.deployment_id)
        norm, parameter_norms = await self.loop.per_call.gradient_norm_call(request)
        return shard_pb2.GradientNormResponse(norm=norm, parameter_norms=parameter_norms)

    @boundary
    async def FetchTensor(self, request, context):
        self._owned(context, request.key.deployment_id)
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
        self._owned(context, header.key.deployment_id)
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
            self._owned(context, opening.deployment_id)
            self.loop.opened(opening, end)
        await link_streams.serve(request_iterator, context, f"link to {self.shard.location}", opened,
                                 self.loop.on_item, self.loop.closed, self.local_links)

    @boundary
    async def Describe(self, request, context):
        stage = self.shard.stage
        return shard_pb2.DescribeResponse(
            address=self.address, device=self.settings.device, deployment_id=self.shard.deployment_id,
            stage=stage.index if stage else -1, layer_indexes=stage.layer_indexes if stage else [],
            in_flight_steps=[key[0] for key in stage.in_flight_steps] if stage else [],
            parameter_count=stage.weights.parameter_count if stage else 0, flush_denormal=self.settings.flush_denormal,
            instance=self.instance, checkpoint_dir=self.settings.checkpoint_dir,
            client_attached=self.loop.client_attached, memory=self._memory(stage) if request.memory else None)

    def _memory(self, stage: Stage | None) -> shard_pb2.StageMemory:
        """What the stage holds; only when asked: a health probe's Describe need not sum every tensor."""
        held, gradients, optimizer = stage.weights.memory() if stage else (0, 0, 0)
        device = torch.device(self.settings.device)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts it in KiB
        return shard_pb2.StageMemory(weight_bytes=held, gradient_bytes=gradients, optimizer_bytes=optimizer,
                                     peak_activation_bytes=stage.peak_activation_bytes if stage else 0,
                                     peak_process_bytes=peak)

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
