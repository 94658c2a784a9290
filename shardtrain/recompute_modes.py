"""Activation recomputation: which micro-batches a stage keeps only the inputs of, running the forward again in
their backward (with the random state replayed, so dropout draws the same), to hold less activation memory.

"never": every micro-batch keeps what autograd saves. "always": none does. "except_last": all but each step's
last micro-batch, whose backward comes first (torchgpipe's default checkpoint mode).
"""

from __future__ import annotations

from shardtrain.errors import InvalidArgument

MODES = ("never", "always", "except_last")


def check(mode: str) -> str:
    """`mode` ("" as "never"); InvalidArgument naming the modes otherwise."""
    if mode not in ("", *MODES):
        raise InvalidArgument(f"recompute must be one of {list(MODES)}, got {str(mode)[:40]!r}")
    return mode or "never"
