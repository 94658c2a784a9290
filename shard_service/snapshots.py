"""Snapshots of a stage's weights and optimizer state, held by name apart from the deployment.

A snapshot outlives the LoadStage that replaces its stage (a shard keeps those of its current deployment and of
the one before): when a shard dies, the redeployed stages restore from the snapshots their survivors took, on the
same shard or on another one (a replacement shard reads a live replica's through ReadState and
ReadOptimizerState). A snapshot taken without `copy` keeps the stage's own tensors; one with `copy` copies them
into host memory, so the stage can train on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from shard_service.stage import Stage
from shardtrain import optim
from shardtrain.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted

MAX_SNAPSHOTS = 8  # held at once by one shard: each may be a whole stage's weights and optimizer state
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class Snapshot:
    """A stage's state at one optimizer step, and what it belongs to."""

    deployment_id: str
    secret: str               # the deployment's: what a peer reading the snapshot must present
    stage: int
    layer_indexes: tuple[int, ...]
    optimizer_step: int       # the last optimizer step the stage applied when the snapshot was taken
    weights: dict[str, torch.Tensor]
    optimizer: optim.KeyedState
    owned: bool = True        # its tensors are its own (copied or received), not the stage's

    @property
    def bytes(self) -> int:
        tensors = [*self.weights.values(), *self.optimizer.tensors.values()]
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def take(stage: Stage, deployment_id: str, secret: str, copy: bool, reuse: Snapshot | None = None) -> Snapshot:
    """The stage's state now, and the last optimizer step in it (run under the device's lock, so that no step is
    half applied). A copy goes into the tensors of `reuse` (the snapshot it replaces) where they fit: no fresh
    memory for a snapshot taken every few steps."""
    weights = stage.weights.state()
    keyed = stage.weights.optimizer_state()
    if copy:
        old = reuse if reuse is not None and reuse.owned else None
        weights = _copied(weights, old.weights if old else {})
        keyed = optim.KeyedState([dict(group) for group in keyed.groups],
                                 _copied(keyed.tensors, old.optimizer.tensors if old else {}), dict(keyed.values))
    return Snapshot(deployment_id, secret, stage.index, tuple(stage.layer_indexes), stage.weights.applied_step,
                    weights, keyed, owned=copy)


def _copied(tensors: dict[str, torch.Tensor], into: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of `tensors` in host memory (pinned for a GPU's, to copy back at full speed), written into the
    same-named tensor of `into` where shape and dtype match: device memory is the stage's to train with."""
    copies = {}
    for key, tensor in tensors.items():
        target = into.get(key)
        if target is None or (target.shape, target.dtype) != (tensor.shape, tensor.dtype):
            target = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        copies[key] = target.copy_(tensor)
    return copies


class Snapshots:
    """The snapshots one shard holds, by name."""

    def __init__(self) -> None:
        self._held: dict[str, Snapshot] = {}

    @staticmethod
    def check_name(name: str) -> str:
        if not _NAME.fullmatch(name):
            raise InvalidArgument(f"snapshot name {name[:80]!r} must be 1 to 64 of A-Z a-z 0-9 _ . -")
        return name

    def keep(self, name: str, snapshot: Snapshot) -> None:
        """Holds `snapshot` as `name`, replacing one of that name taken by the same deployment; PermissionDenied
        for another deployment's, ResourceExhausted beyond MAX_SNAPSHOTS."""
        self.check_name(name)
        held = self._held.get(name)
        if held is not None and held.secret != snapshot.secret:
            raise PermissionDenied(f"snapshot {name!r} belongs to deployment {held.deployment_id}; choose another "
                                   "name (the SDK names its snapshots after the deployment)")
        if held is None and len(self._held) >= MAX_SNAPSHOTS:
            raise ResourceExhausted(f"this shard holds {MAX_SNAPSHOTS} snapshots, the most it keeps; drop one "
                                    f"first (held: {sorted(self._held)})")
        self._held[name] = snapshot

    def held(self, name: str) -> Snapshot | None:
        """The snapshot called `name`, if one is held."""
        return self._held.get(self.check_name(name))

    def get(self, name: str) -> Snapshot:
        """The snapshot called `name`; NotFound naming those held."""
        snapshot = self._held.get(self.check_name(name))
        if snapshot is None:
            raise NotFound(f"no snapshot {name!r} is held here; held: {sorted(self._held)}")
        return snapshot

    def drop(self, name: str) -> bool:
        return self._held.pop(self.check_name(name), None) is not None

    def retain(self, deployments: set[str]) -> None:
        """Drops the snapshots of every deployment but `deployments`."""
        self._held = {name: held for name, held in self._held.items() if held.deployment_id in deployments}
