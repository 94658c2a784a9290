"""Durable checkpoints without pickle: weights and optimizer state as safetensors files, the rest as JSON.

    model.save_checkpoint("runs/step-1000")   # a directory of safetensors files and checkpoint.json
    model.load_checkpoint("runs/step-1000")   # into any deployment of the same model, split any way

A save writes, for each of its parts (one per stage when the shards write it themselves, one when the SDK
gathers it), `model-<p>-of-<n>.safetensors` with the weights under their state-dict keys and
`optimizer-<p>-of-<n>.safetensors` with the optimizer's tensors under "<parameter key>/<state name>" and its
param groups and plain values as JSON in the file's metadata, into `generation-<g>/`, a directory of that save
alone (checkpoint_store.py); every file's metadata names the generation and the optimizer step. Then one rename
publishes `checkpoint.json`, which names the generation, the step, the parts, the weights in the model's order
and the parameters in torch.optim's order. A reader refuses parts of another generation or step, naming the
stage, and a directory where a later save did not finish. Every reader picks the tensors it needs by name from
every part, so a checkpoint of one split loads into any other. The files are safetensors files, written and
read by that library (tensor_files.py), so other tools read them; nothing is executed when they are loaded,
unlike a pickle from torch.save.
Checkpoints of the earlier layouts (parts beside checkpoint.json; model.safetensors and optimizer.safetensors
with torch's indexes, through the SDK only) still load.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Callable, Iterable

import torch

from shardtrain import checkpoint_store as store
from shardtrain import optim, tensor_files
from shardtrain.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

FORMAT = "shardtrain-checkpoint-3"
FORMAT_2 = "shardtrain-checkpoint-2"  # the parts beside checkpoint.json, no generation: read only
FORMAT_1 = "shardtrain-checkpoint-1"  # model.safetensors and optimizer.safetensors, torch's indexes: read only
MODEL, OPTIMIZER, DESCRIPTION = "model.safetensors", "optimizer.safetensors", "checkpoint.json"
MAX_PARTS = 4096


def part_files(part: int, parts: int) -> tuple[str, str]:
    """The model and optimizer files of part `part` (from 0) of `parts`."""
    if not 0 <= part < parts <= MAX_PARTS:
        raise InvalidArgument(f"checkpoint part {part} of {parts}: a part is from 0 to parts - 1, and parts "
                              f"from 1 to {MAX_PARTS}")
    return f"model-{part:05d}-of-{parts:05d}.safetensors", f"optimizer-{part:05d}-of-{parts:05d}.safetensors"


def write_safetensors(path: pathlib.Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None, access: store.Access = store.PRIVATE) -> int:
    """Writes `tensors` (and `metadata`, strings) to `path` as a safetensors file, renamed into place once whole,
    readable as `access` says; returns the bytes written."""
    try:
        return tensor_files.write(path, tensors, metadata, access)
    except InvalidArgument as error:
        raise InvalidArgument(f"checkpoint: {error}") from None


def read_safetensors(path: pathlib.Path, wanted: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (those whose name `wanted` accepts: only their bytes are read);
    DataLoss when its header and its bytes disagree."""
    return read_part(path, wanted)[0]


def read_part(path: pathlib.Path, wanted: Callable[[str], bool] | None = None, meta: bool = False
              ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the tensors `wanted` accepts, the file's metadata) of a safetensors file; with `meta`, tensors on the meta
    device: their dtypes and shapes, for a check, without reading their bytes."""
    return tensor_files.read(path, wanted, meta)


def _stamp(generation: str, step: int | None) -> dict[str, str]:
    """The metadata every file of a part carries: which save, and at which optimizer step."""
    return {"generation": generation, **({"step": str(step)} if step is not None else {})}


def write_part(directory: pathlib.Path, generation: str, part: int, parts: int, weights: dict[str, torch.Tensor],
               optimizer_state: optim.KeyedState, step: int | None,
               access: store.Access = store.PRIVATE) -> tuple[list[str], int]:
    """Writes one part of save `generation` (the stage's weights and optimizer state after optimizer step
    `step`); (its files, relative to `directory`, the bytes written). On a failure nothing of the part is left,
    and an OS error becomes the status that says what to do (checkpoint_store.storage_error)."""
    folder = store.generation_directory(directory, generation)
    model_file, optimizer_file = part_files(part, parts)
    stamp, target = _stamp(generation, step), folder
    try:
        store.make_directory(folder, access)
        target = folder / model_file
        written = write_safetensors(target, weights, stamp, access)
        target = folder / optimizer_file
        written += write_safetensors(target, optimizer_state.tensors, {"layout": optimizer_state.layout(), **stamp},
                                     access)
        store.sync_directory(folder)
    except BaseException as error:
        discard_part(directory, generation, part, parts, access)
        if isinstance(error, OSError):
            raise store.storage_error(error, target) from None
        raise
    return [f"{folder.name}/{model_file}", f"{folder.name}/{optimizer_file}"], written


def discard_part(directory: pathlib.Path, generation: str, part: int, parts: int,
                 access: store.Access = store.PRIVATE) -> None:
    """Removes what save `generation` wrote of a part, keeping the generation's directory (made if missing): it
    tells readers that the save did not finish."""
    folder = store.generation_directory(directory, generation)
    with contextlib.suppress(OSError):
        store.make_directory(folder, access)
    store.remove(*(folder / (name + suffix) for name in part_files(part, parts) for suffix in ("", ".partial")))


def description(parts: int, weights: Iterable[str], parameters: Iterable[str], hyperparameters: str = "",
                generation: str = "", step: int | None = None) -> str:
    """checkpoint.json's text for save `generation` of `parts` parts, at optimizer step `step` (None: unknown);
    `hyperparameters` (JSON: each param group's settings, as the script's optimizer holds them) stand over those
    in the parts' optimizer files."""
    described = {"format": FORMAT, "generation": store.check_generation(generation), "parts": parts,
                 "weights": list(weights), "parameters": list(parameters)}
    if step is not None:
        described["step"] = step
    if hyperparameters:
        described["hyperparameters"] = json.loads(hyperparameters)
    return json.dumps(described, indent=1)


def publish(directory: pathlib.Path, generation: str, text: str, access: store.Access = store.PRIVATE) -> int:
    """Publishes save `generation` with one rename of checkpoint.json (`text`, checked first: a shard writes what
    the SDK sends), once every part is there and of that save; then removes the generations it replaces.
    Returns the bytes written."""
    described = _checked_description(text, directory)
    if described["format"] != FORMAT or described["generation"] != generation:
        raise InvalidArgument(f"checkpoint: a {DESCRIPTION} to publish is a {FORMAT} one naming generation "
                              f"{generation!r}; this one is {described['format']} of {described.get('generation')!r}")
    folder = store.generation_directory(directory, generation)
    for part in range(described["parts"]):  # every part there and of this save (their headers only)
        for file in part_files(part, described["parts"]):
            _check_stamp(directory, described, part, file, read_part(folder / file, lambda _: False, meta=True)[1])
    temporary = directory / (DESCRIPTION + ".partial")
    try:
        with store.new_file(temporary, access) as out:
            out.write(text.encode())
        os.replace(temporary, directory / DESCRIPTION)  # the one step that replaces the checkpoint
    except OSError as error:
        store.remove(temporary)
        raise store.storage_error(error, temporary) from None
    try:  # published: from here on nothing may fail the save, or its parts would be discarded under it
        store.sync_directory(directory)
    except OSError as error:
        store.log.warning("checkpoint %s is published, but syncing its directory failed (%s): a crash of this host "
                          "may still bring back the checkpoint it replaced", directory, error.strerror)
    store.sweep(directory, generation, (MODEL, OPTIMIZER))
    return len(text.encode())


def _checked_description(text: str, where) -> dict:
    try:
        described = json.loads(text)
    except ValueError as error:
        raise DataLoss(f"checkpoint: {where}'s {DESCRIPTION} is not JSON ({error})") from None
    if not isinstance(described, dict) or described.get("format") not in (FORMAT, FORMAT_2, FORMAT_1):
        raise InvalidArgument(f"checkpoint: {where} is not a {FORMAT} checkpoint (its {DESCRIPTION} says format "
                              f"{described.get('format') if isinstance(described, dict) else None!r})")
    if described["format"] in (FORMAT, FORMAT_2):
        parts, weights, parameters = (described.get(k) for k in ("parts", "weights", "parameters"))
        if not isinstance(parts, int) or not 1 <= parts <= MAX_PARTS or \
                not all(isinstance(names, list) and all(isinstance(n, str) for n in names)
                        for names in (weights, parameters)):
            raise DataLoss(f"checkpoint: {where}'s {DESCRIPTION} needs parts (1 to {MAX_PARTS}), weights and "
                           "parameters (lists of keys)")
    if described["format"] == FORMAT:
        step = described.get("step", 0)
        if not isinstance(described.get("generation"), str) or not isinstance(step, int) or \
                isinstance(step, bool):
            raise DataLoss(f"checkpoint: {where}'s {DESCRIPTION} needs a generation (a string) and a step "
                           "(a whole number) where it has one")
        store.check_generation(described["generation"])
    return described


def read_description(directory: str | os.PathLike) -> dict:
    """checkpoint.json of a checkpoint directory; NotFound when there is none, FailedPrecondition while a save
    into the directory that did not finish (or is under way) left its generation there."""
    root = pathlib.Path(directory)
    if not (root / DESCRIPTION).is_file():
        begun = " (a save into it began but did not finish)" if store.others(root, "") else ""
        raise NotFound(f"checkpoint: {root} holds no {DESCRIPTION}{begun} (not a checkpoint, or one not finished)")
    described = _checked_description((root / DESCRIPTION).read_text(), root)
    _check_finished(root, described)
    return described


def _check_finished(root: pathlib.Path, described: dict) -> None:
    """FailedPrecondition when a generation other than the published one is in `root`: a later save did not finish
    (or is under way), and the checkpoint it meant to replace holds older weights than the script last saved."""
    unfinished = store.others(root, described.get("generation", ""))
    if not unfinished:
        return
    newest = unfinished[-1]
    step = f", optimizer step {described['step']}" if "step" in described else ""
    raise FailedPrecondition(f"checkpoint: {root}: a save into it did not finish, or is under way ({newest.name}: "
                             f"{store.unfinished(newest)}); the checkpoint it was to replace{step} is still whole, "
                             f"but older than that save. Remove {newest} to load it, or save into {root} again")


def readable_by_shards(directory: str | os.PathLike) -> bool:
    """False for a checkpoint of the earliest layout, which only the SDK reads (True when there is none here: the
    shards then say what they find)."""
    try:
        return read_description(directory)["format"] in (FORMAT, FORMAT_2)
    except NotFound:
        return True


def read_parts(directory: str | os.PathLike, weight_keys: Iterable[str] | None = None,
               parameter_keys: Iterable[str] | None = None, optimizer: bool = True, meta: bool = False
               ) -> tuple[dict, dict[str, torch.Tensor], optim.KeyedState, int]:
    """(the description, the weights, the optimizer state, the bytes read) of a checkpoint, limited to
    `weight_keys` and to the state of `parameter_keys` when they are given (a stage's share: only its tensors'
    bytes are read; with `meta`, none: see read_part). A weight tied across parts is read from the first that
    holds it. Every part must be of the save and step checkpoint.json names: DataLoss naming the stage otherwise."""
    root = pathlib.Path(directory)
    described = read_description(root)
    if described["format"] == FORMAT_1:
        raise FailedPrecondition(f"checkpoint: {root} has the earliest layout ({FORMAT_1}), which only the SDK "
                                 "reads: load it with model.load_checkpoint(path, on_shards=False)")
    folder = store.generation_directory(root, described["generation"]) if described["format"] == FORMAT else root
    weights_wanted = None if weight_keys is None else set(weight_keys)
    params_wanted = None if parameter_keys is None else set(parameter_keys)
    weights: dict[str, torch.Tensor] = {}
    states, read = [], 0

    def stored(tensors: dict[str, torch.Tensor]) -> int:
        return 0 if meta else sum(t.numel() * t.element_size() for t in tensors.values())
    for part in range(described["parts"]):
        model_file, optimizer_file = part_files(part, described["parts"])
        tensors, metadata = read_part(folder / model_file, lambda name: name not in weights and (
            weights_wanted is None or name in weights_wanted), meta)
        _check_stamp(root, described, part, model_file, metadata)
        weights.update(tensors)
        read += stored(tensors)
        if not optimizer:
            continue
        tensors, metadata = read_part(folder / optimizer_file, lambda name: params_wanted is None or
                                      name.rpartition("/")[0] in params_wanted, meta)
        _check_stamp(root, described, part, optimizer_file, metadata)
        read += stored(tensors)
        try:
            state = optim.KeyedState.parse(metadata.get("layout", ""), tensors)
        except InvalidArgument as error:
            raise DataLoss(f"checkpoint: {folder / optimizer_file}: {error}") from None
        states.append(state if params_wanted is None else restricted(state, params_wanted))
    return described, weights, _overlaid(optim.merged(states), described.get("hyperparameters")), read


def _check_stamp(root: pathlib.Path, described: dict, part: int, file: str, metadata: dict[str, str]) -> None:
    """DataLoss naming the stage when a part's file is not of the save and optimizer step checkpoint.json names
    (a checkpoint of the earlier layout names neither)."""
    if described["format"] != FORMAT:
        return
    whose = f"stage {part}'s part" if described["parts"] > 1 else "its part"
    expected = _stamp(described["generation"], described.get("step"))
    if metadata.get("generation") != expected["generation"]:
        raise DataLoss(f"checkpoint: {root}: {whose} ({file}) belongs to save {metadata.get('generation')!r}, not "
                       f"to {expected['generation']!r}, which {DESCRIPTION} names: its parts come from different "
                       "saves")
    if metadata.get("step") != expected.get("step"):
        raise DataLoss(f"checkpoint: {root}: {whose} ({file}) holds optimizer step {metadata.get('step')}, the "
                       f"checkpoint step {described.get('step')}: its parts do not all belong to the same step")


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
    """Writes a checkpoint of one part, readable by this user only: the weights in their order, the optimizer
    state, the parameters' torch.optim order; published as a shard's parts are (write_part, publish)."""
    root, generation = pathlib.Path(directory), store.new_generation()
    try:
        store.make_directory(root, store.PRIVATE)
    except OSError as error:
        raise store.storage_error(error, root) from None
    write_part(root, generation, 0, 1, weights, optimizer_state, None)
    try:
        publish(root, generation, description(1, weights, parameters, generation=generation))
    except BaseException:
        discard_part(root, generation, 0, 1)
        raise


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
