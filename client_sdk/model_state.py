"""A deployment's weights and optimizer state: read into and loaded from this process, read by the shards from where
the weights lie, and saved and loaded as checkpoints (by the shards themselves where they can); the handle's methods
for them."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence

import torch

from client_sdk.event_loop import IoLoop
from client_sdk.transport import split_state
from shardtrain import checkpoint, checkpoint_store, optim
from shardtrain.errors import FailedPrecondition, InternalError
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.sdk")


class StateMethods:
    """The handle's state methods (DistributedModel inherits them): state dicts, optimizer state, weights read where
    they lie, and checkpoints, each passed to the handle's ModelState."""

    _io: IoLoop
    _model_state: ModelState

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights, gathered from the shards, in the original model's key order."""
        return self._model_state.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Pushes weights to the shards that own them."""
        self._model_state.load_state_dict(state, strict)

    def optimizer_state_dict(self) -> dict:
        """The shards' optimizer state (Adam's moments, step counts, hyperparameters...) as torch.optim's
        state_dict() of one optimizer over net.parameters() would hold it. Save it with model.state_dict() to
        resume training exactly; it loads into a local optimizer over the same model too."""
        return self._model_state.optimizer_state_dict()

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Replaces the shards' optimizer state with one from optimizer_state_dict() (or from a local optimizer
        of the same class over net.parameters()); a state that does not fit is refused and changes nothing."""
        self._model_state.load_optimizer_state_dict(state)

    def save_checkpoint(self, directory: str | os.PathLike, on_shards: bool | None = None) -> None:
        """Writes the weights and the optimizer state to `directory` as safetensors files and a JSON description,
        no pickle (shardtrain/checkpoint.py); load_checkpoint reads it into any deployment of the same model.

        Where every stage's shard was started with --checkpoint-dir (Cluster.local(checkpoint_dir=...)) and
        `directory` lies under it, each shard writes its own stage, all at once, and nothing passes through this
        process; otherwise the SDK gathers the state and writes one file of each kind here. `on_shards`: True
        insists on the shards (a relative `directory` is then relative to their --checkpoint-dir), False on this
        process.

        A save replaces a checkpoint already in `directory` whole, with one rename, or not at all. One that fails
        (no room is ResourceExhausted, another I/O error Unavailable, a shard that died) removes what it wrote
        but leaves its generation-* directory: loads of `directory` are then refused until a save succeeds, or
        that directory is removed to load the checkpoint it did not replace. The files are this user's alone
        (0600; a shard's --checkpoint-group lets a group read them)."""
        self._model_state.save_checkpoint(directory, on_shards)

    def load_weights(self, source: str | os.PathLike, provided: Sequence[str] = ()) -> dict[str, int]:
        """Has every stage read its own weights from `source`, where they lie: a safetensors file, a directory,
        a Hugging Face sharded checkpoint (model.safetensors.index.json and its files), on a disk the shards see
        or an s3:// URL, under their --data-root; nothing passes through this process. A directory that
        save_checkpoint wrote loads as load_checkpoint(source, optimizer=False) does. Every stage checks every
        tensor (present under its key or a tied weight's, same dtype and shape) before any stage reads one: a
        source that does not fit is refused, naming the tensor, and changes nothing. What state_dict() leaves out
        (non-persistent buffers), and `provided` keys, are not looked for. Returns the bytes each shard read."""
        return self._model_state.load_weights(source, provided)

    def load_checkpoint(self, directory: str | os.PathLike, optimizer: bool = True,
                        on_shards: bool | None = None) -> None:
        """Loads a checkpoint that save_checkpoint wrote, on this split or another, with the optimizer state unless
        `optimizer` is False; a checkpoint that does not fit the model, whose parts are of different saves or
        steps (DataLoss, naming the stage), or whose directory holds a save that did not finish
        (FailedPrecondition) is refused and changes nothing. The shards read their own tensors where they can, as
        save_checkpoint writes them (`on_shards` as there)."""
        self._model_state.load_checkpoint(directory, optimizer, on_shards)

    async def astate_dict(self) -> dict[str, torch.Tensor]:
        """Awaitable state_dict()."""
        return await self._io.wrap(self._model_state.read_state())


class ModelState:
    """The state_dict, optimizer-state and checkpoint methods of the handle `model` (a DistributedModel), with what
    they need to know of the split: which stages own and hold each key, and the orders torch numbers them in."""

    def __init__(self, model, owners: dict[str, list[int]], key_order: Sequence[str], parameter_keys: Sequence[str],
                 holders: dict[str, list[int]] | None):
        self.model = model
        self.owners = owners
        self.holders = holders or dict(owners)  # a tied weight: several stages
        self.key_order = list(key_order)
        self.parameter_keys = [key for key in parameter_keys if key in owners]  # the order torch.optim numbers

    def state_dict(self) -> dict[str, torch.Tensor]:
        """model.state_dict()."""
        self.model._check_open()
        return self.model._io.run(self.read_state())

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool) -> None:
        """model.load_state_dict()."""
        self.model._check_open()
        left_out = set(self.owners) - set(self.key_order)  # by state_dict() too: non-persistent buffers
        per_stage = split_state(state, self.owners, len(self.model.placements), strict, left_out)
        self.model._io.run(self._load_state(per_stage))

    def optimizer_state_dict(self) -> dict:
        """model.optimizer_state_dict()."""
        self.model._check_open()
        return self.model._io.run(self._read_optimizer_state())

    def load_optimizer_state_dict(self, state: dict) -> None:
        """model.load_optimizer_state_dict()."""
        model = self.model
        model._check_open()
        per_stage = optim.split(optim.from_torch(state, self.parameter_keys), self.holders, len(model.placements))
        model._io.run(self._load_optimizer_state(per_stage))
        model._hyperparameters.loaded(state["param_groups"])

    def save_checkpoint(self, directory: str | os.PathLike, on_shards: bool | None) -> None:
        """model.save_checkpoint(): by the shards where they can, else gathered here."""
        self.model._check_open()
        target = self.model._io.run(self._checkpoint_target(directory, on_shards))
        if target is not None:
            self.model._io.run(self._save_on_shards(target))
            return
        state = optim.from_torch(self.optimizer_state_dict(), self.parameter_keys)
        checkpoint.save(directory, self.state_dict(), state, self.parameter_keys)

    def load_checkpoint(self, directory: str | os.PathLike, optimizer: bool, on_shards: bool | None) -> None:
        """model.load_checkpoint(): by the shards where they can, else read here and pushed."""
        self.model._check_open()
        target = self.model._io.run(self._checkpoint_target(directory, on_shards))
        if target is not None and (on_shards or checkpoint.readable_by_shards(directory)):
            self.model._io.run(self._load_on_shards(target, optimizer))
            return
        weights, optimizer_state = checkpoint.load(directory)
        self.load_state_dict(weights, strict=True)
        if optimizer:
            self.load_optimizer_state_dict(optimizer_state)

    def load_weights(self, source: str | os.PathLike, provided: Sequence[str]) -> dict[str, int]:
        """model.load_weights(): every stage reads its own tensors; returns the bytes each shard read."""
        self.model._check_open()
        source = os.fspath(source)
        if "://" not in source:
            source = os.path.abspath(source)
            if os.path.exists(os.path.join(source, checkpoint.DESCRIPTION)):
                self.load_checkpoint(source, optimizer=False, on_shards=None)
                return {}
        provided = sorted({*provided, *(set(self.owners) - set(self.key_order))})
        answers = self.model._io.run(self._load_weights(source, provided))
        read = {stage.address: answer.bytes for stage, answer in answers}
        log.info("the shards read %d bytes of weights from %s: %s", sum(read.values()), source, read)
        return read

    async def read_state(self) -> dict[str, torch.Tensor]:
        """The weights of replica 0's stages, in the model's key order, once everything sent has settled."""
        await self.model._synchronize()
        state = await self.model._clients.read_state()
        return {key: state[key] for key in self.key_order if key in state}

    async def _read_optimizer_state(self) -> dict:
        await self.model._synchronize()
        state = optim.indexed(optim.merged(await self.model._clients.read_optimizer_state()), self.parameter_keys)
        self.model._hyperparameters.overlay(state["param_groups"])
        return state

    async def _load_state(self, per_stage) -> None:
        model = self.model
        await model._synchronize()
        model._planned_steps.forget_snapshots()  # they no longer hold this state: the next train_step takes new ones
        await asyncio.gather(*(clients.load_state(per_stage) for clients in model._trainer.replicas))

    async def _load_optimizer_state(self, per_stage) -> None:
        """Every stage checks its share before any loads it: a state that one stage refuses changes none."""
        model = self.model
        await model._synchronize()
        model._planned_steps.forget_snapshots()
        for check_only in (True, False):
            await asyncio.gather(*(clients.load_optimizer_state(per_stage, check_only)
                                   for clients in model._trainer.replicas))

    async def _load_weights(self, source: str, provided: list[str]) -> list:
        """Every stage of every replica checks its tensors in `source`, then reads them."""
        model = self.model
        await model._synchronize()
        model._planned_steps.forget_snapshots()
        stages = [(clients.deployment_id, stage) for clients in model._trainer.replicas for stage in clients.stages]
        answers = []
        for check_only in (True, False):
            answers = await asyncio.gather(*(stage.call("LoadWeights", shard_pb2.LoadWeightsRequest(
                deployment_id=deployment, source=source, provided=provided, check_only=check_only))
                for deployment, stage in stages))
        return [(stage, answer) for (_, stage), answer in zip(stages, answers)]

    async def _checkpoint_target(self, directory, on_shards: bool | None) -> str | None:
        """The directory to hand the shards, when they write and read the checkpoint themselves; None when this
        process does."""
        if on_shards is False:
            return None
        roots = {answer.address: answer.checkpoint_dir for answer in await self.model._clients.describe()}
        relative = on_shards and not os.path.isabs(directory)  # to each shard's own --checkpoint-dir
        target = os.fspath(directory) if relative else os.path.abspath(directory)
        outside = [address for address, root in roots.items()
                   if not root or not (relative or os.path.commonpath([root, target]) == root)]
        if not outside:
            return target
        if on_shards:
            raise FailedPrecondition(f"checkpoint {target!r}: the shard at {outside[0]} writes and reads checkpoints "
                                     f"only under its --checkpoint-dir "
                                     f"({roots[outside[0]] or 'none: it was started without one'})")
        return None

    async def _save_on_shards(self, directory: str) -> None:
        """Every stage writes its part of a new generation at once (replica 0's: the replicas are equal), then
        stage 0 publishes it with checkpoint.json. When any part fails, the others are discarded and the error
        raised: the directory then refuses loads until a save into it succeeds (checkpoint_store.py)."""
        await self.model._synchronize()
        clients = self.model._clients
        stages = clients.stages
        generation = checkpoint_store.new_generation()

        def request(**fields) -> shard_pb2.SaveCheckpointRequest:
            return shard_pb2.SaveCheckpointRequest(deployment_id=clients.deployment_id, directory=directory,
                                                   generation=generation, parts=len(stages), **fields)
        answers = await asyncio.gather(*(stage.call("SaveCheckpoint", request(part=index))
                                         for index, stage in enumerate(stages)), return_exceptions=True)
        try:
            failed = [answer for answer in answers if isinstance(answer, BaseException)]
            if failed:
                raise failed[0]
            await stages[0].call("SaveCheckpoint", request(description=self._description(generation, answers)))
        except BaseException:
            await asyncio.gather(*(stage.call("SaveCheckpoint", request(part=index, discard=True))
                                   for index, stage in enumerate(stages)), return_exceptions=True)
            raise

    def _description(self, generation: str, answers: list[shard_pb2.SaveCheckpointResponse]) -> str:
        """checkpoint.json of save `generation`, whose parts the stages wrote (`answers`) at one optimizer step."""
        steps = [answer.optimizer_step for answer in answers]
        if len(set(steps)) != 1:
            raise InternalError(f"the stages saved at different optimizer steps {steps}, though every step had "
                                "settled")
        return checkpoint.description(len(steps), self.key_order, self.parameter_keys,
                                      self.model._hyperparameters.all(), generation, steps[0])

    async def _load_on_shards(self, directory: str, optimizer: bool) -> None:
        """Every stage of every replica checks its share, then loads it (a checkpoint one stage refuses changes
        none)."""
        model = self.model
        await model._synchronize()
        model._planned_steps.forget_snapshots()
        answers = []
        for check_only in (True, False):
            calls = [stage.call("LoadCheckpoint", shard_pb2.LoadCheckpointRequest(
                deployment_id=clients.deployment_id, directory=directory, optimizer=optimizer, check_only=check_only))
                for clients in model._trainer.replicas for stage in clients.stages]
            answers = await asyncio.gather(*calls)
        if optimizer:
            states = [optim.KeyedState.parse(answer.layout, {}) for answer in answers[:len(model._clients.stages)]]
            model._hyperparameters.loaded(optim.indexed(optim.merged(states), self.parameter_keys)["param_groups"])
