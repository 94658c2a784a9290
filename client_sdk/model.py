"""A deployed model that looks like a local one: call it, backpropagate into it, step it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from client_sdk.autograd import RemoteStages
from client_sdk.io_loop import IoLoop
from client_sdk.transport import StageClients, split_state
from shardtrain.errors import FailedPrecondition


@dataclass(frozen=True)
class Placement:
    """Where one stage runs and which layers it holds."""

    stage: int
    shard_address: str
    first_layer: int
    end_layer: int
    layers: tuple[str, ...]


class DistributedModel:
    """Handle to a deployed model. Synchronous methods block; `a`-prefixed ones are awaitable.

    Training loop, as in PyTorch:  pred = model(x); loss.backward(); model.step(); model.zero_grad()
    Explicit async loop:  pred = await model.aforward(x); loss.backward(); await model.abackward(pred.grad);
                          await model.astep()
    """

    def __init__(self, io: IoLoop, clients: StageClients, placements: Sequence[Placement],
                 owners: dict[str, int], key_order: Sequence[str]):
        self._io = io
        self._clients = clients
        self.placements = list(placements)
        self._owners = owners
        self._key_order = list(key_order)
        self._anchor = torch.zeros((), requires_grad=True)
        self._steps = itertools.count()
        self._last_step = -1
        self._zero_grad_pending = False
        self._async_steps: list[int] = []

    @property
    def deployment_id(self) -> str:
        """The coordinator's id for this deployment."""
        return self._clients.deployment_id

    # -- the PyTorch-shaped synchronous API ---------------------------------------------------
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the model; under autograd the result backpropagates into the shards."""
        if torch.is_grad_enabled():
            return RemoteStages.apply(self, self._anchor, x)
        return self._remote_forward(self._begin_step(), x, requires_grad=False)

    def step(self) -> None:
        """Every shard applies its optimizer to the gradients accumulated so far."""
        self._io.run(self._step())

    def zero_grad(self) -> None:
        """Clears gradients on every shard; sent with the next forward or step rather than on its own."""
        self._zero_grad_pending = True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights, gathered from the shards, in the original model's key order."""
        state = self._io.run(self._clients.read_state())
        return {key: state[key] for key in self._key_order if key in state}

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Pushes weights to the shards that own them."""
        per_stage = split_state(state, self._owners, len(self.placements), strict)
        self._io.run(self._clients.load_state(per_stage))

    def describe(self) -> list:
        """Each shard's own report: address, device, stage, layers, steps in flight."""
        return self._io.run(self._clients.describe())

    # -- the explicit asynchronous API ---------------------------------------------------------
    async def aforward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the model; returns a leaf tensor that requires grad. Pass its .grad to abackward."""
        step = self._begin_step()
        output = await self._io.wrap(self._forward(step, x, requires_grad=True))
        self._async_steps.append(step)
        return output.requires_grad_(True)

    async def abackward(self, grad_output: torch.Tensor, step: int | None = None) -> None:
        """Backpropagates the gradient of an aforward output (the oldest one not yet backpropagated)."""
        if step is None:
            if not self._async_steps:
                raise FailedPrecondition("abackward without a pending aforward")
            step = self._async_steps.pop(0)
        await self._io.wrap(self._clients.backward(step, grad_output))

    async def astep(self) -> None:
        """Awaitable step()."""
        await self._io.wrap(self._step())

    async def azero_grad(self) -> None:
        """Awaitable zero_grad() (it sends nothing by itself either)."""
        self.zero_grad()

    async def astate_dict(self) -> dict[str, torch.Tensor]:
        """Awaitable state_dict()."""
        state = await self._io.wrap(self._clients.read_state())
        return {key: state[key] for key in self._key_order if key in state}

    # -- plumbing used by RemoteStages ---------------------------------------------------------
    def _begin_step(self) -> int:
        self._last_step = next(self._steps)
        return self._last_step

    def _remote_forward(self, step: int, x: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        return self._io.run(self._forward(step, x, requires_grad))

    def _remote_backward(self, step: int, grad_output: torch.Tensor) -> None:
        self._io.run(self._clients.backward(step, grad_output))

    async def _forward(self, step: int, x: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        zero_grad, self._zero_grad_pending = self._zero_grad_pending, False
        return await self._clients.forward(step, x.detach(), requires_grad, zero_grad)

    async def _step(self) -> None:
        zero_grad, self._zero_grad_pending = self._zero_grad_pending, False
        await self._clients.step(self._last_step, zero_grad)

    def close(self) -> None:
        """Closes the channels to the shards (the shards keep the model)."""
        self._io.run(self._clients.close())

    def __repr__(self) -> str:
        stages = ", ".join(f"stage {p.stage}@{p.shard_address}: layers {p.first_layer}-{p.end_layer - 1}"
                           for p in self.placements)
        return f"DistributedModel({self.deployment_id}; {stages})"
