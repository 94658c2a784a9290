"""shardtrain.capture: the layer calling convention, capture + rebuild, and the checks on untrusted programs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from client_sdk.seed_models import wrapped_linear
from shardtrain.capture import CapturedProgram, InputSpec, LayerAdapter, StateSpec, capture_layer
from shardtrain.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]


class AddResidual(torch.nn.Module):
    """A layer with a dependency: x + r."""

    def forward(self, x, r):
        return x + r


class SeedStyle(torch.nn.Module):
    """Returns (x, [(name, tensor), ...]) with the saved tensors in an order of its own."""

    def forward(self, x):
        return x * 2, [("b", x + 2), ("a", x + 1)]


# LayerAdapter: one calling convention for every layer (no capture needed).

def test_adapter_passes_a_plain_result_through():
    x = torch.tensor([1.0, -1.0])
    out = LayerAdapter(torch.nn.ReLU())(x)
    assert isinstance(out, torch.Tensor)
    assert out.tolist() == [1.0, 0.0]


def test_adapter_reorders_seed_style_saved_tensors_to_out_variables_order():
    out = LayerAdapter(SeedStyle(), ("a", "b"))(torch.tensor([1.0]))
    assert [t.tolist() for t in out] == [[2.0], [2.0], [3.0]]


def test_adapter_returns_only_the_saved_tensors_named_in_out_variables():
    out = LayerAdapter(SeedStyle(), ("b",))(torch.tensor([1.0]))
    assert [t.tolist() for t in out] == [[2.0], [3.0]]


def test_adapter_makes_a_plain_layer_save_its_own_output():
    x = torch.tensor([1.0, -1.0])
    out, saved = LayerAdapter(torch.nn.ReLU(), ("r",))(x)
    assert out.tolist() == saved.tolist() == [1.0, 0.0]


def test_adapter_passes_dependencies_after_the_main_input():
    assert LayerAdapter(AddResidual())(torch.tensor([1.0]), torch.tensor([5.0])).tolist() == [6.0]


def test_adapter_on_the_seed_wrapped_linear_saving_res_1():
    layer = wrapped_linear(2, 3, out_variables=["res_1"])
    x = torch.randn(4, 2)
    out, res_1 = LayerAdapter(layer, ("res_1",))(x)
    assert torch.equal(out, layer.linear(x)) and torch.equal(res_1, layer.linear(x))


def test_adapter_state_dict_keys_carry_the_layer_prefix():
    assert list(LayerAdapter(torch.nn.Linear(2, 3)).state_dict()) == ["layer.weight", "layer.bias"]


# Captured programs (each torch.export costs ~0.3 s: captured once per module).

@pytest.fixture(scope="module")
def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 4)


@pytest.fixture(scope="module")
def linear_program(linear) -> bytes:
    return capture_layer(LayerAdapter(linear), (torch.randn(2, 3),))


@pytest.fixture(scope="module")
def residual_program() -> bytes:
    return capture_layer(LayerAdapter(AddResidual()), (torch.randn(2, 3), torch.randn(2, 3)))


@pytest.fixture(scope="module")
def batchnorm_program() -> bytes:
    return capture_layer(LayerAdapter(torch.nn.BatchNorm1d(3)), (torch.randn(2, 3),))


@pytest.fixture(scope="module")
def seed_program() -> tuple[wrapped_linear, bytes]:
    torch.manual_seed(1)
    layer = wrapped_linear(3, 3, out_variables=["res_1"])
    return layer, capture_layer(LayerAdapter(layer, ("res_1",)), (torch.randn(2, 3),))


def as_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Graph-keyed weights, as a shard would hand them to load(): Parameters and plain buffers."""
    adapter = LayerAdapter(module)
    state = {k: torch.nn.Parameter(p.detach().clone()) for k, p in adapter.named_parameters()}
    state.update({k: b.clone() for k, b in adapter.named_buffers()})
    return state


def test_rebuilt_layer_matches_the_original_on_another_batch_size(linear, linear_program):
    rebuilt = CapturedProgram(linear_program).load(as_state(linear))
    x = torch.randn(7, 3)
    assert torch.equal(rebuilt(x), linear(x))


def test_rebuilt_layer_accepts_a_batch_of_one(linear, linear_program):
    rebuilt = CapturedProgram(linear_program).load(as_state(linear))
    x = torch.randn(1, 3)
    assert torch.equal(rebuilt(x), linear(x))


def test_rebuilt_layer_uses_the_given_weights_in_place(linear_program):
    state = {"layer.weight": torch.nn.Parameter(torch.zeros(4, 3)), "layer.bias": torch.nn.Parameter(torch.zeros(4))}
    rebuilt = CapturedProgram(linear_program).load(state)
    with torch.no_grad():
        state["layer.bias"].fill_(2.0)  # the optimizer updates exactly these tensors
    assert rebuilt(torch.randn(5, 3)).eq(2.0).all()


def test_rebuilt_layer_backpropagates_into_the_given_parameters(linear, linear_program):
    state = as_state(linear)
    rebuilt = CapturedProgram(linear_program).load(state)
    x = torch.randn(5, 3)
    rebuilt(x).sum().backward()
    assert torch.allclose(state["layer.weight"].grad, x.sum(0).expand(4, 3))
    assert torch.equal(state["layer.bias"].grad, torch.full((4,), 5.0))


def test_rebuilt_layer_with_a_dependency_matches_on_another_batch_size(residual_program):
    rebuilt = CapturedProgram(residual_program).load({})
    x, r = torch.randn(6, 3), torch.randn(6, 3)
    assert torch.equal(rebuilt(x, r), x + r)


def test_rebuilt_seed_layer_returns_output_and_residual(seed_program):
    layer, program = seed_program
    rebuilt = CapturedProgram(program).load(as_state(layer))
    x = torch.randn(5, 3)
    out, res_1 = rebuilt(x)
    assert torch.allclose(out, layer.linear(x)) and torch.allclose(res_1, layer.linear(x))


def test_state_specs_of_a_linear(linear_program):
    assert CapturedProgram(linear_program).state_specs() == [
        StateSpec("layer.weight", (4, 3), torch.float32, True),
        StateSpec("layer.bias", (4,), torch.float32, True),
    ]


def test_state_specs_tell_buffers_from_parameters(batchnorm_program):
    assert CapturedProgram(batchnorm_program).state_specs() == [
        StateSpec("layer.weight", (3,), torch.float32, True),
        StateSpec("layer.bias", (3,), torch.float32, True),
        StateSpec("layer.running_mean", (3,), torch.float32, False),
        StateSpec("layer.running_var", (3,), torch.float32, False),
        StateSpec("layer.num_batches_tracked", (), torch.int64, False),
    ]


def test_state_specs_of_a_layer_without_weights(residual_program):
    assert CapturedProgram(residual_program).state_specs() == []


def test_input_specs_have_a_free_batch_dimension(linear_program):
    assert CapturedProgram(linear_program).input_specs() == [InputSpec(torch.float32, (None, 3))]


def test_input_specs_list_the_main_input_then_dependencies(residual_program):
    assert CapturedProgram(residual_program).input_specs() == [InputSpec(torch.float32, (None, 3))] * 2


def test_real_guards_are_accepted(residual_program):
    guards = json.loads(residual_program)["guards_code"]
    assert guards == ["L['x'].size()[0] == L['dependencies'][0].size()[0]"]
    CapturedProgram(residual_program)


# InputSpec.check

SPEC = InputSpec(torch.float32, (None, 3))


@pytest.mark.parametrize("shape", [(1, 3), (64, 3), (0, 3)])
def test_input_spec_accepts_any_batch_size(shape):
    SPEC.check(torch.zeros(shape), "stage 1 input")


@pytest.mark.parametrize(("tensor", "got"), [
    (torch.zeros(2, 4), "float32 of shape [2, 4]"),
    (torch.zeros(2, 3, dtype=torch.float64), "float64 of shape [2, 3]"),
    (torch.zeros(3), "float32 of shape [3]"),
    (torch.zeros(2, 3, 1), "float32 of shape [2, 3, 1]"),
    (torch.zeros(2, 3, dtype=torch.int64), "int64 of shape [2, 3]"),
])
def test_input_spec_names_what_was_expected_and_what_came(tensor, got):
    expected = r"stage 1 input: expected float32 of shape \['?batch'?, 3\], got " + re.escape(got)
    with pytest.raises(InvalidArgument, match=expected):
        SPEC.check(tensor, "stage 1 input")


def test_input_spec_with_fixed_sizes_checks_every_dimension():
    with pytest.raises(InvalidArgument, match=re.escape("expected float32 of shape [2, 3]")):
        InputSpec(torch.float32, (2, 3)).check(torch.zeros(4, 3), "x")


# Security: a program from the wire is untrusted; every string in it is checked before anything runs.

@pytest.fixture
def tree(linear_program) -> dict:
    return json.loads(linear_program)


def dumps(tree: dict) -> bytes:
    return json.dumps(tree).encode()


def first_node(tree: dict) -> dict:
    return tree["graph_module"]["graph"]["nodes"][0]


def refused(tree: dict, what: str):
    return pytest.raises(InvalidArgument, match=re.escape(what))


def test_untampered_program_passes_the_checks(tree):
    CapturedProgram(dumps(tree))


@pytest.mark.parametrize("target", [
    "torch.os.system",
    "os.system",
    "builtins.eval",
    "torch.ops.mylib.evil.default",
    "torch.ops.aten.linear.default; import os",
    "torch.ops.aten.linear",
])
def test_non_aten_operator_target_is_refused(tree, target):
    first_node(tree)["target"] = target
    with refused(tree, f"nodes[0].target = {target!r} is not allowed"):
        CapturedProgram(dumps(tree))


def test_aten_lookalike_target_is_refused_before_loading(tree):
    first_node(tree)["target"] = "torch.ops.aten.linear.__call__"  # passes the name check, is no operator
    with refused(tree, "'torch.ops.aten.linear.__call__', which is not an operator"):
        CapturedProgram(dumps(tree))


@pytest.mark.parametrize("guard", [
    "__import__('os').system('true') == 1",
    "L['x'].size()[0] == 2 or __import__('os')",
    "L['x'].__class__ == 1",
    "L['x'].size()[0]",
    "(12**L['x'].size()[0]) == 1",
    "(9*L['x'].size()[0]) == (9**9**9)",
])
def test_guard_with_code_is_refused(tree, guard):
    tree["guards_code"] = [guard]
    with refused(tree, f"guard {guard!r} is not a plain shape relation"):
        CapturedProgram(dumps(tree))


@pytest.mark.parametrize("guard", ["L['x'].size()[1] >= 2",
                                   "(12*L['x'].size()[0]) == (12*L['dependencies'][0].size()[0])",
                                   "((L['x'].size()[0]*L['x'].size()[1]) % L['x'].size()[0]) == 0",
                                   "L['x'].stride()[0] != 192", "Max(2, L['x'].size()[0] // 2) <= 64"])
def test_plain_shape_guard_is_accepted(tree, guard):
    tree["guards_code"] = [guard]
    CapturedProgram(dumps(tree))


def test_node_name_with_code_is_refused(tree):
    first_node(tree)["name"] = "x; import os"
    with refused(tree, "nodes[0].name = 'x; import os' is not allowed"):
        CapturedProgram(dumps(tree))


def test_argument_name_with_code_is_refused(tree):
    first_node(tree)["inputs"][0]["arg"]["as_tensor"]["name"] = "x)\nimport os\n("
    with refused(tree, "nodes[0].inputs[0].arg.as_tensor.name"):
        CapturedProgram(dumps(tree))


def test_parameter_name_with_code_is_refused(tree):
    tree["graph_module"]["signature"]["input_specs"][0]["parameter"]["parameter_name"] = "layer.weight'+x"
    with refused(tree, "parameter_name = \"layer.weight'+x\" is not allowed"):
        CapturedProgram(dumps(tree))


@pytest.mark.parametrize("expr", [
    "Symbol('s77').__class__",
    "__import__('os')",
    "Symbol('s77', evaluate=eval)",
    "eval('1')",
    "Pow(Integer(9), Pow(Integer(9), Integer(9)))",
    "Integer(9)**Integer(99999)",
])
def test_shape_expression_with_more_than_sympy_tokens_is_refused(tree, expr):
    tree["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0]["as_expr"]["expr_str"] = expr
    with refused(tree, "tensor_values.x.sizes[0].as_expr.expr_str"):
        CapturedProgram(dumps(tree))


def test_shape_expression_from_export_is_accepted(tree):
    expr = tree["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0]["as_expr"]["expr_str"]
    assert expr.startswith("Symbol(")
    tree["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0]["as_expr"]["expr_str"] = "2*" + expr + " + 1"
    CapturedProgram(dumps(tree))


def in_spec_of(tree: dict) -> dict:
    return tree["graph_module"]["module_call_graph"][0]["signature"]


@pytest.mark.parametrize("pytree_type", ["os.system", "torch.fx.immutable_collections.immutable_list",
                                         "builtins.eval", "collections.namedtuple"])
def test_in_spec_with_a_non_container_type_is_refused(tree, pytree_type):
    signature = in_spec_of(tree)
    protocol, root = json.loads(signature["in_spec"])
    root["type"] = pytree_type
    signature["in_spec"] = json.dumps([protocol, root])
    with refused(tree, "signature.in_spec"):
        CapturedProgram(dumps(tree))


def test_in_spec_with_code_in_a_dict_key_is_refused(tree):
    signature = in_spec_of(tree)
    protocol, root = json.loads(signature["in_spec"])
    root["children_spec"][1]["context"] = json.dumps(["x'); import os; ('"])
    root["children_spec"][1]["children_spec"] = [{"type": None, "context": None, "children_spec": []}]
    signature["in_spec"] = json.dumps([protocol, root])
    with refused(tree, "signature.in_spec"):
        CapturedProgram(dumps(tree))


def test_in_spec_that_is_not_json_is_refused(tree):
    in_spec_of(tree)["in_spec"] = "not json"
    with refused(tree, "signature.in_spec = 'not json'"):
        CapturedProgram(dumps(tree))


def test_label_strings_with_spaces_or_quotes_are_refused(tree):
    tree["verifiers"] = ["TRAINING'; import os"]
    with refused(tree, "program.verifiers[0]"):
        CapturedProgram(dumps(tree))


def test_metadata_is_dropped_rather_than_trusted(tree, linear):
    first_node(tree)["metadata"] = {"stack_trace": "anything; import os", "nn_module_stack": "'\"()"}
    program = CapturedProgram(dumps(tree))
    assert torch.equal(program.load(as_state(linear))(torch.ones(2, 3)), linear(torch.ones(2, 3)))


def test_invalid_json_is_refused():
    with pytest.raises(InvalidArgument, match="captured program is not valid JSON"):
        CapturedProgram(b"{not json")


@pytest.mark.parametrize("program", [b'{"opset_version": {}}', b"[1, 2]", b'"graph_module"'])
def test_json_without_graph_module_is_refused(program):
    with pytest.raises(InvalidArgument, match="captured program has no graph_module"):
        CapturedProgram(program)


# Malformed and hostile programs are InvalidArgument, never a bare exception or a hang.

def test_graph_module_without_graph_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        CapturedProgram(b'{"graph_module": {}}')


def test_program_not_fitting_the_schema_is_invalid_argument_on_load(tree, linear):
    tree["schema_version"] = "8.20"
    with pytest.raises(InvalidArgument):
        CapturedProgram(dumps(tree)).load(as_state(linear))


def test_deeply_nested_json_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        CapturedProgram(b"[" * 100_000 + b"]" * 100_000)


def test_shape_expression_with_an_exponent_tower_is_refused(tree):
    tree["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0]["as_expr"]["expr_str"] = "Integer(9)**9**9**9"
    with pytest.raises(InvalidArgument):
        CapturedProgram(dumps(tree))  # only the check: load() would hang


class MadeHere(torch.nn.Module):
    """Makes a tensor of its own (positions) on its input's device, as a GPT's forward does."""

    def forward(self, x):
        return x + torch.arange(x.shape[1], device=x.device)


def devices(layer: torch.nn.Module) -> list:
    return [node.kwargs["device"] for node in layer.graph.nodes if "device" in node.kwargs]


def test_tensors_a_layer_makes_are_made_on_the_stage_device():
    program = CapturedProgram(capture_layer(LayerAdapter(MadeHere()), (torch.zeros(2, 3),)))
    assert devices(program.load({})) == [torch.device("cpu")]
    assert devices(program.load({}, torch.device("meta"))) == [torch.device("meta")]
    assert torch.equal(program.load({}, torch.device("cpu"))(torch.zeros(2, 3)), torch.arange(3.0).expand(2, 3))


def test_a_program_loaded_again_is_built_once_around_each_loads_own_weights(linear, linear_program):
    program = CapturedProgram(linear_program)
    first, second = (program.load({key: torch.nn.Parameter(torch.full(shape, value)) for key, shape in
                                   (("layer.weight", (4, 3)), ("layer.bias", (4,)))}) for value in (1.0, 2.0))
    x = torch.ones(5, 3)
    assert torch.equal(first(x), torch.full((5, 4), 4.0)) and torch.equal(second(x), torch.full((5, 4), 8.0))


@pytest.mark.parametrize("weights, why", [
    ({"layer.weight": torch.nn.Parameter(torch.zeros(4, 3))}, r"expects weights \['layer.bias', 'layer.weight'\]"),
    ({"layer.weight": torch.nn.Parameter(torch.zeros(3, 4)), "layer.bias": torch.nn.Parameter(torch.zeros(4))},
     r"'layer.weight' should be a parameter of torch.float32 \[4, 3\], got Parameter of torch.float32 \[3, 4\]"),
    ({"layer.weight": torch.zeros(4, 3), "layer.bias": torch.nn.Parameter(torch.zeros(4))},
     r"'layer.weight' should be a parameter of .* got Tensor"),
])
def test_weights_that_do_not_fit_the_program_are_refused_naming_the_weight(linear_program, weights, why):
    with pytest.raises(InvalidArgument, match=why):
        CapturedProgram(linear_program).load(weights)


def test_the_serialized_dtype_table_is_torchs_serializer_own():
    """Reading a program's specs uses the table, so that the coordinator never loads torch's serializer."""
    from torch._export.serde import serialize

    from shardtrain.capture import SERIALIZED_DTYPES
    assert SERIALIZED_DTYPES == {int(key): dtype for key, dtype in serialize._SERIALIZE_TO_TORCH_DTYPE.items()}


def test_the_coordinator_and_a_shard_start_without_torchs_serializer_and_dynamo():
    """Importing torch's export serializer loads torch._dynamo, slow to import: the coordinator never needs it,
    a shard only once it builds a stage."""
    code = ("import sys, coordinator.server, shard_service.server; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._export.serde.serialize') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", f"starting the services loaded {loaded.stdout.strip()}"
