"""What model.train_step ships as its loss: an allowed torch.nn loss by name, or the user's own module, captured."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from client_sdk.batch import Batch
from shardtrain import allowed_losses
from shardtrain.capture import CAPTURING, LayerAdapter, capture_layer
from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2

EXAMPLE_ROWS = 2
FUNCTIONS_KEPT = 16  # loss functions whose capture is kept for the next step


class FunctionLoss(torch.nn.Module):
    """A loss function (F.cross_entropy, a lambda, a functools.partial) as a module, to be captured like one."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.function(prediction, target)

    def __repr__(self) -> str:
        return getattr(self.function, "__name__", repr(self.function))[:120]


class LossSpecs:
    """Turns the loss argument of train_step into a LossSpec; a custom module is captured once.

    Capturing needs an example prediction: `predict` runs the deployed model (no grad) on a few rows of its inputs.
    """

    def __init__(self, predict: Callable[[torch.Tensor, dict[str, torch.Tensor]], Awaitable[torch.Tensor]]):
        self._predict = predict
        self._captured: dict[int, tuple[torch.nn.Module, shard_pb2.LossSpec]] = {}
        self._functions: dict[int, FunctionLoss] = {}  # a function's module, kept so its capture is reused

    async def __call__(self, loss, batch: Batch) -> shard_pb2.LossSpec:
        """The LossSpec of `loss`: a name, a torch.nn loss class or instance, a module of your own, or any function
        of (prediction, target) such as F.mse_loss or a lambda (captured like a module)."""
        if callable(loss) and not isinstance(loss, (str, type, torch.nn.Module)):
            loss = self._module_of(loss)
        if isinstance(loss, torch.nn.Module) and type(loss).__name__ not in allowed_losses.ALLOWED:
            return await self._custom(loss, batch)
        name, kwargs_json = allowed_losses.encode(loss)
        allowed_losses.build(name, kwargs_json)  # refuse bad kwargs here, before any shard sees them
        return shard_pb2.LossSpec(name=name, kwargs_json=kwargs_json)

    def _module_of(self, function) -> FunctionLoss:
        """The function's module, the same each call with the same function (the last few kept: a fresh lambda per
        step is captured again)."""
        module = self._functions.get(id(function))
        if module is None or module.function is not function:
            module = self._functions[id(function)] = FunctionLoss(function)
            while len(self._functions) > FUNCTIONS_KEPT:
                self._captured.pop(id(self._functions.pop(next(iter(self._functions)))), None)
        return module

    async def _custom(self, loss: torch.nn.Module, batch: Batch) -> shard_pb2.LossSpec:
        if id(loss) in self._captured and self._captured[id(loss)][0] is loss:
            return self._captured[id(loss)][1]
        if any(True for _ in loss.parameters()) or any(True for _ in loss.buffers()):
            raise InvalidArgument(f"loss {type(loss).__name__} holds tensors; a shipped loss must be a pure "
                                  "function of (prediction, target)")
        example = batch.example(EXAMPLE_ROWS)
        prediction = await self._predict(example.x, example.inputs)
        try:
            with CAPTURING:
                program = capture_layer(LayerAdapter(loss), (prediction, example.y))
        except Exception as error:  # export reports unsupported code in many exception types
            raise InvalidArgument(f"loss {type(loss).__name__} cannot be captured with torch.export: "
                                  f"{type(error).__name__}: {str(error)[:500]}") from None
        spec = shard_pb2.LossSpec(program=shard_pb2.CapturedLayer(description=repr(loss), program=program),
                                  sums=getattr(loss, "reduction", "mean") == "sum")
        self._captured[id(loss)] = (loss, spec)
        return spec
