"""A shipped program may only compute: the operator rule over names, schemas and tags, and the write rule."""

from __future__ import annotations

import json
import re
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch._export.serde import serialize as export_serde

from shardtrain import capture, operators
from shardtrain.capture import MAX_PROGRAM_BYTES, MAX_STRING, CapturedProgram, LayerAdapter, capture_layer
from shardtrain.errors import InvalidArgument


def program_of(module: nn.Module, *example: torch.Tensor) -> bytes:
    return capture_layer(LayerAdapter(module), example)


def tree_of(module: nn.Module, *example: torch.Tensor) -> dict:
    return json.loads(program_of(module, *example))


def dumps(tree: dict) -> bytes:
    return json.dumps(tree).encode()


def nodes(tree: dict) -> list[dict]:
    return tree["graph_module"]["graph"]["nodes"]


def node_calling(tree: dict, target: str) -> dict:
    return next(node for node in nodes(tree) if node["target"] == target)


def aten_operators():
    """Every aten operator overload in this torch's registry, with its packet name."""
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = qualified.partition("::")
        packet, _, overload = rest.partition(".")
        if namespace == "aten" and hasattr(torch.ops.aten, packet):
            operator = getattr(getattr(torch.ops.aten, packet), overload or "default", None)
            if isinstance(operator, torch._ops.OpOverload):
                yield packet, overload or "default", operator


def touches_the_host(packet: str, schema) -> bool:
    """Operators that name a file, take a storage or stream, print, or re-point or resize a tensor's memory."""
    if re.search(r"file|storage|print|save|load|resize|^set_?$", packet):
        return True
    return any("Storage" in str(a.type) or "Stream" in str(a.type) or
               (str(a.type).removesuffix("?") == "str" and a.name in ("filename", "path", "file", "s"))
               for a in (*schema.arguments, *schema.returns))


def test_every_vetted_internal_operator_exists_in_torch_and_is_admitted():
    for packet in operators.VETTED_INTERNALS:
        for overload in getattr(torch.ops.aten, packet).overloads():
            operator = getattr(getattr(torch.ops.aten, packet), overload)
            assert operators.refusal(packet, operator._schema, operator.tags) is None, (packet, overload)


@pytest.mark.parametrize("target", [
    "torch.ops.aten.__and__.Tensor", "torch.ops.aten.diff.default", "torch.ops.aten.scaled_dot_product_attention."
    "default", "torch.ops.aten.batch_norm.default", "torch.ops.aten.layer_norm.default", "torch.ops.aten.relu_.default",
    "torch.ops.aten.cross_entropy_loss.default", "torch.ops.aten.lu_unpack.default", "torch.ops.aten.bernoulli.p",
    "torch.ops.aten.pad.default", "torch.ops.aten.bitwise_left_shift.Tensor", "torch.ops.aten.searchsorted.Tensor"])
def test_public_operators_that_compute_on_their_tensors_are_admitted_without_a_list(target):
    assert operators.resolve(target) is not None


@pytest.mark.parametrize("packet", ["_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
                                    "native_batch_norm", "_native_batch_norm_legit_functional", "native_layer_norm",
                                    "_embedding_bag", "_scaled_dot_product_flash_attention_for_cpu"])
def test_internal_operators_are_refused_naming_their_public_form(packet):
    with pytest.raises(InvalidArgument, match="internal operator .*public form"):
        operators.resolve(f"torch.ops.aten.{packet}.default")


@pytest.mark.parametrize("target, reason", [
    ("torch.ops.aten.squeeze_.default", "shape or strides in place"),
    ("torch.ops.aten.sparse_coo_tensor.indices", "sparse"),
    ("torch.ops.aten.quantize_per_tensor.default", "quantized"),
    ("torch.ops.aten.mkldnn_convolution.default", "backend kernel"),
    ("torch.ops.aten.manual_seed.default", "random seed"),
    ("torch.ops.aten.set_.source_Tensor", "re-points"),
    ("torch.ops.aten.normal.Tensor_float", None),
])
def test_families_the_rule_refuses_say_why(target, reason):
    try:
        operators.resolve(target)
    except InvalidArgument as error:
        assert reason is not None and reason in str(error), error
    else:
        assert reason is None, f"{target} was admitted"


def test_every_operator_of_the_registry_that_touches_files_storages_or_output_is_refused():
    host_reaching = [(p, o, op) for p, o, op in aten_operators() if touches_the_host(p, op._schema)]
    assert {"from_file", "_print", "set_", "record_stream", "resize_"} <= {p for p, _, _ in host_reaching}
    for packet, overload, _ in host_reaching:
        with pytest.raises(InvalidArgument, match="captured program calls"):
            operators.resolve(f"torch.ops.aten.{packet}.{overload}")


def test_operators_of_every_other_namespace_in_the_registry_are_refused():
    namespaces = {name.partition("::")[0] for name in torch._C._dispatch_get_all_op_names()} - {"aten"}
    assert {"c10d", "_c10d_functional", "prims"} <= namespaces
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = qualified.partition("::")
        if namespace != "aten":
            target = f"torch.ops.{namespace}.{rest.partition('.')[0]}.{rest.partition('.')[2] or 'default'}"
            with pytest.raises(InvalidArgument, match="only aten operators"):
                operators.resolve(target)


def test_from_file_is_refused_by_name_and_by_schema_even_without_the_name_rule(monkeypatch):
    schema = torch.ops.aten.from_file.default._schema
    assert "outside the computation" in operators.refusal("from_file", schema)
    monkeypatch.setattr(operators, "DENIED", ())
    assert operators.refusal("from_file", schema) == "takes a string argument 'filename'"


def test_uninitialized_memory_is_refused_with_what_to_use_instead():
    with pytest.raises(InvalidArgument, match="uninitialized memory .*zeros_like"):
        operators.resolve("torch.ops.aten.empty_like.default")


def test_unknown_operators_are_refused():
    with pytest.raises(InvalidArgument, match="does not have"):
        operators.resolve("torch.ops.aten.linear.no_such_overload")
    with pytest.raises(InvalidArgument, match="only aten operators"):
        operators.resolve("builtins.eval")


class Zoo(nn.Module):
    """Layers users build models from: convolutions, norms, attention, recurrences, in-place activations."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.block = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.1)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        features = self.conv(x).reshape(x.shape[0], 1, 16)
        out, _ = self.gru(self.block(features.repeat(1, 3, 1)))
        return nn.functional.gelu(self.norm(out)).mean(1)


@pytest.mark.filterwarnings("ignore:The tensor attributes")  # export's note on nn.GRU's flat weights
def test_common_layers_pass_the_checks_and_rebuild_to_the_same_function():
    torch.manual_seed(0)
    zoo = Zoo().eval()
    rebuilt = CapturedProgram(program_of(zoo, torch.randn(2, 3, 8, 8))).load(
        {f"layer.{k}": v for k, v in zoo.state_dict(keep_vars=True).items()})
    x = torch.randn(5, 3, 8, 8)
    assert torch.allclose(rebuilt(x), zoo(x), atol=1e-6)


class Tracked(nn.Module):
    """BatchNorm (writes its running statistics and counter) followed by an in-place ReLU on its result."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return torch.relu_(self.norm(x))


@pytest.fixture
def tracked() -> dict:
    return tree_of(Tracked(), torch.randn(3, 4))


def test_writes_into_buffers_and_into_the_graphs_own_results_are_allowed(tracked):
    CapturedProgram(dumps(tracked))


def test_an_in_place_write_into_the_user_input_is_refused(tracked):
    node_calling(tracked, "torch.ops.aten.relu_.default")["inputs"][0]["arg"] = {"as_tensor": {"name": "x"}}
    with pytest.raises(InvalidArgument, match=r"relu_.default writes into 'x', a user input"):
        CapturedProgram(dumps(tracked))


def test_an_in_place_write_into_a_parameter_is_refused(tracked):
    counter = node_calling(tracked, "torch.ops.aten.add_.Tensor")
    counter["inputs"][0]["arg"] = {"as_tensor": {"name": "p_layer_norm_weight"}}
    with pytest.raises(InvalidArgument, match="writes into 'p_layer_norm_weight', a parameter"):
        CapturedProgram(dumps(tracked))


def test_running_statistics_must_be_buffers_even_though_the_schema_does_not_say_batch_norm_writes_them(tracked):
    batch_norm = node_calling(tracked, "torch.ops.aten.batch_norm.default")
    running_mean = next(entry for entry in batch_norm["inputs"] if entry["name"] == "running_mean")
    running_mean["arg"] = {"as_tensor": {"name": "p_layer_norm_bias"}}
    with pytest.raises(InvalidArgument, match="writes into 'p_layer_norm_bias', a parameter"):
        CapturedProgram(dumps(tracked))


class WritesThroughAView(nn.Module):
    def forward(self, x):
        x.view(-1).add_(1)
        return x * 2


def test_an_in_place_write_through_a_view_of_the_input_is_refused():
    with pytest.raises(InvalidArgument, match="add_.Tensor writes into 'view', a user input"):
        CapturedProgram(program_of(WritesThroughAView(), torch.randn(3, 4)))


class SizeArithmetic(nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0] * 2, -1) + x.shape[0]


def test_arithmetic_on_symbolic_sizes_is_allowed():
    rebuilt = CapturedProgram(program_of(SizeArithmetic(), torch.randn(4, 4))).load({})
    assert rebuilt(torch.ones(3, 4)).shape == (6, 2)


def stealing_program(path: str, shared: bool) -> dict:
    """A real layer's program whose ones() became from_file(path): what a hostile client would send."""
    class Counts(nn.Module):
        def forward(self, x):
            return x + torch.ones(7, dtype=torch.uint8).float().sum()

    tree = tree_of(Counts(), torch.randn(2, 3))
    node = node_calling(tree, "torch.ops.aten.ones.default")
    node["target"] = "torch.ops.aten.from_file.default"
    node["inputs"] = [{"name": "filename", "arg": {"as_string": path}, "kind": 1},
                      {"name": "shared", "arg": {"as_bool": shared}, "kind": 1},
                      {"name": "size", "arg": {"as_int": 7}, "kind": 1},
                      {"name": "dtype", "arg": {"as_scalar_type": 1}, "kind": 2}]
    return tree


@pytest.mark.parametrize("shared", [False, True])
def test_a_program_that_reads_a_file_is_refused_before_anything_is_built(tmp_path, shared):
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET!")
    with pytest.raises(InvalidArgument, match=r"from_file.default'?, which reads or writes outside"):
        CapturedProgram(dumps(stealing_program(str(secret), shared)))
    assert secret.read_bytes() == b"SECRET!"


def test_a_graph_with_too_many_operator_calls_is_refused(tracked, monkeypatch):
    monkeypatch.setattr(operators, "MAX_NODES", 2)
    with pytest.raises(InvalidArgument, match=r"has 3 operator calls; at most 2"):
        CapturedProgram(dumps(tracked))


def test_an_overlong_string_is_refused(tracked):
    nodes(tracked)[0]["inputs"][0]["arg"] = {"as_string": "a" * (MAX_STRING + 1)}
    with pytest.raises(InvalidArgument, match=f"string of {MAX_STRING + 1} characters"):
        CapturedProgram(dumps(tracked))


def test_an_integer_beyond_64_bits_is_refused(tracked):
    node_calling(tracked, "torch.ops.aten.add_.Tensor")["inputs"][1]["arg"] = {"as_int": 1 << 70}
    with pytest.raises(InvalidArgument, match="does not fit in 64 bits"):
        CapturedProgram(dumps(tracked))


def test_an_oversized_program_is_refused_unread():
    with pytest.raises(InvalidArgument, match=f"at most {MAX_PROGRAM_BYTES} are allowed"):
        CapturedProgram(b" " * (MAX_PROGRAM_BYTES + 1))


def test_the_built_graph_is_checked_again(monkeypatch):
    """Should the deserializer ever build a call the serialized names did not show, the second look refuses it."""
    program = program_of(SizeArithmetic(), torch.randn(4, 4))
    loaded = CapturedProgram(program)
    monkeypatch.setattr(capture, "_BUILT", OrderedDict())  # built and checked by an earlier test: built again
    monkeypatch.setattr(operators, "ALLOWED_PYTHON", frozenset({"_operator.getitem"}))
    with pytest.raises(InvalidArgument, match="_operator.mul|built-in function mul"):
        loaded.load({})


def test_export_names_python_size_arithmetic_as_the_allow_list_spells_it():
    tree = json.loads(export_serde.serialize(torch.export.export(
        SizeArithmetic(), (torch.randn(4, 4),), dynamic_shapes={"x": {0: torch.export.Dim("b")}})).exported_program)
    targets = {node["target"] for node in nodes(tree)}
    assert "_operator.mul" in targets and targets - {"_operator.mul"} <= {
        f"torch.ops.aten.{name}" for name in ("sym_size.int", "reshape.default", "add.Tensor")}


class Branches(nn.Module):
    """torch.cond on a tensor predicate: export writes higher_order.cond with two branch graphs."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda v: torch.relu(self.linear(v)), lambda v: v * 2, (x,))


class NoGradRegion(nn.Module):
    """A statistic computed under torch.no_grad(): export writes higher_order.wrap_with_set_grad_enabled."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            scale = x.abs().sum() + 1
        return self.linear(x) / scale


class AutocastRegion(nn.Module):
    """A product under torch.autocast: export writes higher_order.wrap_with_autocast."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.linear(x)
        return y.float() + x


HIGHER_ORDER_LAYERS = {"cond": Branches, "wrap_with_set_grad_enabled": NoGradRegion,
                       "wrap_with_autocast": AutocastRegion}


def higher_order_tree(name: str) -> tuple[nn.Module, dict, dict]:
    """A layer calling the higher-order operator `name`, its program, and the node calling it."""
    torch.manual_seed(0)
    module = HIGHER_ORDER_LAYERS[name]()
    tree = tree_of(module, torch.randn(3, 4))
    return module, tree, node_calling(tree, f"torch.ops.higher_order.{name}")


def first_graph(node: dict) -> dict:
    return operators.subgraphs(node)[0]["graph"]


@pytest.mark.parametrize("name", sorted(HIGHER_ORDER_LAYERS))
def test_admitted_higher_order_operators_pass_and_rebuild_to_the_same_function(name):
    module, tree, _ = higher_order_tree(name)
    state = {f"layer.{key}": value for key, value in module.state_dict(keep_vars=True).items()}
    rebuilt = CapturedProgram(dumps(tree)).load(state)
    for x in (torch.randn(5, 4), -torch.rand(2, 4)):  # both of a cond's branches
        assert torch.equal(rebuilt(x), module(x))


@pytest.mark.parametrize("name", sorted(HIGHER_ORDER_LAYERS))
def test_a_refused_operator_inside_a_higher_order_operators_graph_is_refused_naming_it(name):
    _, tree, node = higher_order_tree(name)
    inner = next(n for n in first_graph(node)["nodes"] if n["target"].startswith("torch.ops.aten."))
    inner["target"] = "torch.ops.aten._print.default"
    with pytest.raises(InvalidArgument, match=rf"_print.default'?, which reads or writes outside .*\(in graph "
                                              rf"'\w+' of torch.ops.higher_order.{name}\)"):
        CapturedProgram(dumps(tree))


def test_an_in_place_write_inside_a_branch_into_a_parameter_passed_in_is_refused():
    _, tree, node = higher_order_tree("cond")
    branch = first_graph(node)
    weight = next(v["as_tensor"]["name"] for v in branch["inputs"] if "weight" in v["as_tensor"]["name"])
    relu = next(n for n in branch["nodes"] if n["target"] == "torch.ops.aten.relu.default")
    relu["target"] = "torch.ops.aten.relu_.default"
    relu["inputs"][0]["arg"] = {"as_tensor": {"name": weight}}
    with pytest.raises(InvalidArgument, match=rf"relu_.default writes into '{weight}', a parameter"):
        CapturedProgram(dumps(tree))


def test_the_node_limit_counts_the_nodes_inside_higher_order_operators(monkeypatch):
    _, tree, node = higher_order_tree("cond")
    inside = sum(len(graph["graph"]["nodes"]) for graph in operators.subgraphs(node))
    monkeypatch.setattr(operators, "MAX_NODES", len(nodes(tree)) + inside - 1)
    with pytest.raises(InvalidArgument, match=rf"has {len(nodes(tree)) + inside} operator calls"):
        CapturedProgram(dumps(tree))


@pytest.mark.parametrize("name, reason", [
    ("while_loop", "data-dependent number of times"),
    ("run_with_rng_state", "random generator's state"),
    ("triton_kernel_wrapper_functional", "kernel given as source code"),
    ("auto_functionalized", "custom operator"),
    ("flex_attention", "kernel options"),
    ("map_impl", "not one of the higher-order operators the rule admits"),
])
def test_other_higher_order_operators_are_refused_saying_why(name, reason):
    _, tree, node = higher_order_tree("cond")
    node["target"] = f"torch.ops.higher_order.{name}"
    with pytest.raises(InvalidArgument, match=reason):
        CapturedProgram(dumps(tree))


def test_autocast_on_an_unknown_device_type_is_refused():
    _, tree, node = higher_order_tree("wrap_with_autocast")
    node["inputs"][0]["arg"] = {"as_string": "meta"}
    with pytest.raises(InvalidArgument, match=r"device type 'meta'; expected one of \['cpu', 'cuda'\]"):
        CapturedProgram(dumps(tree))


def test_a_higher_order_operator_given_a_string_operand_is_refused():
    _, tree, node = higher_order_tree("wrap_with_set_grad_enabled")
    node["inputs"].append({"name": "", "arg": {"as_string": "x"}, "kind": 1})
    with pytest.raises(InvalidArgument, match="passes a as_string operand"):
        CapturedProgram(dumps(tree))


def test_a_branch_result_declared_with_the_wrong_shape_is_refused_when_loaded():
    module, tree, node = higher_order_tree("cond")
    result = node["outputs"][0]["as_tensor"]["name"]
    tree["graph_module"]["graph"]["tensor_values"][result]["sizes"][1] = {"as_int": 5}
    with pytest.raises(InvalidArgument, match=r"computes float32 \[s\d+, 4\] where the program declares"):
        CapturedProgram(dumps(tree)).load({f"layer.{k}": v for k, v in module.state_dict(keep_vars=True).items()})
