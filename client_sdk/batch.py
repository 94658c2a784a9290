"""What a planned step trains on (a batch of tensors, or of a DataSource's rows) and its split over replicas and
micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardtrain import schedule as schedules
from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2


def split_batch(batch: dict[str, torch.Tensor], replicas: int, microbatches: int) -> list[list[dict]]:
    """Per replica, its micro-batches: every tensor of `batch` (the model's inputs, the target) split by rows, the
    same rows of each together; the last micro-batches may be a row shorter."""
    rows = {name: tensor.shape[0] if tensor.dim() else None for name, tensor in batch.items()}
    if None in rows.values() or len(set(rows.values())) != 1:
        shapes = ", ".join(f"{name} {list(tensor.shape)}" for name, tensor in batch.items())
        raise InvalidArgument(f"the inputs and the target need the same batch dimension (dim 0), got {shapes}")
    if not isinstance(microbatches, int) or not 1 <= microbatches <= schedules.MAX_MICROBATCHES:
        raise InvalidArgument(f"microbatches must be an integer in 1..{schedules.MAX_MICROBATCHES}, "
                              f"got {microbatches!r}")
    count = next(iter(rows.values()))
    if count < replicas * microbatches:
        raise InvalidArgument(f"a batch of {count} rows cannot feed {replicas} replica(s) x {microbatches} "
                              "micro-batches: each needs at least one row")
    pieces = {name: [torch.tensor_split(share, microbatches) for share in torch.tensor_split(tensor, replicas)]
              for name, tensor in batch.items()}
    return [[{name: pieces[name][r][k] for name in batch} for k in range(microbatches)] for r in range(replicas)]


@dataclass(frozen=True)
class Batch:
    """What a planned step trains on: the main input, the model's other inputs by name, the loss's target (None
    when the model computes its loss itself). With a `source` (a DataSource), each of them is the rows of the field
    `fields` names for it, which the stages read themselves."""

    x: torch.Tensor
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    y: torch.Tensor | None = None
    source: object = None  # client_sdk.data_source.DataSource
    fields: dict[str, str] = field(default_factory=dict)  # MAIN, an input's name or TARGET -> the source's field

    @property
    def rows(self) -> int:
        return self.x.shape[0] if self.x.dim() else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {MAIN: self.x, **self.inputs}
        if self.y is not None:
            named[TARGET] = self.y
        return {name: tensor.detach() for name, tensor in named.items()}

    def piece(self, named: dict[str, torch.Tensor]) -> Batch:
        """The batch of these rows of each tensor (split_batch's pieces)."""
        inputs = {name: tensor for name, tensor in named.items() if name not in (MAIN, TARGET)}
        return Batch(named[MAIN], inputs, named.get(TARGET), self.source, self.fields)

    def data(self, name: str) -> shard_pb2.DataRows | None:
        """The DataRows the stage reads for the tensor `name` (MAIN, an input's, TARGET); None without a source."""
        if self.source is None:
            return None
        rows = self.x if name == MAIN else self.y if name == TARGET else self.inputs[name]
        return self.source.rows_message(self.fields[name], rows)

    def example(self, count: int) -> Batch:
        """The first `count` rows as tensors here (read from the source if there is one)."""
        rows = {name: tensor[:count] for name, tensor in self.tensors().items()}
        if self.source is None:
            return self.piece(rows)
        values = self.source.read(rows[MAIN])
        return Batch(values[self.fields[MAIN]], {name: values[self.fields[name]] for name in self.inputs},
                     values[self.fields[TARGET]] if TARGET in self.fields else None)


MAIN, TARGET = "the first input", "the target"  # how split_batch's errors name them (never an argument's name)
