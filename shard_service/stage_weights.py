"""A stage's weights and their optimizer: loading and reading them, their gradients between backward and the
optimizer step (tied weights' sums, norms, the client's edits) and the step itself. The stage (stage.py) runs its
layers on these tensors in forward and backward; everything else done to them is here, so that each side reads on
its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardtrain import optim, wire
from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2


class StageWeights:
    """One stage's weights, each tensor once however many keys name it, and the optimizer that steps them."""

    def __init__(self, index: int, tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                 optimizer: tuple, device: torch.device):
        """`tensors`: each weight once, by its key (a tied one by its first key); `state`: the same tensors by
        every state-dict key of the stage's layers; `optimizer`: (name, defaults as JSON[, param groups]), as
        optim.build takes them."""
        self.index = index  # the stage's, for errors
        self.device = device
        self.applied_step = 0  # the last optimizer step applied (StepRequest numbering); 0: none
        self.unloaded = set(state)  # state-dict keys no load has filled yet: the stage runs nothing until it is empty
        self._tensors, self._state = tensors, state
        named = {key: tensors[key] for key in self._parameter_keys()}
        self._optimizer = optim.build(optimizer[0], optimizer[1], named, *optimizer[2:]) if named else None
        key_of = {id(tensor): key for key, tensor in named.items()}
        self._optimizer_keys = [key_of[id(p)] for group in self._optimizer.param_groups for p in group["params"]] \
            if self._optimizer is not None else []  # torch numbers its state by these positions

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        """The stage's trainable tensors, in layer order."""
        return [self._tensors[key] for key in self._parameter_keys()]

    @property
    def parameter_count(self) -> int:
        """Number of trainable scalars in the stage."""
        return sum(t.numel() for t in self.parameters)

    def state(self) -> dict[str, torch.Tensor]:
        """The stage's weights under the user's state-dict keys."""
        return {key: tensor.detach() for key, tensor in self._state.items()}

    def tensor_names(self) -> dict[str, tuple[str, ...]]:
        """Each tensor of the stage once, under its first key here: every name it has, this stage's keys first,
        then a tied weight's first key (where a checkpoint that stores a tied tensor once keeps it)."""
        homes = {id(tensor): home for home, tensor in self._tensors.items()}
        names: dict[int, list[str]] = {}
        for key, tensor in self._state.items():
            names.setdefault(id(tensor), []).append(key)
        return {keys[0]: tuple(dict.fromkeys([*keys, homes.get(identity, keys[0])]))
                for identity, keys in names.items()}

    def memory(self) -> tuple[int, int, int]:
        """(weight bytes, gradient bytes, optimizer state bytes) the stage holds now."""
        weights = sum(t.nbytes for t in self._tensors.values())
        gradients = sum(t.grad.nbytes for t in self._tensors.values() if t.grad is not None)
        state = self._optimizer.state.values() if self._optimizer is not None else ()
        optimizer = sum(v.nbytes for entry in state for v in entry.values() if isinstance(v, torch.Tensor))
        return weights, gradients, optimizer

    def load_state(self, tensors: dict[str, torch.Tensor], check_only: bool = False) -> list[str]:
        """Copies weights in place (the optimizer keeps pointing at them); InvalidArgument on unknown keys or shapes.
        With `check_only`, only checks."""
        for key, value in tensors.items():
            self._check_weight(key, value)
        if check_only:
            return sorted(tensors)
        with torch.no_grad():
            for key, value in tensors.items():
                self._state[key].copy_(value)
        self.unloaded -= set(tensors)
        return sorted(tensors)

    def expect_weight(self, header) -> None:
        """InvalidArgument unless a tensor of this header loads into one of the stage's weights (before any of
        it is stored)."""
        self._check_weight(header.name, wire.meta(header))

    def _check_weight(self, key: str, value: torch.Tensor) -> None:
        """InvalidArgument unless `value` (a meta tensor for a header) fits the stage's weight `key`."""
        if key not in self._state:
            raise InvalidArgument(f"stage {self.index} has no weight {key[:200]!r}; it holds "
                                  f"{sorted(self._state)[:20]}")
        check_like(value, self._state[key], f"weight {key!r}")

    def zero_grad(self) -> None:
        """Clears parameter gradients (set to None, as torch does by default)."""
        for tensor in self._state.values():
            tensor.grad = None

    def tied_gradient(self, key: str) -> torch.Tensor | None:
        """This stage's gradient of tied weight `key` (its first key), before the other stages' are added."""
        return self._tensors[key].grad

    def set_tied_gradient(self, key: str, grad: torch.Tensor | None) -> None:
        """Replaces the gradient of tied weight `key` with the sum over every stage holding it."""
        self._tensors[key].grad = grad.to(self.device) if grad is not None else None

    def gradient_norm(self, norm_type: float, leave_out: Sequence[str] = ()) -> float:
        """The p-norm of every gradient the stage holds, taken as one vector (as clip_grad_norm_ takes them), but
        for the weights named in `leave_out` (tied weights another stage counts)."""
        norms = [torch.linalg.vector_norm(self._tensors[key].grad.detach(), norm_type)
                 for key in self._parameter_keys() if key not in leave_out and self._tensors[key].grad is not None]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type).item() if norms else 0.0

    def parameter_norms(self, norm_type: float, keys: Sequence[str]) -> list[float]:
        """Each named parameter's own gradient p-norm (0 for one without a gradient), as torch computes it for
        clip_grad_norm_ over a RemoteParameter list; InvalidArgument for a name the stage does not hold."""
        norms = []
        for key in keys:
            grad = self._gradient_holder(key).grad
            norms.append(0.0 if grad is None else torch.linalg.vector_norm(grad.detach(), norm_type).item())
        return norms

    def edit_gradients(self, edits: Sequence[shard_pb2.GradientEdit]) -> None:
        """Applies in-place changes the client's code made to named gradients (clip_grad_value_, a scale), in
        order, after checking all of them: a gradient that is None stays None, as torch's edits skip it."""
        changes = []
        for edit in edits:
            kind = edit.WhichOneof("edit")
            if kind is None:
                raise InvalidArgument(f"gradient edit of {edit.parameter!r} names no change; expected scale or clamp")
            changes.append((self._gradient_holder(edit.parameter), kind, edit))
        with torch.no_grad():
            for parameter, kind, edit in changes:
                if parameter.grad is None:
                    continue
                if kind == "scale":
                    parameter.grad.mul_(edit.scale)
                else:
                    parameter.grad.clamp_(min=edit.clamp.low, max=edit.clamp.high)

    def _gradient_holder(self, key: str) -> torch.nn.Parameter:
        tensor = self._tensors.get(key)
        if not isinstance(tensor, torch.nn.Parameter):
            raise InvalidArgument(f"stage {self.index} holds no parameter {key!r}; its parameters are "
                                  f"{self._parameter_keys()[:8]}{' ...' if len(self._parameter_keys()) > 8 else ''}")
        return tensor

    def set_hyperparameters(self, hyperparameters_json: str) -> None:
        """Sets the hyperparameters (lr, betas, ...) of each param group, as a client's schedule left them: JSON,
        one object per group."""
        if self._optimizer is not None:
            optim.set_hyperparameters(self._optimizer, hyperparameters_json)

    def step(self, gradient_scale: float = 0.0, number: int = 0, skip: bool = False,
             edits: Sequence[shard_pb2.GradientEdit] = ()) -> None:
        """Applies the optimizer to the accumulated gradients, first changed by the client's `edits` and scaled by
        `gradient_scale` when it is above 0 (global norm clipping, loss scaling), as optimizer step `number`
        (applied_step says which was the last); with `skip` (a gradient was not finite under loss scaling) it
        counts the step and changes nothing."""
        self.edit_gradients([edit for edit in edits if isinstance(self._tensors.get(edit.parameter),
                                                                  torch.nn.Parameter)])  # those it holds
        if self._optimizer is not None and not skip:
            if gradient_scale > 0:
                for parameter in self.parameters:
                    if parameter.grad is not None:
                        parameter.grad.mul_(gradient_scale)
            self._optimizer.step()
        self.applied_step = number

    @property
    def optimizer_keys(self) -> list[str]:
        """The keys of the parameters the stage's optimizer steps, in its order."""
        return list(self._optimizer_keys) if self._optimizer is not None else []

    def optimizer_state(self) -> optim.KeyedState:
        """The optimizer's state and hyperparameters, keyed by the parameters' state-dict keys."""
        if self._optimizer is None:
            return optim.KeyedState([], {}, {})
        return optim.keyed(self._optimizer.state_dict(), self._optimizer_keys)

    def load_optimizer_state(self, state: optim.KeyedState, check_only: bool = False) -> None:
        """Replaces the optimizer's state and hyperparameters (with `check_only`, only checks that it could);
        InvalidArgument, with the state left as it was, unless `state` names exactly this stage's parameters
        and holds what this optimizer keeps."""
        if self._optimizer is None:
            if state.groups or state.tensors or state.values:
                raise InvalidArgument(f"stage {self.index} has no parameters, so no optimizer state to load")
            return
        keys = self._optimizer_keys
        loaded = optim.indexed(state, keys)
        optim.check_state(self._optimizer, loaded, keys)
        if check_only:
            return
        try:
            self._optimizer.load_state_dict(loaded)
        except (ValueError, KeyError, TypeError) as error:  # torch's own checks: group counts and sizes
            raise InvalidArgument(f"stage {self.index}: the optimizer state does not fit its optimizer: "
                                  f"{error}") from None

    def expect_optimizer_tensor(self, header) -> None:
        """InvalidArgument unless a tensor of this header can be optimizer state ("<parameter key>/<name>") of a
        parameter here, no larger than it."""
        key = header.name.rpartition("/")[0]
        parameter = self._tensors.get(key) if key in self.optimizer_keys else None
        if parameter is None:
            raise InvalidArgument(f"optimizer state {header.name[:200]!r} names no parameter of stage {self.index}")
        if wire.meta(header).numel() > max(parameter.numel(), 1):
            raise InvalidArgument(f"optimizer state {header.name!r} of shape {list(header.shape)} is larger than its "
                                  f"parameter {list(parameter.shape)}")

    def _parameter_keys(self) -> list[str]:
        """The keys of the stage's parameters, in layer order, each once (a tied weight by its first key)."""
        return [key for key, tensor in self._tensors.items() if isinstance(tensor, torch.nn.Parameter)]


def check_like(value: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """InvalidArgument naming `what` unless `value` has the dtype and shape of `reference`."""
    if value.shape != reference.shape or value.dtype != reference.dtype:
        raise InvalidArgument(f"{what}: expected {reference.dtype} of shape {list(reference.shape)}, "
                              f"got {value.dtype} of shape {list(value.shape)}")
