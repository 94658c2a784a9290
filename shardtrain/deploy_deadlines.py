"""How long each part of a deploy may take, from the deploy's size, known before any shard starts on it.

A fixed deadline fails a large model's deploy on a busy host and lets a small one's stuck shard hold its client for
as long; these grow with what each part must do. A shard loading a stage checks and builds every layer's program
(its time follows the layers and the program bytes); measuring layers does the same and then runs each a few
times; shards on one host measure one after another. The rates are bounds well above what a busy host takes, not
estimates: a part that overruns its bound is stuck, not slow.
"""

from __future__ import annotations

from collections.abc import Sequence

SECONDS_PER_LAYER = 0.25     # checking and building one layer's program
SECONDS_PER_PROGRAM_MIB = 10.0  # ... and per MiB of its serialized programs (the shape check walks every node)
SECONDS_PER_MEASURED_LAYER = 1.0  # a warm-up and a few timed forward and backward runs of one layer


def program_bytes(layers: Sequence) -> int:
    """The bytes of the layers' captured programs, both modes."""
    return sum(len(layer.program) + len(layer.eval_program) for layer in layers)


def load(base: float, layers: Sequence) -> float:
    """The deadline of a LoadStage that builds `layers`: `base` (the control-plane deadline) and their work."""
    return base + SECONDS_PER_LAYER * len(layers) + SECONDS_PER_PROGRAM_MIB * program_bytes(layers) / 2 ** 20


def profile(base: float, layers: Sequence) -> float:
    """The deadline of a ProfileLayers that measures `layers` on one shard."""
    return load(base, layers) + SECONDS_PER_MEASURED_LAYER * len(layers)


def deploy(base: float, layers: Sequence, shards: int, measured: bool) -> float:
    """The deadline of a whole Deploy over `shards` shards: the coordinator's own calls (`base`), every shard
    measuring every layer one after another (the worst case: all on one host) when `measured`, and the stages
    loading at once, none holding more than every layer."""
    measuring = shards * profile(0.0, layers) if measured else 0.0
    return base + measuring + load(base, layers)
