"""shard_service.stage: a Stage built from captured layers trains exactly like the same layers in plain PyTorch."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from shard_service.stage import LayerSource, Stage
from shardtrain.capture import InputSpec, LayerAdapter, capture_layer
from shardtrain.errors import FailedPrecondition, InternalError, InvalidArgument, NotFound
from shardtrain.residuals import StageResiduals, Wiring

SGD = ("SGD", '{"lr": 0.1, "momentum": 0.9}')
TOLERANCE = 1e-6


class LinearPlusResidual(torch.nn.Module):
    """Consumes a residual: linear(x) + r."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features)

    def forward(self, x, r):
        return self.linear(x) + r


def capture(layer: torch.nn.Module, *example: torch.Tensor, out_variables: tuple[str, ...] = ()) -> bytes:
    return capture_layer(LayerAdapter(layer, out_variables), example)


@pytest.fixture(scope="module")
def programs() -> dict[str, bytes]:
    """Captured once for the module (a capture costs ~0.3 s); weights travel separately anyway."""
    return {
        "linear_3_4": capture(torch.nn.Linear(3, 4), torch.randn(2, 3)),
        "relu_4": capture(torch.nn.ReLU(), torch.randn(2, 4)),
        "linear_4_2": capture(torch.nn.Linear(4, 2), torch.randn(2, 4)),
        "linear_3_2": capture(torch.nn.Linear(3, 2), torch.randn(2, 3)),
        "linear_3_3_saves_r": capture(torch.nn.Linear(3, 3), torch.randn(2, 3), out_variables=("r",)),
        "linear_2_3_plus_r": capture(LinearPlusResidual(2, 3), torch.randn(2, 2), torch.randn(2, 3)),
    }


def source(index: int, layer: torch.nn.Module, program: bytes, wiring: Wiring = Wiring()) -> LayerSource:
    """A LayerSource as the SDK describes it: graph keys 'layer.<name>' -> model keys '<index>.<name>'."""
    keys = {key: f"{index}.{key.removeprefix('layer.')}" for key in LayerAdapter(layer).state_dict()}
    return LayerSource(index, type(layer).__name__, program, wiring, keys)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


@pytest.fixture
def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def mlp_stage(programs, mlp, index: int = 0, optimizer=SGD, max_in_flight: int = 64, load: bool = True) -> Stage:
    names = ["linear_3_4", "relu_4", "linear_4_2"]
    sources = [source(i, layer, programs[name]) for i, (layer, name) in enumerate(zip(mlp, names))]
    stage = Stage(index, sources, StageResiduals(), optimizer, "cpu", max_in_flight)
    if load:
        stage.weights.load_state(model_state(mlp))
    return stage


def assert_same_state(stage: Stage, model: torch.nn.Module) -> None:
    state = stage.weights.state()
    assert set(state) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.allclose(state[key], value, atol=TOLERANCE, rtol=0), key


# Training against plain PyTorch.

@pytest.mark.parametrize("stage_index", [0, 1])
def test_forward_backward_step_match_plain_pytorch(programs, mlp, stage_index):
    stage = mlp_stage(programs, mlp, index=stage_index)
    reference = copy.deepcopy(mlp)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    for step in range(1, 4):
        stage.weights.zero_grad()
        optimizer.zero_grad()
        for microbatch in range(2):  # gradients of micro-batches accumulate before the step
            x, grad = torch.randn(5, 3), torch.randn(5, 2)
            output, outgoing = stage.forward((step, microbatch), x.clone(), {}, requires_grad=True)
            grad_input, residual_grads = stage.backward((step, microbatch), grad, {})
            x_ref = x.clone().requires_grad_(stage_index > 0)
            expected = reference(x_ref)
            expected.backward(grad)
            assert torch.allclose(output, expected, atol=TOLERANCE, rtol=0)
            assert (outgoing, residual_grads) == ({}, {})
            if stage_index == 0:
                assert grad_input is None  # the first stage's input is data: no gradient to send
            else:
                assert torch.allclose(grad_input, x_ref.grad, atol=TOLERANCE, rtol=0)
        stage.weights.step()
        optimizer.step()
        assert_same_state(stage, reference)
    assert not torch.allclose(stage.weights.state()["0.weight"], mlp[0].weight)  # it did train


@pytest.mark.parametrize("stage_index", [0, 1])
def test_a_split_backward_matches_plain_pytorch(programs, mlp, stage_index):
    """backward_input then backward_weight: the input gradient at once, the weights' after, as one backward."""
    stage = mlp_stage(programs, mlp, index=stage_index)
    reference = copy.deepcopy(mlp)
    torch.manual_seed(1)
    x, grad = torch.randn(5, 3), torch.randn(5, 2)
    stage.forward((1, 0), x.clone(), {}, requires_grad=True)
    grad_input, residual_grads = stage.backward_input((1, 0), grad, {})
    x_ref = x.clone().requires_grad_(stage_index > 0)
    reference(x_ref).backward(grad)
    assert residual_grads == {} and all(p.grad is None for p in stage.weights.parameters)
    if stage_index == 0:
        assert grad_input is None
    else:
        assert torch.allclose(grad_input, x_ref.grad, atol=TOLERANCE, rtol=0)
    assert stage.in_flight_steps == [(1, 0)]  # held until its weight gradient
    stage.backward_weight((1, 0))
    assert stage.in_flight_steps == []
    for parameter, expected in zip(stage.weights.parameters, reference.parameters()):
        assert torch.allclose(parameter.grad, expected.grad, atol=TOLERANCE, rtol=0)


def test_a_split_backward_runs_its_halves_in_order_once(programs, mlp):
    stage = mlp_stage(programs, mlp)
    stage.forward((1, 0), torch.zeros(2, 3), {}, requires_grad=True)
    with pytest.raises(FailedPrecondition, match="stage 0 has not run the input gradient of step 1 micro-batch 0"):
        stage.backward_weight((1, 0))
    stage.backward_input((1, 0), torch.ones(2, 2), {})
    for second in (lambda: stage.backward_input((1, 0), torch.ones(2, 2), {}),
                   lambda: stage.backward((1, 0), torch.ones(2, 2), {})):
        with pytest.raises(FailedPrecondition, match="already ran this step's input gradient"):
            second()
    stage.forget(1)  # a failed step drops a backward between its halves too
    assert stage.in_flight_steps == []
    with pytest.raises(NotFound):
        stage.backward_weight((1, 0))


def test_forward_output_is_detached(programs, mlp):
    output, _ = mlp_stage(programs, mlp).forward((1, 0), torch.randn(2, 3), {}, requires_grad=True)
    assert not output.requires_grad


def test_forward_without_grad_keeps_no_state(programs, mlp):
    stage = mlp_stage(programs, mlp)
    output, _ = stage.forward((1, 0), torch.ones(2, 3), {}, requires_grad=False)
    assert torch.allclose(output, mlp(torch.ones(2, 3)), atol=TOLERANCE, rtol=0)
    assert stage.in_flight_steps == []
    stage.forward((1, 0), torch.ones(2, 3), {}, requires_grad=False)  # the same key again is fine without state


def test_step_without_gradients_leaves_weights_alone(programs, mlp):
    stage = mlp_stage(programs, mlp)
    stage.weights.step()
    assert_same_state(stage, mlp)


def test_zero_grad_clears_accumulated_gradients(programs, mlp):
    stage = mlp_stage(programs, mlp, optimizer=("SGD", '{"lr": 0.1}'))
    stage.forward((1, 0), torch.randn(4, 3), {}, requires_grad=True)
    stage.backward((1, 0), torch.randn(4, 2), {})
    stage.weights.zero_grad()
    stage.weights.step()
    assert_same_state(stage, mlp)


def test_parameter_count(programs, mlp):
    assert mlp_stage(programs, mlp).weights.parameter_count == 3 * 4 + 4 + 4 * 2 + 2


def test_layer_indexes_and_descriptions_come_from_the_sources(programs, mlp):
    stage = mlp_stage(programs, mlp)
    assert stage.layer_indexes == [0, 1, 2]
    assert stage.descriptions == ["Linear", "ReLU", "Linear"]


# Weights.

def test_load_state_returns_the_loaded_keys_sorted(programs, mlp):
    stage = mlp_stage(programs, mlp, load=False)
    assert stage.weights.load_state(model_state(mlp)) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_load_state_copies_into_the_tensors_the_optimizer_holds(programs, mlp):
    stage = mlp_stage(programs, mlp)
    stage.weights.load_state({"2.bias": torch.tensor([5.0, -5.0])})
    stage.forward((1, 0), torch.zeros(1, 3), {}, requires_grad=True)
    stage.backward((1, 0), torch.zeros(1, 2), {})
    stage.weights.step()  # zero gradient: the loaded value must survive the step untouched
    assert stage.weights.state()["2.bias"].tolist() == [5.0, -5.0]


def test_load_state_refuses_an_unknown_key_naming_what_the_stage_holds(programs, mlp):
    stage = mlp_stage(programs, mlp)
    message = "stage 0 has no weight '1.weight'; it holds ['0.bias', '0.weight', '2.bias', '2.weight']"
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        stage.weights.load_state({"1.weight": torch.zeros(4, 3)})


@pytest.mark.parametrize(("value", "got"), [
    (torch.zeros(3, 4), "torch.float32 of shape [3, 4]"),
    (torch.zeros(4, 3, dtype=torch.float64), "torch.float64 of shape [4, 3]"),
])
def test_load_state_refuses_a_wrong_shape_or_dtype(programs, mlp, value, got):
    stage = mlp_stage(programs, mlp)
    message = f"weight '0.weight': expected torch.float32 of shape [4, 3], got {got}"
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        stage.weights.load_state({"0.weight": value})


def test_load_state_with_one_bad_entry_loads_nothing(programs, mlp):
    stage = mlp_stage(programs, mlp)
    with pytest.raises(InvalidArgument):
        stage.weights.load_state({"0.bias": torch.full((4,), 9.0), "0.weight": torch.zeros(1)})
    assert_same_state(stage, mlp)


def test_forward_before_weights_are_loaded_is_failed_precondition(programs, mlp):
    stage = mlp_stage(programs, mlp, load=False)
    with pytest.raises(FailedPrecondition, match=re.escape("stage 0 has not received weights ['0.bias', '0.weight'")):
        stage.forward((1, 0), torch.zeros(2, 3), {}, requires_grad=True)


def test_forward_after_a_partial_load_names_the_missing_weights(programs, mlp):
    stage = mlp_stage(programs, mlp, load=False)
    stage.weights.load_state({k: v for k, v in model_state(mlp).items() if k != "2.weight"})
    with pytest.raises(FailedPrecondition, match=re.escape("has not received weights ['2.weight']")):
        stage.forward((1, 0), torch.zeros(2, 3), {}, requires_grad=False)


def test_source_without_a_state_key_for_a_weight_is_refused(programs, mlp):
    broken = LayerSource(0, "Linear", programs["linear_3_4"], Wiring(), {"layer.weight": "0.weight"})
    with pytest.raises(InvalidArgument, match="layer 0: weight 'layer.bias' has no state-dict key"):
        Stage(0, [broken], StageResiduals(), SGD, "cpu")


def test_bad_optimizer_is_refused_when_the_stage_is_built(programs, mlp):
    with pytest.raises(InvalidArgument, match="optimizer 'LBFGS' is not allowed"):
        mlp_stage(programs, mlp, optimizer=("LBFGS", "{}"), load=False)


# Requests that do not fit.

@pytest.mark.parametrize(("x", "got"), [
    (torch.zeros(2, 5), "float32 of shape [2, 5]"),
    (torch.zeros(2, 3, dtype=torch.float64), "float64 of shape [2, 3]"),
    (torch.zeros(3), "float32 of shape [3]"),
])
def test_wrong_input_names_the_stage_and_the_expected_shape(programs, mlp, x, got):
    stage = mlp_stage(programs, mlp, index=2)
    expected = r"stage 2 input \(layer 0\): expected float32 of shape \['?batch'?, 3\], got " + re.escape(got)
    with pytest.raises(InvalidArgument, match=expected):
        stage.forward((1, 0), x, {}, requires_grad=True)
    assert stage.in_flight_steps == []


def test_second_forward_of_the_same_key_is_failed_precondition(programs, mlp):
    stage = mlp_stage(programs, mlp)
    stage.forward((7, 1), torch.zeros(2, 3), {}, requires_grad=True)
    with pytest.raises(FailedPrecondition, match="step 7 micro-batch 1 is already in flight on stage 0"):
        stage.forward((7, 1), torch.zeros(2, 3), {}, requires_grad=True)


def test_backward_of_an_unknown_step_is_not_found(programs, mlp):
    stage = mlp_stage(programs, mlp)
    stage.forward((1, 0), torch.zeros(2, 3), {}, requires_grad=True)
    with pytest.raises(NotFound, match=re.escape("stage 0 has no step 5 micro-batch 0 in flight (in flight: [1])")):
        stage.backward((5, 0), torch.zeros(2, 2), {})


def test_backward_with_a_wrong_gradient_shape_names_it(programs, mlp):
    stage = mlp_stage(programs, mlp)
    stage.forward((1, 0), torch.zeros(2, 3), {}, requires_grad=True)
    message = "stage 0 output gradient: expected torch.float32 of shape [2, 2], got torch.float32 of shape [3, 2]"
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        stage.backward((1, 0), torch.zeros(3, 2), {})
    assert stage.in_flight_steps == [(1, 0)]  # a bad request leaves the step for a good one


# In-flight state.

def test_backward_frees_the_step(programs, mlp):
    stage = mlp_stage(programs, mlp)
    stage.forward((1, 0), torch.zeros(2, 3), {}, requires_grad=True)
    stage.forward((1, 1), torch.zeros(2, 3), {}, requires_grad=True)
    assert stage.in_flight_steps == [(1, 0), (1, 1)]
    stage.backward((1, 0), torch.zeros(2, 2), {})
    assert stage.in_flight_steps == [(1, 1)]
    with pytest.raises(NotFound):
        stage.backward((1, 0), torch.zeros(2, 2), {})


def test_max_in_flight_drops_the_oldest_step(programs, mlp):
    stage = mlp_stage(programs, mlp, max_in_flight=2)
    for step in (1, 2, 3):
        stage.forward((step, 0), torch.zeros(2, 3), {}, requires_grad=True)
    assert stage.in_flight_steps == [(2, 0), (3, 0)]
    with pytest.raises(NotFound, match="no step 1 micro-batch 0"):
        stage.backward((1, 0), torch.zeros(2, 2), {})


def test_forget_drops_steps_up_to_the_given_one(programs, mlp):
    stage = mlp_stage(programs, mlp)
    for key in [(1, 0), (2, 0), (2, 1), (3, 0)]:
        stage.forward(key, torch.zeros(2, 3), {}, requires_grad=True)
    stage.forget(2)
    assert stage.in_flight_steps == [(3, 0)]


# A stage without parameters.

def test_stage_without_parameters_runs_without_weights_or_optimizer(programs):
    stage = Stage(1, [source(4, torch.nn.ReLU(), programs["relu_4"])], StageResiduals(), SGD, "cpu")
    assert stage.weights.parameter_count == 0
    assert stage.weights.state() == {}
    x = torch.tensor([[-1.0, 2.0, -3.0, 4.0]])
    output, _ = stage.forward((1, 0), x.clone(), {}, requires_grad=True)
    assert output.tolist() == [[0.0, 2.0, 0.0, 4.0]]
    grad_input, _ = stage.backward((1, 0), torch.ones(1, 4), {})
    assert grad_input.tolist() == [[0.0, 1.0, 0.0, 1.0]]
    stage.weights.step()


def test_first_stage_without_parameters_has_nothing_to_differentiate(programs):
    stage = Stage(0, [source(0, torch.nn.ReLU(), programs["relu_4"])], StageResiduals(), SGD, "cpu")
    stage.forward((1, 0), torch.randn(3, 4), {}, requires_grad=True)
    assert stage.backward((1, 0), torch.ones(3, 4), {}) == (None, {})
    assert stage.in_flight_steps == []


# Residuals.

@pytest.fixture
def producer_layers() -> list[torch.nn.Module]:
    torch.manual_seed(2)
    return [torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)]


def producer_stage(programs, layers) -> Stage:
    """Stage 0: layer 0 saves its output as 'r' for stage 1; layer 1 is plain."""
    sources = [source(0, layers[0], programs["linear_3_3_saves_r"], Wiring(out_variables=("r",))),
               source(1, layers[1], programs["linear_3_2"])]
    stage = Stage(0, sources, StageResiduals(outgoing={"r": [1]}), ("SGD", '{"lr": 0.1}'), "cpu")
    stage.weights.load_state(model_state(torch.nn.Sequential(*layers)))
    return stage


def test_producer_returns_the_saved_residual_as_outgoing(programs, producer_layers):
    stage = producer_stage(programs, producer_layers)
    x = torch.randn(4, 3)
    output, outgoing = stage.forward((1, 0), x, {}, requires_grad=True)
    r = producer_layers[0](x)
    assert set(outgoing) == {"r"}
    assert torch.allclose(outgoing["r"], r, atol=TOLERANCE, rtol=0) and not outgoing["r"].requires_grad
    assert torch.allclose(output, producer_layers[1](r), atol=TOLERANCE, rtol=0)


def test_producer_backward_adds_the_residual_gradient(programs, producer_layers):
    stage = producer_stage(programs, producer_layers)
    x, grad_output, grad_r = torch.randn(4, 3), torch.randn(4, 2), torch.randn(4, 3)
    stage.forward((1, 0), x, {}, requires_grad=True)
    stage.backward((1, 0), grad_output, {"r": grad_r})
    stage.weights.step()
    reference = copy.deepcopy(torch.nn.Sequential(*producer_layers))
    r = reference[0](x)
    torch.autograd.backward([reference[1](r), r], [grad_output, grad_r])
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert_same_state(stage, reference)


def test_producer_backward_without_the_residual_gradient_differs(programs, producer_layers):
    """The residual's gradient must matter: leaving it out gives other weights."""
    with_grad, without_grad = producer_stage(programs, producer_layers), producer_stage(programs, producer_layers)
    x, grad_output, grad_r = torch.randn(4, 3), torch.randn(4, 2), torch.randn(4, 3)
    for stage, residual_grads in ((with_grad, {"r": grad_r}), (without_grad, {})):
        stage.forward((1, 0), x.clone(), {}, requires_grad=True)
        stage.backward((1, 0), grad_output, residual_grads)
        stage.weights.step()
    assert not torch.allclose(with_grad.weights.state()["0.weight"], without_grad.weights.state()["0.weight"])


@pytest.fixture
def consumer_layer() -> LinearPlusResidual:
    torch.manual_seed(3)
    return LinearPlusResidual(2, 3)


def consumer_stage(programs, layer) -> Stage:
    """Stage 1: one layer that adds residual 'r' fetched from stage 0."""
    sources = [source(5, layer, programs["linear_2_3_plus_r"], Wiring(dependencies=("r",)))]
    stage = Stage(1, sources, StageResiduals(incoming={"r": 0}), ("SGD", '{"lr": 0.1}'), "cpu")
    stage.weights.load_state({f"5.{k}": v.clone() for k, v in layer.state_dict().items()})
    return stage


def test_consumer_uses_the_incoming_residual_and_returns_its_gradient(programs, consumer_layer):
    stage = consumer_stage(programs, consumer_layer)
    x, r, grad_output = torch.randn(4, 2), torch.randn(4, 3), torch.randn(4, 3)
    output, outgoing = stage.forward((1, 0), x.clone(), {"r": r.clone()}, requires_grad=True)
    assert outgoing == {}
    assert torch.allclose(output, consumer_layer(x, r), atol=TOLERANCE, rtol=0)
    grad_input, residual_grads = stage.backward((1, 0), grad_output, {})
    x_ref, r_ref = x.clone().requires_grad_(), r.clone().requires_grad_()
    consumer_layer(x_ref, r_ref).backward(grad_output)
    assert torch.allclose(grad_input, x_ref.grad, atol=TOLERANCE, rtol=0)
    assert set(residual_grads) == {"r"}
    assert torch.allclose(residual_grads["r"], r_ref.grad, atol=TOLERANCE, rtol=0)


def test_consumer_names_the_spec_of_its_incoming_residual(programs, consumer_layer):
    stage = consumer_stage(programs, consumer_layer)
    assert stage.incoming_spec("r") == InputSpec(torch.float32, (None, 3))
    assert stage.incoming_spec("res_1") is None  # no layer here reads it (a model input only passed on)


def test_layer_failing_on_its_data_names_the_stage_and_layers(programs, consumer_layer):
    stage = consumer_stage(programs, consumer_layer)
    with pytest.raises(InternalError, match=r"stage 1 \(layers 5-5\) failed: RuntimeError"):
        stage.forward((1, 0), torch.randn(4, 2), {"r": torch.randn(4, 5)}, requires_grad=True)
    assert stage.in_flight_steps == []


def test_in_flight_bytes_count_saved_activations_not_weights(monkeypatch):
    linear = torch.nn.Linear(16, 16)
    program = capture_layer(LayerAdapter(linear), (torch.randn(2, 16),))
    source = LayerSource(0, "Linear", program, Wiring(), {"layer.weight": "0.weight", "layer.bias": "0.bias"})
    stage = Stage(1, [source], StageResiduals({}, {}), ("SGD", '{"lr": 0.1}'), "cpu")
    stage.weights.load_state({"0.weight": linear.weight.detach(), "0.bias": linear.bias.detach()})
    stage.forward((0, 0), torch.randn(8, 16), {}, True)
    assert stage.in_flight_bytes == 8 * 16 * 4  # the input the weight's gradient needs; not the weight
    stage.forward((1, 0), torch.randn(8, 16), {}, True)  # counted once per signature, then known
    stage.forward((2, 0), torch.randn(3, 16), {}, True)  # another batch size is another signature
    assert stage.in_flight_bytes == (8 + 8 + 3) * 16 * 4
    stage.forward((3, 0), torch.randn(8, 16), {}, False)
    assert stage.in_flight_bytes == (8 + 8 + 3) * 16 * 4, "a forward without grad keeps nothing"
    monkeypatch.setattr("shard_service.stage.SIGNATURES_KEPT", 1)  # every new signature forgets the others
    for step, rows in enumerate([5, 8, 5, 3], start=4):
        stage.forward((step, 0), torch.randn(rows, 16), {}, True)
    assert stage.in_flight_bytes == (8 + 8 + 3 + 5 + 8 + 5 + 3) * 16 * 4


@pytest.fixture(scope="module")
def batchnorm_programs() -> tuple[bytes, bytes]:
    """A BatchNorm1d(3) captured in training mode and in eval mode."""
    adapter = LayerAdapter(torch.nn.BatchNorm1d(3))
    return capture_layer(adapter.train(), (torch.randn(2, 3),)), capture_layer(adapter.eval(), (torch.randn(2, 3),))


def test_eval_mode_runs_the_eval_graph_on_the_training_graphs_weights(batchnorm_programs):
    torch.manual_seed(0)
    batchnorm = torch.nn.Sequential(torch.nn.BatchNorm1d(3))  # state-dict keys "0.<name>", as source() gives
    train, evaluation = batchnorm_programs
    keys = {key: f"0.{key.removeprefix('layer.')}" for key in LayerAdapter(batchnorm[0]).state_dict()}
    stage = Stage(0, [LayerSource(0, "BatchNorm1d", train, Wiring(), keys, evaluation)], StageResiduals(), SGD, "cpu")
    stage.weights.load_state(model_state(batchnorm))
    x = torch.randn(5, 3) * 3 + 1

    output, _ = stage.forward((0, 0), x, {}, requires_grad=False, training=True)
    assert torch.allclose(output, batchnorm(x), atol=TOLERANCE)  # by the batch, and the statistics move
    assert_same_state(stage, batchnorm)
    output, _ = stage.forward((1, 0), x, {}, requires_grad=True, training=False)
    assert torch.allclose(output, batchnorm.eval()(x), atol=TOLERANCE)  # by the running statistics, which stay
    assert_same_state(stage, batchnorm)
    stage.backward((1, 0), torch.ones(5, 3), {})
    assert all(p.grad is not None for p in stage.weights.parameters)  # eval mode still trains the affine weights


def test_an_eval_graph_that_wants_other_weights_is_refused(programs, batchnorm_programs):
    keys = {key: f"0.{key.removeprefix('layer.')}" for key in LayerAdapter(torch.nn.BatchNorm1d(3)).state_dict()}
    wrong = LayerSource(0, "BatchNorm1d", batchnorm_programs[0], Wiring(), keys, programs["linear_3_4"])
    with pytest.raises(InvalidArgument, match=r"layer 0: the eval-mode graph wants weight 'layer.weight' as "
                                              r"torch.float32 of shape \[4, 3\]"):
        Stage(0, [wrong], StageResiduals(), SGD, "cpu")
