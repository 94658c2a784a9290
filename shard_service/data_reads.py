"""Link items that name rows of training data (DataRows) in place of a tensor: the stage reads them from storage
itself, in worker threads, so that reading overlaps compute and the event loop goes on serving."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from shardtrain import data_files, metrics, wire
from shardtrain.v1 import shard_pb2, tensor_pb2

READ_THREADS = 4  # reads at once: a step's micro-batches come together, and object storage answers in parallel


def rows_of(message: shard_pb2.LinkMessage) -> shard_pb2.DataRows | None:
    """The DataRows a forward, target or model-input item names, if it names any."""
    kind = message.WhichOneof("item")
    if kind not in ("forward", "target", "residual"):
        return None
    item = getattr(message, kind)
    return item.data if item.HasField("data") else None


class DataReads:
    """Reads DataRows under the shard's --data-root directories and URL prefixes (none: every read is refused)."""

    def __init__(self, roots: Sequence[str]):
        self._reader = data_files.Reader(roots)
        self._pool: ThreadPoolExecutor | None = None

    async def read(self, rows: shard_pb2.DataRows, check: Callable[[tensor_pb2.TensorHeader], None]) -> torch.Tensor:
        """The rows as a tensor. `check` sees the tensor's header, from the files' headers, before any row is read."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="shardtrain-data")
        loop = asyncio.get_running_loop()
        dtype, shape, nbytes = await loop.run_in_executor(self._pool, self._reader.describe, rows)
        check(tensor_pb2.TensorHeader(name=f"data {rows.field[:80]}", dtype=wire.dtype_code(dtype), shape=shape,
                                      nbytes=nbytes))
        tensor = await loop.run_in_executor(self._pool, self._reader.read, rows)
        metrics.moved("received", "data", "storage", nbytes)
        return tensor
