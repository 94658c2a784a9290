"""The RPCs that move a stage's state in and out of a shard: weights and optimizer state read and loaded, snapshots
taken, copied, restored and dropped, checkpoints saved and loaded, weights read from storage. The servicer
(servicer.py) hands each its request and the call's context; the checks a call on a deployment passes (`owned`,
`expecting`) live here, and the servicer's other RPCs use them too."""

from __future__ import annotations

import asyncio
import hmac
import logging

import torch

from shard_service import snapshots
from shard_service.peers import Peers
from shard_service.shard import Shard
from shard_service.stage import Stage
from shardtrain import auth, checkpoint, checkpoint_store, checksums, data_files, metrics, optim, weights, wire
from shardtrain.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from shardtrain.rpc_streams import RequestReader
from shardtrain.settings import ShardSettings
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.shard")


def owned(shard: Shard, context, deployment_id: str) -> Stage:
    """The stage, for a call on its deployment that carries the deployment's secret."""
    stage = shard.stage_for(deployment_id)
    auth.check_deployment(context, shard.secret, f"deployment {deployment_id}")
    return stage


def expecting(shard: Shard, check):
    """A tensor header check: `check`, then no larger than a stage here may hold."""
    def expect(header) -> None:
        check(header)
        shard.fits(header)
    return expect


def _stage_state(stage: Stage) -> tuple[dict[str, torch.Tensor], optim.KeyedState, int]:
    """The stage's weights, optimizer state and last optimizer step, read together under the device's lock (a
    GPU's copied to the host here: the files are written after the lock is released)."""
    held = stage.weights.state()
    weights = {key: tensor.to("cpu", copy=True) if tensor.is_cuda else tensor for key, tensor in held.items()}
    state = stage.weights.optimizer_state()
    tensors = {key: tensor.to("cpu", copy=True) if tensor.is_cuda else tensor for key, tensor in state.tensors.items()}
    return weights, optim.KeyedState(state.groups, tensors, state.values), stage.weights.applied_step


class StageStateRPCs:
    """The state RPCs of one shard, whichever deployment it holds: each takes its request and the call's context
    (for the deployment's secret) and answers with its response, or its frames."""

    def __init__(self, settings: ShardSettings, shard: Shard, peers: Peers, kept: snapshots.Snapshots):
        self.settings = settings
        self.shard = shard
        self.peers = peers  # other shards' snapshots are read through them
        self.snapshots = kept  # stage states kept apart from the deployment, for a later one

    async def load_state(self, request_iterator, context):
        """Weights streamed in by the client, each header checked against the stage's as it arrives."""
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        stage = owned(self.shard, context, (await reader.header()).deployment_id)
        tensors = await reader.tensors(expect=expecting(self.shard, stage.weights.expect_weight))
        loaded = await self.shard.run(stage.weights.load_state, tensors)
        return shard_pb2.LoadStateResponse(loaded=loaded)

    async def read_state(self, request, context):
        """The stage's weights, or a snapshot's for another shard restoring from it, as tensor frames."""
        if request.snapshot:  # another shard restoring from it: checked chunk by chunk
            weights, checksum = self._snapshot(context, request.snapshot).weights, checksums.STRONGEST
        else:
            stage = owned(self.shard, context, request.deployment_id)
            weights, checksum = await self.shard.run(stage.weights.state), self.settings.checksums
        options = wire.SendOptions(self.settings.chunk_bytes, checksum=checksum)
        for name, tensor in weights.items():
            for frame in wire.tensor_frames(tensor, name, options):
                yield frame  # weights always travel exact

    async def load_optimizer_state(self, request_iterator, context):
        """Optimizer state streamed in by the client, checked in full (or only checked) before it is loaded."""
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        held = owned(self.shard, context, header.deployment_id).weights
        expect = expecting(self.shard, held.expect_optimizer_tensor)
        state = optim.KeyedState.parse(header.layout, await reader.tensors(expect=expect))
        await self.shard.run(held.load_optimizer_state, state, header.check_only)
        return shard_pb2.LoadOptimizerStateResponse()

    async def read_optimizer_state(self, request, context):
        """The stage's optimizer state, or a snapshot's with where and when it was taken, as frames."""
        header = shard_pb2.OptimizerStateHeader(deployment_id=request.deployment_id)
        if request.snapshot:
            snapshot = self._snapshot(context, request.snapshot)
            state, checksum = snapshot.optimizer, checksums.STRONGEST
            header.deployment_id = snapshot.deployment_id
            header.snapshot_optimizer_step = snapshot.optimizer_step
            header.snapshot_layer_indexes.extend(snapshot.layer_indexes)
            header.snapshot_stage = snapshot.stage
        else:
            stage = owned(self.shard, context, request.deployment_id)
            state, checksum = await self.shard.run(stage.weights.optimizer_state), self.settings.checksums
        header.layout = state.layout()
        for frame in wire.framed(shard_pb2.OptimizerStateMessage, header, state.tensors,
                                 wire.SendOptions(self.settings.chunk_bytes, checksum=checksum)):
            yield frame  # exact, as weights

    async def take_snapshot(self, request, context):
        """The stage's weights and optimizer state kept under a name, apart from the deployment."""
        stage = owned(self.shard, context, request.deployment_id)
        name = snapshots.Snapshots.check_name(request.name)
        snapshot = await self.shard.run(snapshots.take, stage, request.deployment_id, self.shard.secret,
                                          request.copy, self.snapshots.held(name))
        self.snapshots.keep(name, snapshot)
        return shard_pb2.SnapshotResponse(optimizer_step=snapshot.optimizer_step, bytes=snapshot.bytes,
                                          stage=snapshot.stage, layer_indexes=snapshot.layer_indexes)

    async def restore_stage(self, request, context):
        """The stage's state replaced by a snapshot's, held here or read from another shard of the deployment."""
        stage = owned(self.shard, context, request.deployment_id)
        if request.source_address in ("", self.shard.address):
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

    async def copy_snapshot(self, request, context):
        """Another shard's snapshot read and kept here under a name, for a later restore."""
        name = snapshots.Snapshots.check_name(request.name)
        if request.source_address in ("", self.shard.address):
            raise InvalidArgument("CopySnapshot copies another shard's snapshot: source_address must name that shard")
        self._may_read_from(context, request.source_address)
        snapshot = await self.peers.read_snapshot(request.source_address, request.snapshot,
                                                  request.source_deployment_secret)
        self.snapshots.keep(name, snapshot)
        return shard_pb2.SnapshotResponse(optimizer_step=snapshot.optimizer_step, bytes=snapshot.bytes,
                                          stage=snapshot.stage, layer_indexes=snapshot.layer_indexes)

    async def drop_snapshot(self, request, context):
        """A snapshot forgotten; only its deployment's client may drop it."""
        if self.snapshots.held(request.name) is None:
            return shard_pb2.DropSnapshotResponse(dropped=False)
        self._snapshot(context, request.name)  # only its deployment's client may drop it
        return shard_pb2.DropSnapshotResponse(dropped=self.snapshots.drop(request.name))

    async def save_checkpoint(self, request, context):
        """The stage's part of a checkpoint written (or discarded), or the checkpoint's description published."""
        stage = owned(self.shard, context, request.deployment_id)
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

    async def load_checkpoint(self, request, context):
        """The stage's weights, and optimizer state if asked, read from a checkpoint (or only checked)."""
        stage = owned(self.shard, context, request.deployment_id)
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

    async def load_weights(self, request, context):
        """The stage's weights read by this shard from storage under its data roots, batch by batch."""
        stage = owned(self.shard, context, request.deployment_id)
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
