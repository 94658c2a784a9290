"""One stage of a model on one device: its layers and the autograd state of in-flight steps, forward to backward.
Its weights and optimizer, which everything outside forward and backward reads or changes, are a StageWeights
(stage_weights.py) that the stage holds."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shard_service import recomputation, split_backward
from shard_service.deferred_norms import DeferredNorms
from shard_service.recomputation import Replay
from shard_service.stage_weights import StageWeights, check_like
from shardtrain import logs, precision, wire
from shardtrain.capture import CapturedProgram, InputSpec, one_row_batch_norm
from shardtrain.errors import FailedPrecondition, InternalError, InvalidArgument, NotFound
from shardtrain.residuals import StageResiduals, Wiring, run_chain
from shardtrain.saved_bytes import SavedBytes

log = logging.getLogger("shardtrain.shard.stage")

StepKey = tuple[int, int]  # (step, microbatch)
SIGNATURES_KEPT = 1024  # input signatures whose saved-bytes count a stage remembers


@dataclass(frozen=True)
class LayerSource:
    """One layer as it arrives: the captured program, its wiring and its weight names."""

    index: int
    description: str
    program: bytes
    wiring: Wiring
    state_keys: dict[str, str]  # graph key -> the user's state-dict key
    eval_program: bytes = b""   # the layer's eval-mode graph, where it differs from `program`'s
    tied: dict[str, str] = field(default_factory=dict)  # state-dict key -> the first key of its tied tensor
    frozen: frozenset[str] = frozenset()  # parameters that take no gradient
    recompute: bool = False  # keeps only its inputs in training; its forward runs again in backward


@dataclass
class InFlight:
    """What backward of one step needs: the leaves it differentiates into and the roots it starts from."""

    inputs: torch.Tensor | None
    incoming: dict[str, torch.Tensor]
    output: torch.Tensor
    outgoing: dict[str, torch.Tensor] = field(default_factory=dict)
    saved_bytes: int = 0  # what autograd saved for backward: the step's activation memory
    is_loss: bool = False  # output is a scalar loss (a planned step's last stage): backward starts from ones
    weight_pass: split_backward.WeightPass | None = None  # a split backward between its two passes
    replay: Replay | None = None  # recomputed in backward: output and outgoing are None until then
    loss_scale: float = 1.0  # where a loss's backward starts (fp16's loss scaling)


class Stage:
    """Runs forward and backward of a contiguous slice of layers, keeping per-step state until backward. The
    weights the layers share, and their optimizer, are `weights`."""

    def __init__(self, index: int, sources: Sequence[LayerSource], residuals: StageResiduals,
                 optimizer: tuple, device: str, max_in_flight: int = 64, recompute: str = "never",
                 precision: str = "fp32"):
        self.index = index
        self.recompute = recompute  # which micro-batches keep only their inputs until backward (recompute_modes.py)
        self.precision = precision  # the dtype the layers compute in (precision.py)
        self.computes_loss = False  # the pipeline's last stage: a recomputed micro-batch keeps its output too
        self.device = torch.device(device)
        self.residuals = residuals
        self.layer_indexes = [source.index for source in sources]
        self.descriptions = [source.description for source in sources]
        self._wirings = [source.wiring for source in sources]
        self._norms = DeferredNorms()  # batch norms' running statistics, updated once per step
        self._layers, self._eval_layers, tensors, state, self._input_specs, self._two_rows = _load_layers(
            sources, self.device, precision, self._norms)
        self._segments = recomputation.segments([source.recompute for source in sources])  # run together
        self.weights = StageWeights(index, tensors, state, optimizer, self.device)  # the weights and their optimizer
        self._in_flight: OrderedDict[StepKey, InFlight] = OrderedDict()
        self._saved_bytes: dict[tuple, int] = {}  # per input signature: what autograd saves (see _run_counted)
        self._max_in_flight = max_in_flight
        self.peak_activation_bytes = 0  # the most in_flight_bytes has been

    @property
    def in_flight_steps(self) -> list[StepKey]:
        """Steps whose forward ran and whose backward has not."""
        return list(self._in_flight)

    @property
    def in_flight_bytes(self) -> int:
        """Bytes autograd holds for the steps in flight (each saved tensor counted once per save)."""
        return sum(state.saved_bytes for state in self._in_flight.values())

    def attach_loss(self, key: StepKey, loss_fn, target: torch.Tensor | None, weight: float,
                    model_output: str = "", loss_scale: float = 1.0) -> float:
        """Computes `weight * loss_fn(output, target)` of an in-flight step, or with `model_output` takes the loss
        the model computed itself: `weight *` that output ("output" for the main one). Its backward starts there.
        A micro-batch recomputed in backward takes its loss's value now and its graph then."""
        state = self._in_flight_state(key)
        arguments = (loss_fn, target.to(self.device) if target is not None else None, weight, model_output)
        if state.replay is not None:
            with torch.no_grad():
                loss = self._loss(state, key, *arguments, trains=False)
            state.replay.loss, state.replay.output, state.replay.outgoing = arguments, None, None
            state.output, state.outgoing = None, {}
        else:
            loss = state.output = self._loss(state, key, *arguments)
        state.is_loss, state.loss_scale = True, loss_scale
        return loss.item()

    def _loss(self, state: InFlight, key: StepKey, loss_fn, target: torch.Tensor | None, weight: float,
              model_output: str, trains: bool = True) -> torch.Tensor:
        if model_output:
            loss = self._model_loss(state, model_output, key, trains) * weight
        else:
            with torch.set_grad_enabled(trains):
                try:
                    loss = loss_fn(state.output, target) * weight
                except Exception as error:  # a target that does not fit the output, a loss that fails on its data
                    raise InvalidArgument(f"stage {self.index}: the loss failed on micro-batch {key[1]}: "
                                          f"{type(error).__name__}: {error}") from None
        if loss.dim() != 0:
            raise InvalidArgument(f"stage {self.index}: the loss must be a scalar, got shape {list(loss.shape)}")
        return loss

    def _model_loss(self, state: InFlight, name: str, key: StepKey, trains: bool = True) -> torch.Tensor:
        if name != "output" and name not in state.outgoing:
            raise InvalidArgument(f"stage {self.index}: the model's output {name!r}, named as its loss, is not "
                                  f"computed here (this last stage computes 'output' and {sorted(state.outgoing)})")
        value = state.output if name == "output" else state.outgoing[name]
        if trains and not value.requires_grad:
            raise InvalidArgument(f"stage {self.index}: the model's output {name!r}, named as its loss, does not "
                                  f"depend on any weight on micro-batch {key[1]}: nothing to train from it")
        return value

    def check_input(self, x: torch.Tensor) -> None:
        """InvalidArgument unless `x` fits the first layer's main input."""
        self._input_specs[0][0].check(x, f"stage {self.index} input (layer {self.layer_indexes[0]})")

    def incoming_spec(self, name: str) -> InputSpec | None:
        """The dtype and shape the first consumer in this stage expects for residual `name`; None if no layer here
        reads it (a model input the first stage only passes on)."""
        for wiring, specs in zip(self._wirings, self._input_specs):
            if name in wiring.dependencies:
                return specs[1 + wiring.dependencies.index(name)]
        return None

    def forward(self, key: StepKey, x: torch.Tensor, incoming: dict[str, torch.Tensor], requires_grad: bool,
                input_requires_grad: bool = False, training: bool = True,
                microbatches: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Runs the stage; keeps autograd state under `key` when requires_grad. Returns output and outgoing residuals.

        A later stage always differentiates into its input; the first only when `input_requires_grad`.
        `training` False runs the layers' eval-mode graphs (the model's eval()). In training, batch norms' running
        statistics advance once per step, after the forward of its last of `microbatches` (deferred_norms.py).
        """
        self._check_ready(key, requires_grad)
        self.check_input(x)
        if training and self._two_rows is not None and x.dim() and x.shape[0] < 2:
            index, description, shape = self._two_rows
            size = [x.shape[0], *shape[1:]]
            raise InvalidArgument(f"stage {self.index} layer {index} ({description}): Expected more than 1 value per "
                                  f"channel when training, got input size {size} (as PyTorch refuses it: pass at "
                                  "least 2 rows per batch and micro-batch in training mode, or call model.eval())")
        # detach(): our own leaves, never the caller's tensors (to() returns the same object on the same device)
        x = _leaf(x.to(self.device), requires_grad and (self.index > 0 or input_requires_grad))
        leaves = {name: _leaf(t.to(self.device), requires_grad) for name, t in incoming.items()}
        saved = dict(leaves)
        layers = self._layers if training else self._eval_layers
        if training and key[1] == 0:
            self._norms.start_step()
        replay = Replay(layers, x, recomputation.random_state(self.device)) if requires_grad and \
            self._recomputes(key, microbatches) else None
        with torch.set_grad_enabled(requires_grad and replay is None):
            output, saved_bytes = self._run_counted(layers, x, saved) if requires_grad and replay is None else \
                (self._run(layers, x, saved), 0)
        if training and key[1] + 1 >= microbatches:
            self._norms.commit()
        outgoing = {name: saved[name] for name in self.residuals.outgoing}
        if replay is not None:  # what stays is the inputs, to run the forward again in backward
            if self.computes_loss:  # and the outputs, whose loss attach_loss takes next
                replay.output, replay.outgoing = output.detach(), {name: t.detach() for name, t in outgoing.items()}
            saved_bytes = sum(t.nbytes for t in (x, *leaves.values(), *((output, *outgoing.values())
                                                                         if self.computes_loss else ())))
            self._remember(key, InFlight(x if x.requires_grad else None, leaves, replay.output,
                                         dict(replay.outgoing or {}), saved_bytes, replay=replay))
        elif requires_grad:
            self._remember(key, InFlight(x if x.requires_grad else None, leaves, output, outgoing, saved_bytes))
        return output.detach(), {name: t.detach() for name, t in outgoing.items()}

    def _recomputes(self, key: StepKey, microbatches: int) -> bool:
        """Whether this micro-batch's forward runs again in its backward: every one's ("always"), or every one's
        but the step's last, whose backward comes first ("except_last", as torchgpipe's checkpoint)."""
        return self.recompute == "always" or (self.recompute == "except_last" and key[1] + 1 < microbatches)

    def _replayed(self, key: StepKey) -> InFlight:
        """The in-flight state of `key`, its forward run again with autograd (and the same random numbers) if it
        kept only its inputs. Batch norms' running statistics are not counted twice."""
        state = self._in_flight_state(key)
        replay, state.replay = state.replay, None
        if replay is None:
            return state
        x, saved = replay.input, dict(state.incoming)
        with recomputation.replaying(self.device, replay.random_state), self._norms.paused(), torch.enable_grad():
            state.output = self._run(replay.layers, x, saved)
        state.outgoing = {name: saved[name] for name in self.residuals.outgoing}
        if replay.loss is not None:
            state.output = self._loss(state, key, *replay.loss)
        return state

    def _run_counted(self, layers: list[torch.nn.Module], x: torch.Tensor,
                     saved: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """_run, and the bytes autograd saved for backward. Those depend only on the inputs' shapes, dtypes and
        which of them require grad (a captured graph has no data-dependent branch), so they are counted, with a
        Python hook on every saved tensor, once per such signature: on every call the hook would cost about a
        quarter of a small layer's forward."""
        signature = (layers is self._layers, *((t.shape, t.dtype, t.requires_grad) for t in (x, *saved.values())))
        known = self._saved_bytes.get(signature)
        if known is not None:
            return self._run(layers, x, saved), known
        with SavedBytes(self.weights.state().values()) as counter:
            output = self._run(layers, x, saved)
        if len(self._saved_bytes) >= SIGNATURES_KEPT:  # batches of ever new sizes: nothing grows without bound
            self._saved_bytes.clear()
        self._saved_bytes[signature] = counter.total
        return output, counter.total

    def _run(self, layers: list[torch.nn.Module], x: torch.Tensor, saved: dict[str, torch.Tensor]) -> torch.Tensor:
        try:
            if self.precision == "fp32":
                return self._chain(layers, x, saved)
            with precision.computing(self.precision, self.device):
                output = self._chain(layers, x, saved)
            for name in self.residuals.outgoing:
                if name in saved:
                    saved[name] = precision.restored(saved[name], self.precision)
            return precision.restored(output, self.precision)
        except InvalidArgument as error:  # a layer's guard refusing its inputs
            raise InvalidArgument(f"stage {self.index}: {error}") from None
        except IndexError as error:  # an operator's own bounds check on the data (a token id past the embedding)
            raise InvalidArgument(f"stage {self.index} (layers {self.layer_indexes[0]}-{self.layer_indexes[-1]}): "
                                  f"the data is out of range: {error}") from None
        except Exception as error:  # a layer failing on its data: report which stage and layers
            raise InternalError(f"stage {self.index} (layers {self.layer_indexes[0]}-{self.layer_indexes[-1]}) "
                                f"failed: {type(error).__name__}: {error}") from None

    def _chain(self, layers: list[torch.nn.Module], x: torch.Tensor, saved: dict[str, torch.Tensor]) -> torch.Tensor:
        """run_chain; while training with autograd, each run of layers named for recomputation under one
        checkpoint (recomputation.run_segments)."""
        if layers is not self._layers or not torch.is_grad_enabled() or not any(r for _, _, r in self._segments):
            return run_chain(layers, self._wirings, x, saved)
        return recomputation.run_segments(layers, self._wirings, self._segments, x, saved, self._norms.paused)

    def _check_ready(self, key: StepKey, requires_grad: bool) -> None:
        if self.weights.unloaded:
            raise FailedPrecondition(f"stage {self.index} has not received weights "
                                     f"{sorted(self.weights.unloaded)[:5]}; load a state dict first")
        if requires_grad and key in self._in_flight:
            raise FailedPrecondition(f"step {key[0]} micro-batch {key[1]} is already in flight on stage {self.index}")

    def _remember(self, key: StepKey, state: InFlight) -> None:
        """Keeps a step's autograd state; beyond max_in_flight the oldest step's goes, never the micro-batches of the
        step at hand (a planned step's schedule bounds them: GPipe keeps all of them)."""
        self._in_flight[key] = state
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.in_flight_bytes)
        while len(self._in_flight) > self._max_in_flight and next(iter(self._in_flight))[0] != key[0]:
            dropped, _ = self._in_flight.popitem(last=False)
            log.warning("stage %d dropped step %s: more than %d steps in flight without backward",
                        self.index, dropped, self._max_in_flight, extra=logs.fields(stage=self.index, step=dropped[0]))

    def backward(self, key: StepKey, grad_output: torch.Tensor | None,
                 residual_grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
        """Backpropagates one step; returns the gradient of the input and of each fetched residual. Frees the step."""
        state = self._replayed(key)
        roots, grads = self._roots(state, grad_output, residual_grads)
        if roots:
            torch.autograd.backward(roots, grads)
        del self._in_flight[key]
        grad_input = state.inputs.grad if state.inputs is not None else None
        return grad_input, {name: leaf.grad for name, leaf in state.incoming.items()}

    def backward_input(self, key: StepKey, grad_output: torch.Tensor | None,
                       residual_grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, dict]:
        """The first half of a split backward: the gradient of the input and of each fetched residual, as backward
        returns them. The step stays in flight until backward_weight computes the parameters' gradients."""
        state = self._replayed(key)
        roots, grads = self._roots(state, grad_output, residual_grads)
        names = list(state.incoming)
        leaf_grads, state.weight_pass = split_backward.input_pass(
            roots, grads, [state.inputs, *(state.incoming[name] for name in names)], self.weights.parameters)
        return leaf_grads[0], dict(zip(names, leaf_grads[1:]))

    def backward_weight(self, key: StepKey) -> None:
        """The second half of a split backward: accumulates the parameters' gradients. Frees the step."""
        state = self._in_flight_state(key)
        if state.weight_pass is None:
            raise FailedPrecondition(f"stage {self.index} has not run the input gradient of step {key[0]} "
                                     f"micro-batch {key[1]}; a weight gradient follows it")
        state.weight_pass.run()
        del self._in_flight[key]

    def _in_flight_state(self, key: StepKey) -> InFlight:
        if key not in self._in_flight:
            raise NotFound(f"stage {self.index} has no step {key[0]} micro-batch {key[1]} in flight "
                           f"(in flight: {[k[0] for k in self._in_flight]}); run forward first")
        return self._in_flight[key]

    def _roots(self, state: InFlight, grad_output: torch.Tensor | None, residual_grads: dict[str, torch.Tensor]):
        """Where a step's backward starts: its outputs that take a gradient, and those gradients."""
        if state.weight_pass is not None:
            raise FailedPrecondition(f"stage {self.index} already ran this step's input gradient; "
                                     "its weight gradient comes next")
        if grad_output is None and state.is_loss:
            grad_output = torch.full_like(state.output, state.loss_scale)
        if grad_output is not None:
            check_like(grad_output, state.output, f"stage {self.index} output gradient")
        pairs = [(state.output, grad_output)] + [(state.outgoing[n], g) for n, g in residual_grads.items()]
        pairs = [(root, grad.to(self.device)) for root, grad in pairs if grad is not None and root.requires_grad]
        for root, grad in pairs:
            check_like(grad, root, f"stage {self.index} gradient")
        return [root for root, _ in pairs], [grad for _, grad in pairs]

    def forget(self, up_to_step: int) -> None:
        """Drops the state of steps up to `up_to_step` whose backward never came."""
        for key in [k for k in self._in_flight if k[0] <= up_to_step]:
            del self._in_flight[key]

    def expect_input(self, header) -> None:
        """check_input for a tensor of this header, before any of it is stored."""
        self.check_input(wire.meta(header))


def _load_layers(sources: Sequence[LayerSource], device: torch.device, computes_in: str, norms: DeferredNorms):
    """A stage's layers built from their captured programs, computing in dtype `computes_in`, their batch norms'
    running statistics installed in `norms`: (training-mode layers, eval-mode layers, each weight once by its key
    (a tied one by its first key), weights by state-dict key, each layer's input specs, (layer index,
    description, input shape) of the first layer that needs 2 rows in training or None). A layer without an
    eval-mode graph of its own is the same module in both lists, and both share the weights."""
    layers, eval_layers, tensors, state, inputs, two_rows = [], [], {}, {}, [], None
    for source in sources:
        program = CapturedProgram(source.program)
        graph_state = {}
        for spec in program.state_specs():
            if spec.graph_key not in source.state_keys:
                raise InvalidArgument(f"layer {source.index}: weight {spec.graph_key!r} has no state-dict key")
            key = source.state_keys[spec.graph_key]
            home = source.tied.get(key, key)
            tensor = tensors.get(home)  # tied weights: one tensor under every key
            if tensor is None:
                if spec.is_parameter and not (spec.dtype.is_floating_point or spec.dtype.is_complex):
                    raise InvalidArgument(f"layer {source.index}: parameter {key!r} is declared {spec.dtype}; a "
                                          "parameter that trains is floating-point or complex")
                tensor = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
                if spec.is_parameter:
                    tensor = torch.nn.Parameter(tensor, requires_grad=key not in source.frozen)
                tensors[home] = tensor
            elif list(tensor.shape) != list(spec.shape) or tensor.dtype != spec.dtype:
                raise InvalidArgument(f"layer {source.index}: weight {key!r} is tied to {home!r}, a "
                                      f"{tensor.dtype} of shape {list(tensor.shape)}, but is a {spec.dtype} of "
                                      f"shape {list(spec.shape)}")
            graph_state[spec.graph_key] = state[key] = tensor
        layers.append(program.load(graph_state, device))
        if computes_in != "fp32":
            precision.relax(layers[-1])
        if source.eval_program:  # a layer that reads `training` (a batch norm) has graphs of its own per mode
            norms.install(layers[-1])
        shape = one_row_batch_norm(layers[-1])
        if shape is not None and two_rows is None:
            two_rows = (source.index, source.description, shape)
        inputs.append(program.input_specs())
        eval_layers.append(_eval_layer(source, program, graph_state, device) if source.eval_program
                           else layers[-1])
        if computes_in != "fp32" and source.eval_program:
            precision.relax(eval_layers[-1])
    return layers, eval_layers, tensors, state, inputs, two_rows


def _eval_layer(source: LayerSource, program: CapturedProgram, graph_state: dict[str, torch.Tensor],
                device: torch.device) -> torch.nn.Module:
    """The layer's eval-mode graph on the training graph's own weights (all of them, or those it uses: a branch
    taken only in training mode may be the only user of a weight); InvalidArgument if it wants others, or other
    inputs."""
    eval_program = CapturedProgram(source.eval_program)
    weights = {}
    for spec in eval_program.state_specs():
        tensor = graph_state.get(spec.graph_key)
        if tensor is None or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype or \
                isinstance(tensor, torch.nn.Parameter) != spec.is_parameter:
            raise InvalidArgument(f"layer {source.index}: the eval-mode graph wants weight {spec.graph_key!r} as "
                                  f"{spec.dtype} of shape {list(spec.shape)}, which the training graph does not have")
        weights[spec.graph_key] = tensor
    if eval_program.input_specs() != program.input_specs():
        raise InvalidArgument(f"layer {source.index}: the eval-mode graph takes other inputs than the training graph "
                              f"({eval_program.input_specs()} against {program.input_specs()})")
    return eval_program.load(weights, device)


def _leaf(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """Our own autograd leaf, never the caller's tensor; only floating-point values take a gradient (token ids and
    masks do not)."""
    differentiable = tensor.is_floating_point() or tensor.is_complex()
    return tensor.detach().requires_grad_(requires_grad and differentiable)

