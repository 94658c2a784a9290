"""Durable checkpoints without pickle: weights and optimizer state as safetensors files, the rest as JSON.

    model.save_checkpoint("runs/step-1000")   # a directory of safetensors files and checkpoint.json
    model.load_checkpoint("runs/step-1000")   # into any deployment of the same model, split any way

A checkpoint directory holds, for each of its parts (one per stage when the shards write it themselves, one
when the SDK gathers it), `model-<p>-of-<n>.safetensors` with the weights under their state-dict keys and
`optimizer-<p>-of-<n>.safetensors` with the optimizer's tensors under "<parameter key>/<state name>" and its
param groups and plain values as JSON in the file's metadata; then `checkpoint.json`, written last, names the
parts, the weights in the model's order and the parameters in torch.optim's order. Every reader picks the
tensors it needs by name from every part, so a checkpoint of one split loads into any other. The files follow
the safetensors format (an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the bytes), so other tools read them; nothing is executed when they are loaded, unlike a
pickle from torch.save. Checkpoints of the earlier layout (model.safetensors, optimizer.safetensors, torch's
indexes) still load through the SDK.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from collections.abc import Callable, Iterable

import torch

from shardtrain import optim
from shardtrain.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

FORMAT = "shardtrain-checkpoint-2"
FORMAT_1 = "shardtrain-checkpoint-1"  # model.safetensors and optimizer.safetensors, torch's indexes: read only
MODEL, OPTIMIZER, DESCRIPTION = "model.safetensors", "optimizer.safetensors", "checkpoint.json"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_TORCH = {name: dtype for dtype, name in _DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20
MAX_PARTS = 4096


def part_files(part: int, parts: int) -> tuple[str, str]:
    """The model and optimizer files of part `part` (from 0) of `parts`."""
    if not 0 <= part < parts <= MAX_PARTS:
        raise InvalidArgument(f"checkpoint part {part} of {parts}: a part is from 0 to parts - 1, and parts "
                              f"from 1 to {MAX_PARTS}")
    return f"model-{part:05d}-of-{parts:05d}.safetensors", f"optimizer-{part:05d}-of-{parts:05d}.safetensors"


def write_safetensors(path: pathlib.Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> int:
    """Writes `tensors` (and `metadata`, strings) to `path` in the safetensors format, through a temporary file
    renamed into place; returns the bytes written."""
    header, offset, payloads = ({"__metadata__": metadata} if metadata else {}), 0, []
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise InvalidArgument(f"checkpoint: tensor {name!r} has dtype {tensor.dtype}, which safetensors files "
                                  f"here do not hold ({sorted(str(d) for d in _DTYPES)})")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        payloads.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    temporary = path.with_name(path.name + ".partial")
    with open(temporary, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for data in payloads:
            out.write(data)
        out.flush()
        os.fsync(out.fileno())  # on disk before checkpoint.json can name it
    os.replace(temporary, path)
    return 8 + len(encoded) + offset


def read_safetensors(path: pathlib.Path, wanted: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (those whose name `wanted` accepts: only their bytes are read);
    DataLoss when its header and its bytes disagree."""
    return read_part(path, wanted)[0]


def read_part(path: pathlib.Path, wanted: Callable[[str], bool] | None = None, meta: bool = False
              ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the tensors `wanted` accepts, the file's metadata) of a safetensors file; with `meta`, tensors on the meta
    device: their dtypes and shapes, for a check, without reading their bytes."""
    try:
        out = open(path, "rb")
    except FileNotFoundError:
        raise NotFound(f"checkpoint: {path} is missing") from None
    with out:
        length = os.fstat(out.fileno()).st_size
        header, size = read_header(out, length, f"checkpoint: {path}")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise DataLoss(f"checkpoint: {path}'s __metadata__ is not a map of strings")
        tensors, data_length = {}, length - 8 - size
        for name, entry in header.items():
            dtype, shape, begin, end = tensor_entry(path, name, entry, data_length)
            if wanted is not None and not wanted(name):
                continue
            if meta:
                tensors[name] = torch.empty(shape, dtype=dtype, device="meta")
                continue
            out.seek(8 + size + begin)
            data = bytearray(end - begin)
            if out.readinto(data) != len(data):
                raise DataLoss(f"checkpoint: {path} ended inside tensor {name!r}")
            tensors[name] = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape) \
                if data else torch.zeros(shape, dtype=dtype)
    return tensors, metadata


def read_header(file, length: int, what: str) -> tuple[dict, int]:
    """(the JSON header, its size) of a safetensors file of `length` bytes, `file` open at its start; DataLoss
    naming `what` when it is not one."""
    raw = file.read(8)
    if len(raw) < 8:
        raise DataLoss(f"{what} is too short to be a safetensors file")
    size = struct.unpack_from("<Q", raw)[0]
    if size > min(MAX_HEADER_BYTES, length - 8):
        raise DataLoss(f"{what} says its header has {size} bytes; the file has {length}")
    try:
        header = json.loads(file.read(size))
    except ValueError as error:
        raise DataLoss(f"{what}: its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise DataLoss(f"{what}: its header is not a JSON object")
    return header, size


def tensor_entry(path, name: str, entry, data_length: int) -> tuple[torch.dtype, list[int], int, int]:
    """A header entry's (dtype, shape, begin, end), checked against the bytes the file has."""
    try:
        dtype, shape = _TORCH[entry["dtype"]], [int(d) for d in entry["shape"]]
        begin, end = (int(offset) for offset in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise DataLoss(f"checkpoint: {path}: tensor {name!r} has a malformed entry {str(entry)[:200]}") from None
    numel = 1
    for dim in shape:
        numel *= dim
    if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_length or \
            end - begin != numel * torch.empty(0, dtype=dtype).element_size():
        raise DataLoss(f"checkpoint: {path}: tensor {name!r} ({entry['dtype']}, {shape}) does not match its "
                       f"bytes [{begin}, {end}) of the {data_length} after the header")
    return dtype, shape, begin, end


def write_part(directory: pathlib.Path, part: int, parts: int, weights: dict[str, torch.Tensor],
               optimizer_state: optim.KeyedState) -> tuple[list[str], int]:
    """Writes one part of a checkpoint; (its files, the bytes written)."""
    model_file, optimizer_file = part_files(part, parts)
    written = write_safetensors(directory / model_file, weights)
    written += write_safetensors(directory / optimizer_file, optimizer_state.tensors,
                                 {"layout": optimizer_state.layout()})
    return [model_file, optimizer_file], written


def description(parts: int, weights: Iterable[str], parameters: Iterable[str], hyperparameters: str = "") -> str:
    """checkpoint.json's text for a checkpoint of `parts` parts; `hyperparameters` (JSON: each param group's
    settings, as the script's optimizer holds them) stand over those in the parts' optimizer files."""
    described = {"format": FORMAT, "parts": parts, "weights": list(weights), "parameters": list(parameters)}
    if hyperparameters:
        described["hyperparameters"] = json.loads(hyperparameters)
    return json.dumps(described, indent=1)


def write_description(directory: pathlib.Path, text: str) -> int:
    """Writes checkpoint.json, after checking it is one (a shard writes what the SDK sends)."""
    _checked_description(text, directory)
    temporary = directory / (DESCRIPTION + ".partial")
    with open(temporary, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, directory / DESCRIPTION)  # last: a checkpoint without it is incomplete
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)  # the renames too
    finally:
        os.close(handle)
    return len(text.encode())


def _checked_description(text: str, where) -> dict:
    try:
        described = json.loads(text)
    except ValueError as error:
        raise DataLoss(f"checkpoint: {where}'s {DESCRIPTION} is not JSON ({error})") from None
    if not isinstance(described, dict) or described.get("format") not in (FORMAT, FORMAT_1):
        raise InvalidArgument(f"checkpoint: {where} is not a {FORMAT} checkpoint (its {DESCRIPTION} says format "
                              f"{described.get('format') if isinstance(described, dict) else None!r})")
    if described["format"] == FORMAT:
        parts, weights, parameters = (described.get(k) for k in ("parts", "weights", "parameters"))
        if not isinstance(parts, int) or not 1 <= parts <= MAX_PARTS or \
                not all(isinstance(names, list) and all(isinstance(n, str) for n in names)
                        for names in (weights, parameters)):
            raise DataLoss(f"checkpoint: {where}'s {DESCRIPTION} needs parts (1 to {MAX_PARTS}), weights and "
                           "parameters (lists of keys)")
    return described


def read_description(directory: str | os.PathLike) -> dict:
    """checkpoint.json of a checkpoint directory; NotFound when there is none."""
    root = pathlib.Path(directory)
    if not (root / DESCRIPTION).is_file():
        raise NotFound(f"checkpoint: {root} holds no {DESCRIPTION} (not a checkpoint, or one not finished)")
    return _checked_description((root / DESCRIPTION).read_text(), root)


def readable_by_shards(directory: str | os.PathLike) -> bool:
    """False for a checkpoint of the earlier layout, which only the SDK reads (True when there is none here: the
    shards then say what they find)."""
    try:
        return read_description(directory)["format"] == FORMAT
    except NotFound:
        return True


def read_parts(directory: str | os.PathLike, weight_keys: Iterable[str] | None = None,
               parameter_keys: Iterable[str] | None = None, optimizer: bool = True, meta: bool = False
               ) -> tuple[dict, dict[str, torch.Tensor], optim.KeyedState, int]:
    """(the description, the weights, the optimizer state, the bytes read) of a checkpoint, limited to
    `weight_keys` and to the state of `parameter_keys` when they are given (a stage's share: only its tensors'
    bytes are read; with `meta`, none: see read_part). A weight tied across parts is read from the first that
    holds it."""
    root = pathlib.Path(directory)
    described = read_description(root)
    if described["format"] != FORMAT:
        raise FailedPrecondition(f"checkpoint: {root} has the earlier layout ({FORMAT_1}), which only the SDK "
                                 "reads: load it with model.load_checkpoint(path, on_shards=False)")
    weights_wanted = None if weight_keys is None else set(weight_keys)
    params_wanted = None if parameter_keys is None else set(parameter_keys)
    weights: dict[str, torch.Tensor] = {}
    states, read = [], 0

    def stored(tensors: dict[str, torch.Tensor]) -> int:
        return 0 if meta else sum(t.numel() * t.element_size() for t in tensors.values())
    for part in range(described["parts"]):
        model_file, optimizer_file = part_files(part, described["parts"])
        tensors, _ = read_part(root / model_file, lambda name: name not in weights and (
            weights_wanted is None or name in weights_wanted), meta)
        weights.update(tensors)
        read += stored(tensors)
        if not optimizer:
            continue
        tensors, metadata = read_part(root / optimizer_file, lambda name: params_wanted is None or
                                      name.rpartition("/")[0] in params_wanted, meta)
        read += stored(tensors)
        try:
            state = optim.KeyedState.parse(metadata.get("layout", ""), tensors)
        except InvalidArgument as error:
            raise DataLoss(f"checkpoint: {root / optimizer_file}: {error}") from None
        states.append(state if params_wanted is None else restricted(state, params_wanted))
    return described, weights, _overlaid(optim.merged(states), described.get("hyperparameters")), read


def _overlaid(state: optim.KeyedState, hyperparameters) -> optim.KeyedState:
    """`state` with its groups' settings replaced by the description's, where it has them for every group."""
    if not isinstance(hyperparameters, list) or len(hyperparameters) != len(state.groups) or \
            not all(isinstance(group, dict) for group in hyperparameters):
        return state
    groups = [{**group, **{k: v for k, v in settings.items() if k != "params"}, "params": group["params"]}
              for group, settings in zip(state.groups, hyperparameters)]
    return optim.KeyedState(groups, state.tensors, state.values)


def restricted(state: optim.KeyedState, keys: set[str]) -> optim.KeyedState:
    """The share of `state` that belongs to the parameters `keys`: every group (each with those of its params),
    when any of them is in it, as optim.split gives a stage."""
    named = {key for group in state.groups for key in group["params"]} | \
        {where.rpartition("/")[0] for where in [*state.tensors, *state.values]}
    return optim.split(state, {key: 0 if key in keys else 1 for key in named}, 2)[0]


def save(directory: str | os.PathLike, weights: dict[str, torch.Tensor], optimizer_state: optim.KeyedState,
         parameters: Iterable[str]) -> None:
    """Writes a checkpoint of one part: the weights in their order, the optimizer state, the parameters'
    torch.optim order."""
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    text = description(1, weights, parameters)
    write_part(root, 0, 1, weights, optimizer_state)
    write_description(root, text)


def load(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights in their saved order, the optimizer's torch state_dict) of a checkpoint, of either layout."""
    described = read_description(directory)
    if described["format"] == FORMAT_1:
        return _load_1(pathlib.Path(directory), described)
    _, weights, state, _ = read_parts(directory)
    try:
        ordered = {key: weights[key] for key in described["weights"] if key in weights}
        return ordered, optim.indexed(state, described["parameters"])
    except InvalidArgument as error:
        raise DataLoss(f"checkpoint: {directory}'s parts and description do not fit together ({error})") from None


def _load_1(root: pathlib.Path, description: dict) -> tuple[dict[str, torch.Tensor], dict]:
    stored = read_safetensors(root / MODEL)
    try:
        weights = {name: stored[name] for name in description["weights"] if name in stored}
        state: dict = {}
        for name, tensor in read_safetensors(root / OPTIMIZER).items():
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = tensor
        for index, entries in description["optimizer"]["numbers"].items():
            state.setdefault(int(index), {}).update(entries)
        groups = list(description["optimizer"]["param_groups"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise DataLoss(f"checkpoint: {root}'s description and tensors do not fit together ({error!r})") from None
    return weights, {"state": dict(sorted(state.items())), "param_groups": groups}


def under(root: str, directory: str) -> pathlib.Path:
    """`directory` (absolute, or relative to `root`) resolved, symbolic links included; PermissionDenied unless
    it lies under `root`, FailedPrecondition when there is no root."""
    if not root:
        raise FailedPrecondition("this shard writes and reads no checkpoints itself: start it with --checkpoint-dir "
                                 "(or SHARDTRAIN_CHECKPOINT_DIR), or let the SDK gather the checkpoint")
    if not directory or "\0" in directory or len(directory) > 4096:
        raise InvalidArgument("checkpoint directory: a path of 1 to 4096 characters is needed")
    base = os.path.realpath(root)
    target = os.path.realpath(os.path.join(base, directory))
    if os.path.commonpath([base, target]) != base:
        raise PermissionDenied(f"checkpoint directory {directory[:200]!r} is outside this shard's --checkpoint-dir "
                               f"{root}")
    return pathlib.Path(target)
