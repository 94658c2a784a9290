"""Durable checkpoints without pickle: weights and optimizer state as safetensors files, the rest as JSON.

    model.save_checkpoint("runs/step-1000")   # a directory: model.safetensors, optimizer.safetensors, checkpoint.json
    model.load_checkpoint("runs/step-1000")   # into any deployment of the same model, split any way

The tensor files follow the safetensors format (an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and byte range, then the bytes), so other tools read them; nothing in a checkpoint
is executed when it is loaded, unlike a pickle from torch.save.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct

import torch

from shardtrain.errors import DataLoss, InvalidArgument, NotFound

FORMAT = "shardtrain-checkpoint-1"
MODEL, OPTIMIZER, DESCRIPTION = "model.safetensors", "optimizer.safetensors", "checkpoint.json"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_TORCH = {name: dtype for dtype, name in _DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20


def write_safetensors(path: pathlib.Path, tensors: dict[str, torch.Tensor]) -> None:
    """Writes `tensors` to `path` in the safetensors format, through a temporary file renamed into place."""
    header, offset, payloads = {}, 0, []
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
    os.replace(temporary, path)


def read_safetensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; DataLoss when its header and its bytes disagree."""
    raw = path.read_bytes()
    if len(raw) < 8:
        raise DataLoss(f"checkpoint: {path} is too short to be a safetensors file")
    size = struct.unpack_from("<Q", raw)[0]
    if size > min(MAX_HEADER_BYTES, len(raw) - 8):
        raise DataLoss(f"checkpoint: {path} says its header has {size} bytes; the file has {len(raw)}")
    try:
        header = json.loads(raw[8:8 + size])
    except ValueError as error:
        raise DataLoss(f"checkpoint: {path}'s header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise DataLoss(f"checkpoint: {path}'s header is not a JSON object")
    data = memoryview(raw)[8 + size:]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = _TORCH[entry["dtype"]], [int(d) for d in entry["shape"]]
            begin, end = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise DataLoss(f"checkpoint: {path}: tensor {name!r} has a malformed entry {entry!r}") from None
        numel = 1
        for dim in shape:
            numel *= dim
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(data) or \
                end - begin != numel * torch.empty(0, dtype=dtype).element_size():
            raise DataLoss(f"checkpoint: {path}: tensor {name!r} ({entry['dtype']}, {shape}) does not match its "
                           f"bytes [{begin}, {end}) of the {len(data)} after the header")
        tensors[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.uint8).view(dtype).reshape(shape) \
            if end > begin else torch.zeros(shape, dtype=dtype)
    return tensors


def save(directory: str | os.PathLike, weights: dict[str, torch.Tensor], optimizer_state: dict) -> None:
    """Writes a checkpoint: the weights, the optimizer's tensors, and its numbers and param groups as JSON."""
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tensors, numbers = {}, {}
    for index, entries in optimizer_state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value
            else:
                numbers.setdefault(str(index), {})[name] = value
    description = {"format": FORMAT, "weights": list(weights), "optimizer": {
        "param_groups": optimizer_state["param_groups"], "numbers": numbers}}
    try:
        encoded = json.dumps(description, indent=1)
    except TypeError as error:
        raise InvalidArgument(f"checkpoint: the optimizer's param groups hold a value JSON cannot hold ({error})") \
            from None
    write_safetensors(root / MODEL, weights)
    write_safetensors(root / OPTIMIZER, tensors)
    temporary = root / (DESCRIPTION + ".partial")
    temporary.write_text(encoded)
    os.replace(temporary, root / DESCRIPTION)  # last: a checkpoint without it is incomplete


def load(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights in their saved order, the optimizer's state_dict) of a checkpoint written by save()."""
    root = pathlib.Path(directory)
    if not (root / DESCRIPTION).is_file():
        raise NotFound(f"checkpoint: {root} holds no {DESCRIPTION} (not a checkpoint, or one not finished)")
    try:
        description = json.loads((root / DESCRIPTION).read_text())
    except ValueError as error:
        raise DataLoss(f"checkpoint: {root / DESCRIPTION} is not JSON ({error})") from None
    if not isinstance(description, dict) or description.get("format") != FORMAT:
        raise InvalidArgument(f"checkpoint: {root} is not a {FORMAT} checkpoint")
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
