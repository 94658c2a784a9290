"""DataSource: training data in files (local or object storage) that each replica's first and last stage read
themselves, a batch at a time, so no batch passes through the client.

    data = DataSource("s3://bucket/train/", inputs="x", target="y", batch_size=64, seed=0)
    model.fit(data, epochs=3, microbatches=4)

The SDK reads only the files' headers: it learns the rows, shuffles them with the seed (the same order whatever
the split), and sends each stage the rows of its share (DataRows); the shards read those rows from storage.
"""

from __future__ import annotations

import bisect
import glob as globbing
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardtrain import data_files as files
from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2


class DataSource:
    """Rows of training data in safetensors or .npy files, in batches of `batch_size` rows.

    url: a file, a glob ("/data/train-*.safetensors"), or a directory or prefix ("s3://bucket/train/", every file
    of the format under it), as fsspec reads it ("local://", "file://", "s3://" with s3fs; credentials and
    endpoint from the AWS_* environment variables, where the shards run too). Files are taken in name order,
    their rows one after another. For .npy files, which hold one array each, the url has a "{field}" that each
    field's name fills ("/data/{field}-*.npy").
    inputs: the field that is the model's input, a tuple of fields (its positional arguments), or a dict of
    argument name to field; target: the loss's target field, or None when the model computes its loss itself
    (train_step's loss_output).
    Each pass (an epoch) shuffles the rows with `seed` and the pass's number, unless shuffle=False;
    drop_last leaves out a last batch shorter than batch_size.
    Iterating gives RowBatch objects, which train_step and fit take in place of tensors; `batch.read()` reads one
    here (fit does so for validation and the loop)."""

    def __init__(self, url: str, inputs="x", target: str | None = "y", *, batch_size: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, format: str | None = None):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise InvalidArgument(f"batch_size must be a whole number >= 1, got {batch_size!r}")
        if isinstance(inputs, str):
            self.inputs: tuple | dict = (inputs,)
        elif isinstance(inputs, (tuple, list)) and inputs and all(isinstance(f, str) for f in inputs):
            self.inputs = tuple(inputs)
        elif isinstance(inputs, dict) and inputs and all(isinstance(f, str) for f in inputs.values()):
            self.inputs = dict(inputs)
        else:
            raise InvalidArgument(f"inputs: a field name, a tuple of them or a dict of argument to field, got "
                                  f"{inputs!r}")
        self.url, self.target = url, target
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, int(seed), drop_last
        suffix = os.path.splitext(url.replace("{field}", "x").rstrip("/"))[1]
        self.format = format or files.FORMATS.get(suffix, "safetensors")  # a directory or prefix: safetensors
        if self.format not in files.FORMATS.values():
            raise InvalidArgument(f"format {format!r} is not one of {sorted(files.FORMATS.values())}")
        self.fields = list(dict.fromkeys([*(self.inputs.values() if isinstance(self.inputs, dict) else self.inputs),
                                          *([target] if target else [])]))
        self._urls = {field: self._list(field) for field in self.fields}  # per field: its files, in order
        self._cache = files.HeaderCache()
        self.kinds = self._check()
        self._passes = 0

    def _list(self, field: str) -> list[str]:
        """The files of `field`, by name."""
        if self.format == "npy" and "{field}" not in self.url:
            raise InvalidArgument(f"an .npy source names each field's files: put '{{field}}' in the url, got "
                                  f"{self.url!r}")
        url = self.url.replace("{field}", field)
        fs, path = files.filesystem(url)
        suffix = next(s for s, f in files.FORMATS.items() if f == self.format)
        if globbing.has_magic(path):
            found = fs.glob(path)
        elif fs.isdir(path):
            found = [p for p in fs.find(path) if p.endswith(suffix)]
        else:
            found = [path] if fs.exists(path) else []
        if not found:
            raise InvalidArgument(f"no {self.format} files at {url!r}")
        return [fs.unstrip_protocol(p) for p in sorted(found)]

    def _check(self) -> dict[str, files.Field]:
        """Every field's rows per file (the same in every field), dtype and row shape; self.offsets: where each
        file's rows start."""
        counts, kinds = None, {}
        for field, urls in self._urls.items():
            per_file = []
            for url in urls:
                found = files.field_of(self._cache.fields(url, self.format), self.format, field, url)
                if kinds.setdefault(field, found).dtype != found.dtype or kinds[field].row_shape != found.row_shape:
                    raise InvalidArgument(f"field {field!r}: {url} holds {found.dtype} rows of "
                                          f"{list(found.row_shape)}, {urls[0]} {kinds[field].dtype} rows of "
                                          f"{list(kinds[field].row_shape)}")
                per_file.append(found.rows)
            if counts is None:
                counts = per_file
            elif per_file != counts:
                raise InvalidArgument(f"the fields' files do not hold the same rows: {self.fields[0]!r} has "
                                      f"{counts}, {field!r} has {per_file} per file")
        self.offsets = [0]
        for count in counts:
            self.offsets.append(self.offsets[-1] + count)
        if not self.offsets[-1]:
            raise InvalidArgument(f"the files at {self.url!r} hold no rows")
        return kinds

    @property
    def rows(self) -> int:
        """Rows in all files."""
        return self.offsets[-1]

    def __len__(self) -> int:
        """Batches in a pass."""
        return self.rows // self.batch_size if self.drop_last else -(-self.rows // self.batch_size)

    def epoch(self, number: int) -> list[RowBatch]:
        """The batches of pass `number` (from 0): the rows shuffled by (seed, number), or in order."""
        if self.shuffle:
            order = torch.randperm(self.rows, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + number))
        else:
            order = torch.arange(self.rows)
        batches = [RowBatch(self, order[i:i + self.batch_size]) for i in range(0, self.rows, self.batch_size)]
        if self.drop_last and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    def __iter__(self) -> Iterator[RowBatch]:
        """The next pass's batches: the first iteration is pass 0, the next pass 1, and so on."""
        number, self._passes = self._passes, self._passes + 1
        return iter(self.epoch(number))

    def rows_message(self, field: str, rows: torch.Tensor) -> shard_pb2.DataRows:
        """The DataRows of `field` for these global rows: consecutive rows of one file as one span."""
        message = shard_pb2.DataRows(format=self.format, field=field)
        urls = self._urls[field]
        for row in rows.tolist():
            index = bisect.bisect_right(self.offsets, row) - 1
            if not message.spans or message.spans[-1].url != urls[index]:
                message.spans.add(url=urls[index])
            message.spans[-1].rows.append(row - self.offsets[index])
        return message

    def read(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every field's rows, read here."""
        return {field: files.read(self.rows_message(field, rows), self._cache) for field in self.fields}

    def __repr__(self) -> str:
        return (f"DataSource({self.url!r}, {self.rows} rows of {self.fields}, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, seed={self.seed})")


@dataclass(frozen=True)
class RowBatch:
    """A batch of a DataSource: its rows, which the shards read (train_step) or `read()` reads here."""

    source: DataSource
    rows: torch.Tensor

    def __len__(self) -> int:
        return len(self.rows)

    def read(self) -> tuple:
        """(x, y) as tensors here, x as the model takes it (a tensor, a tuple or a dict); x alone without a
        target."""
        values = self.source.read(self.rows)
        inputs = self.source.inputs
        if isinstance(inputs, dict):
            x = {name: values[field] for name, field in inputs.items()}
        else:
            x = values[inputs[0]] if len(inputs) == 1 else tuple(values[field] for field in inputs)
        return (x, values[self.source.target]) if self.source.target else x

    def placeholders(self) -> tuple[tuple, dict, dict[int, str]]:
        """(args, kwargs) of meta tensors standing for the inputs, to bind to the model's signature, and which
        field each stands for (by id)."""
        by_id = {}

        def stand_in(field: str) -> torch.Tensor:
            kind = self.source.kinds[field]
            tensor = torch.empty((len(self.rows), *kind.row_shape), dtype=kind.dtype, device="meta")
            by_id[id(tensor)] = field
            return tensor
        inputs = self.source.inputs
        if isinstance(inputs, dict):
            return (), {name: stand_in(field) for name, field in inputs.items()}, by_id
        return tuple(stand_in(field) for field in inputs), {}, by_id
