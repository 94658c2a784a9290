"""What a shipped program may call: a positive allow-list of pure tensor operators, checked against their schemas.

A captured layer runs on a shard with the shard's privileges, so its graph may only compute. Every node's
target must name an operator listed here; the operator's schema must take no storage, no file name and no
free-form string; and an operator that writes into a tensor may write only into the layer's own buffers or
into tensors the graph itself made, never into its inputs or parameters (a view of them counts as them).
Everything is checked on the serialized program, before the deserializer builds anything.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from shardtrain.errors import InvalidArgument

# aten operator packets (every overload of a packet is allowed, subject to the schema check). Grouped by
# what they do; nothing here reads or writes files, storages, the process, the RNG's seed or other ranks.
ALLOWED_ATEN = frozenset("""
    abs acos acosh asin asinh atan atan2 atanh ceil clamp clamp_max clamp_min clip copysign cos cosh digamma erf
    erfc erfinv exp exp2 expm1 floor frac hypot lerp lgamma log log10 log1p log2 logaddexp logit nan_to_num neg
    pow float_power reciprocal remainder fmod round rsqrt sgn sign signbit sin sinh sqrt square tan tanh trunc
    xlogy addcdiv addcmul fmax fmin maximum minimum isfinite isinf isnan igamma igammac polygamma mvlgamma i0 sinc
    deg2rad rad2deg special_erfcx special_i0e special_i1 special_i1e special_ndtr special_ndtri special_log_ndtr
    special_xlog1py special_zeta special_entr
    add sub rsub mul div true_divide floor_divide
    eq ne lt le gt ge logical_and logical_or logical_xor logical_not bitwise_and bitwise_or bitwise_xor bitwise_not
    where masked_fill masked_scatter masked_select
    sum mean prod amax amin aminmax max min argmax argmin any all std var std_mean var_mean logsumexp norm
    linalg_vector_norm cumsum cumprod cummax cummin logcumsumexp count_nonzero topk sort argsort median kthvalue
    mm bmm matmul addmm addbmm baddbmm addmv mv dot vdot outer linear bilinear einsum tensordot _cdist_forward
    cdist cosine_similarity pairwise_distance trace cross linalg_cross linalg_inv linalg_solve linalg_cholesky
    linalg_qr linalg_svd linalg_eigh linalg_det linalg_slogdet linalg_matrix_norm linalg_norm linalg_pinv
    linalg_solve_triangular
    relu relu6 gelu silu mish elu selu celu leaky_relu prelu _prelu_kernel rrelu hardtanh hardswish hardsigmoid
    softplus softshrink hardshrink log_sigmoid glu threshold sigmoid softmax _softmax log_softmax _log_softmax
    layer_norm native_layer_norm rms_norm batch_norm native_batch_norm _native_batch_norm_legit
    _native_batch_norm_legit_no_training _native_batch_norm_legit_functional group_norm native_group_norm
    instance_norm
    dropout native_dropout feature_dropout alpha_dropout feature_alpha_dropout bernoulli rand rand_like randn
    randn_like randint randint_like randperm normal multinomial
    conv1d conv2d conv3d convolution _convolution conv_transpose1d conv_transpose2d conv_transpose3d max_pool1d
    max_pool2d max_pool3d max_pool2d_with_indices max_pool3d_with_indices avg_pool1d avg_pool2d avg_pool3d
    adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d _adaptive_avg_pool2d _adaptive_avg_pool3d
    adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d pixel_shuffle pixel_unshuffle channel_shuffle
    upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_linear1d upsample_bilinear2d
    upsample_bicubic2d upsample_trilinear3d grid_sampler grid_sampler_2d affine_grid_generator im2col col2im
    pad constant_pad_nd reflection_pad1d reflection_pad2d reflection_pad3d replication_pad1d replication_pad2d
    replication_pad3d
    view reshape view_as reshape_as _unsafe_view permute transpose t mT numpy_T flatten unflatten unsqueeze
    squeeze expand expand_as broadcast_to broadcast_tensors contiguous clone alias detach lift_fresh_copy slice
    select narrow split split_with_sizes chunk tensor_split unbind cat concat concatenate stack hstack vstack flip
    roll rot90 repeat repeat_interleave tile tril triu diagonal diag diag_embed movedim swapaxes unfold index
    index_select gather scatter scatter_add scatter_reduce index_add index_copy index_fill index_put take
    take_along_dim slice_scatter select_scatter diagonal_scatter nonzero one_hot embedding embedding_bag
    _embedding_bag searchsorted bucketize view_as_real view_as_complex real imag
    zeros zeros_like ones ones_like full full_like new_zeros new_ones new_full arange linspace scalar_tensor eye
    _to_copy to type_as copy fill _local_scalar_dense
    mse_loss l1_loss smooth_l1_loss huber_loss cross_entropy_loss nll_loss nll_loss_nd nll_loss2d
    nll_loss_forward binary_cross_entropy binary_cross_entropy_with_logits kl_div soft_margin_loss
    margin_ranking_loss hinge_embedding_loss cosine_embedding_loss triplet_margin_loss poisson_nll_loss
    scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_efficient_attention
    _scaled_dot_product_flash_attention _scaled_dot_product_cudnn_attention
    lstm gru rnn_tanh rnn_relu lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    fft_fft fft_ifft fft_rfft fft_irfft _fft_r2c _fft_c2r _fft_c2c
    sym_size sym_numel sym_stride sym_is_contiguous _assert_scalar _assert_tensor_metadata
    sym_constrain_range sym_constrain_range_for_size _assert_async
    add_ sub_ mul_ div_ neg_ pow_ sqrt_ exp_ clamp_ clamp_min_ clamp_max_ relu_ hardtanh_ leaky_relu_ elu_ celu_
    selu_ silu_ mish_ sigmoid_ tanh_ hardswish_ hardsigmoid_ threshold_ fill_ zero_ copy_ masked_fill_
    index_put_ index_add_ index_copy_ index_fill_ scatter_ scatter_add_ uniform_ normal_ bernoulli_ dropout_
    feature_dropout_ alpha_dropout_ detach_
""".split())

# Python functions export writes for arithmetic on symbolic sizes (and getitem on multi-output operators).
ALLOWED_PYTHON = frozenset(f"_operator.{name}" for name in """
    getitem add sub mul floordiv truediv mod neg pos eq ne lt le gt ge and_ or_ not_
""".split())

# Refused by name even if listed above, with the reason the refusal gives.
_DENIED = ((re.compile(r"file|storage|save|load|print"), "reads or writes outside the computation"),
           (re.compile(r"seed|c10d|distributed|record_stream|share_memory|pin_memory"),
            "reaches the process, its random seed or other processes"),
           (re.compile(r"empty|resize|set_$|as_strided"),
            "returns uninitialized memory or re-points a storage (zeros, zeros_like or new_zeros compute the same)"))
# String arguments that pick a mode of a pure computation (or word its assertion); any other is refused.
_MODE_STRINGS = frozenset({"approximate", "reduce", "rounding_mode", "padding", "equation", "side",
                           "interpolation", "mode", "padding_mode", "indexing", "UPLO", "ord",
                           "assert_msg"})
# Operators whose schema does not mark the running statistics they update (they write them all the same).
_UNMARKED_WRITES = {name: ("running_mean", "running_var") for name in (
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "instance_norm")}
_TARGET = re.compile(r"torch\.ops\.aten\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)")

MAX_NODES = 50_000  # operator calls in one layer's graph


def refusal(packet: str, schema: torch.FunctionSchema | None) -> str | None:
    """Why an aten operator may not run in a shipped program, or None if it may."""
    for pattern, reason in _DENIED:
        if pattern.search(packet):
            return reason
    if packet not in ALLOWED_ATEN:
        return "is not on the allow-list of pure tensor operators"
    for argument in () if schema is None else (*schema.arguments, *schema.returns):
        kind = str(argument.type)
        if "Storage" in kind or "Stream" in kind:
            return f"takes a {kind} ({argument.name})"
        if kind.removesuffix("?") == "str" and argument.name not in _MODE_STRINGS:
            return f"takes a string argument {argument.name!r}"
    return None


def resolve(target: str) -> torch._ops.OpOverload | None:
    """The aten operator a serialized node target names (None for an allowed Python function).

    InvalidArgument for anything else: an unlisted operator, a refused schema, or a name torch does not know.
    """
    if target in ALLOWED_PYTHON:
        return None
    match = _TARGET.fullmatch(target)
    if match is None:
        raise InvalidArgument(f"captured program calls {target[:80]!r}; only aten operators from the allow-list "
                              f"and {sorted(ALLOWED_PYTHON)} may appear")
    packet, overload = match.groups()
    why = refusal(packet, None)
    if why is None:
        try:
            operator = getattr(getattr(torch.ops.aten, packet), overload)
        except (AttributeError, RuntimeError):
            raise InvalidArgument(f"captured program calls {target!r}, which this torch does not have") from None
        if not isinstance(operator, torch._ops.OpOverload):
            raise InvalidArgument(f"captured program calls {target!r}, which is not an operator")
        why = refusal(packet, operator._schema)
    if why is not None:
        raise InvalidArgument(f"captured program calls {target!r}, which {why}")
    return operator


def check_graph(graph_module: dict) -> None:
    """InvalidArgument unless every node calls an allowed operator and writes only to buffers or its own results."""
    nodes = graph_module["graph"]["nodes"]
    if len(nodes) > MAX_NODES:
        raise InvalidArgument(f"captured program has {len(nodes)} operator calls; at most {MAX_NODES} are allowed")
    origin = _input_origins(graph_module["signature"]["input_specs"])
    for node in nodes:
        operator = resolve(node["target"])
        arguments = {entry["name"]: entry["arg"] for entry in node["inputs"]}
        for name in _written_arguments(operator):
            for tensor in _tensor_names(arguments.get(name)):
                if origin.get(tensor, "result") not in ("buffer", "result"):
                    raise InvalidArgument(f"captured program: {node['target']} writes into {tensor!r}, "
                                          f"a {origin[tensor]}; operators may write only into buffers "
                                          f"and the graph's own results")
        aliased = _aliased_argument(operator, node)
        root = "result" if aliased is None else next(
            (origin.get(t, "result") for t in _tensor_names(arguments.get(aliased))), "result")
        for output in node["outputs"]:
            for tensor in _tensor_names(output):
                origin[tensor] = root


def _input_origins(input_specs: list[dict]) -> dict[str, str]:
    """Graph input name -> what it is: 'parameter', 'buffer', 'constant' or 'user input'."""
    kinds = {"parameter": "parameter", "buffer": "buffer", "user_input": "user input"}
    origins = {}
    for spec in input_specs:
        (kind, body), = spec.items()
        for tensor in _tensor_names(body.get("arg")):
            origins[tensor] = kinds.get(kind, "constant")
    return origins


def _written_arguments(operator: torch._ops.OpOverload | None) -> list[str]:
    if operator is None:
        return []
    written = [a.name for a in operator._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    return written + list(_UNMARKED_WRITES.get(operator._schema.name.removeprefix("aten::"), ()))


def _aliased_argument(operator: torch._ops.OpOverload | None, node: dict) -> str | None:
    """The argument whose memory the node's outputs share (a view or an in-place result), if any."""
    if operator is None:  # getitem shares its container's origin; arithmetic on sizes makes no tensors
        return node["inputs"][0]["name"] if node["target"] == "_operator.getitem" else None
    shared = set()
    for result in operator._schema.returns:
        if result.alias_info is not None:
            shared |= set(result.alias_info.before_set)
    for argument in operator._schema.arguments:
        if argument.alias_info is not None and shared & set(argument.alias_info.before_set):
            return argument.name
    return None


def _tensor_names(argument) -> Iterator[str]:
    """Names of the tensors a serialized argument refers to (as_tensor, as_tensors, optional ones)."""
    if isinstance(argument, dict):
        for key, value in argument.items():
            if key == "name" and isinstance(value, str):
                yield value
            elif key.startswith(("as_tensor", "as_optional_tensor", "arg")):
                yield from _tensor_names(value)
    elif isinstance(argument, list):
        for item in argument:
            yield from _tensor_names(item)
