"""The PyTorch-shaped loop a script writes (pred = model(x); loss.backward(); model.step(); model.zero_grad()), and
its async twins: the handle's methods for them, and each call sent as an item on the deployment's Links, in the call
orders one process allows."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from client_sdk.autograd import RemoteStages
from client_sdk.event_loop import IoLoop
from client_sdk.optimizer import clip_coefficient
from shardtrain.errors import FailedPrecondition, InternalError


class LoopMethods:
    """The handle's loop methods (DistributedModel inherits them): model(x), step, zero_grad, clip_grad_norm_ and
    synchronize, and their awaitable twins, each passed to the handle's ScriptLoop."""

    _io: IoLoop
    _script_loop: ScriptLoop
    _synchronize: Callable[[], Coroutine[Any, Any, None]]  # the handle's: waits for everything sent so far

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Runs the model on its arguments, as the local model takes them (the tensors the example had); returns
        what it returns (a tensor, or a tuple or dict of them). Under autograd the result backpropagates into the
        shards: into the first input too when it requires grad; the other inputs take no gradient."""
        return self._script_loop.forward(args, kwargs)

    def step(self) -> None:
        """Every shard applies its optimizer to the gradients accumulated so far (nothing, as in PyTorch, when no
        backward ran since the last zero_grad). Outputs not yet backpropagated can no longer be: their graphs hold
        weights the step changed, and their backward raises FailedPrecondition at once, as PyTorch raises."""
        self._script_loop.step()

    def zero_grad(self) -> None:
        """Clears gradients on every shard (to None, as torch does); sent with the next forward, backward or step
        rather than on its own, so it takes effect before any backward called after it."""
        self._script_loop.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every stage's gradients: returns their total norm, and the next step()
        scales every gradient by max_norm / (total + 1e-6) when that is under 1. Waits for the backwards sent."""
        return self._script_loop.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def synchronize(self) -> None:
        """Waits until every shard has finished everything sent so far; raises the first error."""
        self._io.run(self._synchronize())

    # -- the explicit asynchronous API ---------------------------------------------------------
    async def aforward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the model; returns a leaf tensor that requires grad. Pass its .grad to abackward."""
        return await self._script_loop.aforward(x)

    async def abackward(self, grad_output: torch.Tensor, step: int | None = None) -> None:
        """Backpropagates the gradient of an aforward output (the oldest one not yet backpropagated)."""
        await self._script_loop.abackward(grad_output, step)

    async def astep(self) -> None:
        """Applies every shard's optimizer and waits until all have."""
        await self._script_loop.astep()

    async def azero_grad(self) -> None:
        """Awaitable zero_grad() (it sends nothing by itself either)."""
        self.zero_grad()


class ScriptLoop:
    """Sends the forwards, backwards, optimizer steps and gradient clipping of a script's loop for the handle
    `model` (a DistributedModel), whose call-order state (model._call_order) says what each call may do."""

    def __init__(self, model) -> None:
        self.model = model
        self.gradient_scale = 0.0  # set by clip_grad_norm_ for the next step
        self._anchor = torch.zeros((), requires_grad=True)

    def forward(self, args: tuple, kwargs: dict):
        """model(*args, **kwargs): under autograd joined to the caller's graph, else run at once."""
        model = self.model
        x, inputs = model._interface.bind(args, kwargs)
        if torch.is_grad_enabled():
            self._check_single_replica()
            result = RemoteStages.apply(self, self._anchor, x, inputs)
            main, extras = (result[0], result[1:]) if model._interface.outputs else (result, ())
        else:
            main, extras = model._io.run(self.send_forward(self.begin_step(), x, requires_grad=False, inputs=inputs))
        return model._interface.build(main, extras)

    def begin_step(self) -> int:
        """Numbers a new step, once the handle is known to be open."""
        self.model._check_open()
        return self.model._call_order.next_step()

    def remote_forward(self, step: int, x: torch.Tensor, inputs: dict[str, torch.Tensor], requires_grad: bool,
                       input_requires_grad: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The forward of RemoteStages (client_sdk/autograd.py)."""
        return self.model._io.run(self.send_forward(step, x, requires_grad, input_requires_grad, inputs=inputs))

    def remote_backward(self, step: int, grad_output: torch.Tensor, input_requires_grad: bool = False,
                        output_grads: dict[str, torch.Tensor | None] | None = None) -> torch.Tensor | None:
        """The backward of RemoteStages: waits only when the input's gradient is wanted."""
        return self.model._io.run(self.send_backward(step, grad_output, wait=input_requires_grad,
                                                     output_grads=output_grads))

    def step(self) -> None:
        """model.step()."""
        self.model._check_open()
        self.model._io.run(self.send_step())

    def zero_grad(self) -> None:
        """model.zero_grad(): a flag the next forward, backward or step carries."""
        calls = self.model._call_order
        calls.zero_grad_pending = True
        calls.has_gradients = False
        self.gradient_scale = 0.0
        self.model._gradients.cleared()

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """model.clip_grad_norm_(): the total norm now, the scale with the next step."""
        self.model._check_open()
        return self.model._io.run(self._clip_grad_norm(float(max_norm), float(norm_type), error_if_nonfinite))

    async def aforward(self, x: torch.Tensor) -> torch.Tensor:
        """model.aforward(x): a leaf output whose .grad abackward takes."""
        self._check_plain("aforward")
        step = self.begin_step()
        output, _ = await self.model._io.wrap(self.send_forward(step, x, requires_grad=True))
        self.model._call_order.async_steps.append(step)
        return output.requires_grad_(True)

    async def abackward(self, grad_output: torch.Tensor, step: int | None = None) -> None:
        """model.abackward(): the oldest aforward's unless `step` is given."""
        if step is None:
            if not self.model._call_order.async_steps:
                raise FailedPrecondition("abackward without a pending aforward")
            step = self.model._call_order.async_steps.pop(0)
        await self.model._io.wrap(self.send_backward(step, grad_output, wait=True))

    async def astep(self) -> None:
        """model.astep(): the step, waited for."""
        await self.model._io.wrap(self.send_step(wait=True))

    async def predict(self, x: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's (first) output for its inputs, without autograd (an example for capturing a loss), in eval
        mode: it must not move a BatchNorm's running statistics."""
        return (await self.send_forward(self.begin_step(), x, requires_grad=False, training=False, inputs=inputs))[0]

    async def send_forward(self, step: int, x: torch.Tensor, requires_grad: bool, input_requires_grad: bool = False,
                           training: bool | None = None,
                           inputs: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the main output, the model's other outputs in the interface's order)."""
        model, calls = self.model, self.model._call_order
        calls.inflight.raise_failures()
        zero_grad = calls.take_zero_grad()
        training = model.training if training is None else training
        if requires_grad:
            calls.await_backward(step)
        output, extras = await model._clients.forward(step, x.detach(), requires_grad, zero_grad,
                                                      calls.settle_before_forward, input_requires_grad,
                                                      eval_mode=not training, inputs=inputs)
        missing = [name for name in model._interface.outputs if name not in extras]
        if missing:
            raise InternalError(f"step {step}: the last stage sent no output {missing}")
        return output, [extras[name] for name in model._interface.outputs]

    async def send_backward(self, step: int, grad_output: torch.Tensor | None, wait: bool,
                            output_grads: dict[str, torch.Tensor | None] | None = None) -> torch.Tensor | None:
        """Sends a backward; with `wait`, waits for it and returns the input's gradient (if the forward asked)."""
        model, calls = self.model, self.model._call_order
        calls.inflight.raise_failures()
        calls.check_backward(step)
        zero_grad = calls.take_zero_grad()
        calls.has_gradients = True
        model._gradients.changed()
        scaler = model._trainer.scaler
        if scaler is not None:  # fp16: the shards' backward runs on the loss scaled up (loss_scaling.py)
            grad_output = grad_output * scaler.scale if grad_output is not None else None
            if output_grads:
                output_grads = {name: grad * scaler.scale if grad is not None else None
                                for name, grad in output_grads.items()}
        call = asyncio.ensure_future(model._clients.backward(step, grad_output, zero_grad, output_grads))
        calls.backward_steps.append(step)
        calls.inflight.add(call)
        if not wait:
            return None
        grad_input = await call
        return grad_input / scaler.scale if scaler is not None and grad_input is not None else grad_input

    async def send_step(self, wait: bool = False) -> None:
        """Sends the optimizer step down the stages at once; each applies it after its own backwards."""
        model, calls = self.model, self.model._call_order
        if not calls.has_gradients:  # torch.optim skips parameters without gradients: this step changes nothing
            model._gradients.take_edits()
            if wait:
                await model._synchronize()
            return
        calls.outdate_awaiting_backward()
        await model._clients.flush()  # the previous step is confirmed by now, unless no forward came between
        await calls.inflight.drain_previous()
        zero_grad = calls.take_zero_grad()
        unscale, skip = await self._loss_scaling()
        calls.optimizer_steps += 1
        backward_steps, calls.backward_steps = calls.backward_steps, []
        request = model._clients.step_request(calls.last_step, zero_grad, calls.optimizer_steps, backward_steps)
        request.hyperparameters_json = model._hyperparameters.changes()
        request.gradient_scale, self.gradient_scale = (self.gradient_scale or 1.0) * unscale if unscale else \
            self.gradient_scale, 0.0
        request.skip = skip
        request.gradient_edits.extend(model._gradients.take_edits())
        model._gradients.changed()
        calls.settle_before_forward = request.optimizer_step
        calls.inflight.add(model._clients.step(request))
        calls.inflight.next_iteration()
        if wait:
            await model._synchronize()

    async def _loss_scaling(self) -> tuple[float, bool]:
        """Under fp16's loss scaling: (the factor that unscales the gradients, whether a gradient overflowed and
        the step is skipped), from the stages' gradient norms; (0, False) without it."""
        model, calls = self.model, self.model._call_order
        scaler = model._trainer.scaler
        if scaler is None:
            return 0.0, False
        norms = await model._clients.gradient_norms(calls.backward_steps, 2.0, calls.optimizer_steps + 1,
                                                    model._gradients.take_edits_by_stage())
        unscale, skip, _ = scaler.verdict(norms)
        return unscale, skip

    async def _clip_grad_norm(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        model, calls = self.model, self.model._call_order
        calls.inflight.raise_failures()
        if not calls.has_gradients:
            return torch.tensor(0.0)
        norms = await model._clients.gradient_norms(calls.backward_steps, norm_type, calls.optimizer_steps + 1,
                                                    model._gradients.take_edits_by_stage())
        if model._trainer.scaler is not None:  # the gradients are the scaled loss's
            norms = [norm / model._trainer.scaler.scale for norm in norms]
        total, self.gradient_scale = clip_coefficient(norms, max_norm, norm_type, error_if_nonfinite)
        return total

    def parameter_norms(self, norm_type: float, edits: dict[int, list], names: dict[int, list[str]]
                        ) -> dict[str, float]:
        """The gradient norm of each named parameter (per stage), once the backwards sent are over, after `edits`."""
        model = self.model

        async def fetch() -> dict[str, float]:
            model._call_order.inflight.raise_failures()
            answers = await model._clients.gradient_norm_answers(model._call_order.backward_steps, norm_type,
                                                                 model._call_order.optimizer_steps + 1, edits, names)
            return {name: norm for stage, answer in enumerate(answers)
                    for name, norm in zip(names.get(stage, []), answer.parameter_norms)}
        model._check_open()
        return model._io.run(fetch())

    def _check_plain(self, what: str) -> None:
        interface = self.model._interface
        if not interface.is_plain:
            raise FailedPrecondition(f"{what} takes models of one tensor in and one out; this one takes "
                                     f"{list(interface.inputs)} and returns {1 + len(interface.outputs)} "
                                     "tensors: train it with the loop (outputs = model(...); loss.backward(); "
                                     "model.step()) or with model.train_step")

    def _check_single_replica(self) -> None:
        replicas = self.model.replicas
        if replicas > 1:
            raise FailedPrecondition(f"this deployment has {replicas} replicas: train it with "
                                     "model.train_step(x, y, loss_fn, ...), which keeps them in step; "
                                     "model(x) under torch.no_grad() still runs inference on replica 0")
