"""Where the per-call RPCs' results wait: the stand-in for the SDK's end of a Link when a client drives the loop
with Forward, Backward and Step calls instead of Links.

The Link loop sends what it would send the SDK (the last stage's output, the first stage's input gradient, the
failure of either) to a CallOutbox for the steps a call started, and keeps there the residuals a stage read in
those steps; FetchTensor hands them out from here."""

from __future__ import annotations

import torch

from shard_service.mailbox import Mailbox
from shardtrain import errors, link_streams, wire
from shardtrain.residuals import INPUT_GRADIENT, OUTPUT
from shardtrain.v1 import shard_pb2

FETCHABLE = (OUTPUT, INPUT_GRADIENT)
KEPT_BYTES = 256 << 20  # tensors kept for FetchTensor that nobody fetched: the oldest go first beyond this


class CallOutbox:
    """Receives a stage's items for the SDK as a LinkEnd would, and keeps each tensor (or failure) until fetched."""

    name = "the client of the per-call RPCs"
    same_host = False       # tensors are encoded when fetched, with the fetcher's options
    toward_first = True

    def __init__(self) -> None:
        self._kept = Mailbox(max_bytes=KEPT_BYTES)

    async def send(self, message: shard_pb2.LinkMessage, tensor: torch.Tensor | None = None,
                   options: wire.SendOptions = wire.EXACT) -> None:
        """Keeps an output, an input gradient (None: the forward asked for none) or the failure in their place."""
        kind = message.WhichOneof("item")
        if kind == "output":
            self._kept.put(self._slot(message.output.key, OUTPUT), tensor)
        elif kind == "backward_done":
            self._kept.put(self._slot(message.backward_done.key, INPUT_GRADIENT), tensor)
        elif kind == "error" and message.error.HasField("key"):
            name = INPUT_GRADIENT if message.error.backward else OUTPUT
            self._kept.put(self._slot(message.error.key, name), link_streams.raised(message.error))
        # Anything else (a flush, a failure of no one step) answers a Link's own items: no call waits for it.

    @staticmethod
    def _slot(key: shard_pb2.StepKey, name: str) -> tuple:
        return key.step, key.microbatch, name

    def keep(self, key: shard_pb2.StepKey, name: str, tensor: torch.Tensor) -> None:
        """Keeps residual `name` as this stage read it in a step a call started, for a client to look at."""
        self._kept.put(self._slot(key, name), tensor)

    async def fetch(self, key: shard_pb2.StepKey, name: str, timeout: float,
                    residuals: tuple[str, ...] = ()) -> torch.Tensor:
        """The tensor `name` of a step (an output, an input gradient, or one of the `residuals` this stage reads),
        once its call's work got that far; the step's failure instead, raised."""
        if name not in FETCHABLE and name not in residuals:
            served = [*FETCHABLE, *residuals]
            raise errors.InvalidArgument(f"FetchTensor here serves {', '.join(map(repr, served))}, not {name[:100]!r}: "
                                         "a residual is fetched from a stage that reads it")
        what = f"{name!r} of step {key.step} micro-batch {key.microbatch}"
        kept = await self._kept.get(self._slot(key, name), timeout, what)
        if isinstance(kept, errors.ShardtrainError):
            raise kept
        if kept is None:
            raise errors.FailedPrecondition(f"step {key.step} kept no input gradient: its Forward call did not set "
                                            "input_requires_grad")
        return kept

    def fetched(self, key: shard_pb2.StepKey, name: str) -> None:
        """Drops a tensor once a fetch got all of it (until then a broken stream may resume)."""
        self._kept.discard(self._slot(key, name))

    def forget(self, up_to_step: int) -> None:
        """Drops what was never fetched of steps up to `up_to_step`."""
        self._kept.discard_where(lambda slot: slot[0] <= up_to_step)
