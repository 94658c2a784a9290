"""client_sdk.model: the handle, built on fakes. What a redeploy after a dead shard swaps is all the handle holds of
its deployment, so its loop, planned steps and state follow the new one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from client_sdk.model import DistributedModel
from client_sdk.pipeline import PipelineTrainer
from client_sdk.planned_steps import DEPLOYMENT_ATTRIBUTES


class FakeClients(SimpleNamespace):
    """A replica's StageClients as far as the handle's constructor and a take-over use them."""

    closed = False

    async def close(self) -> None:
        self.closed = True


def handle(deployment_id: str) -> DistributedModel:
    return DistributedModel(None, PipelineTrainer([FakeClients(deployment_id=deployment_id)]), [], {}, [])


def test_the_handle_s_parts_hold_nothing_of_the_deployment_themselves():
    model = handle("d-1")
    held = [getattr(model, name) for name in DEPLOYMENT_ATTRIBUTES]
    for part in (model._script_loop, model._planned_steps, model._model_state):
        assert not [name for name, value in vars(part).items() if any(value is item for item in held)], part


def test_a_take_over_swaps_the_deployment_and_keeps_the_user_s_optimizer():
    model, other = handle("d-1"), handle("d-2")
    old, optimizer = model._clients, model.optimizer
    asyncio.run(model._planned_steps._adopt(other))
    assert all(getattr(model, name) is getattr(other, name) for name in DEPLOYMENT_ATTRIBUTES)
    assert (model.deployment_id, model.optimizer, other._closed, old.closed) == ("d-2", optimizer, True, True)
    assert model._script_loop.model is model and model._planned_steps.model is model
