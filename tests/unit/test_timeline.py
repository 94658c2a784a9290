"""client_sdk.timeline: stages' spans on one axis, the bubble, and the text picture."""

from __future__ import annotations

import pytest

from client_sdk.timeline import Timeline
from shardtrain.v1 import shard_pb2

F, B, O = shard_pb2.WORK_KIND_FORWARD, shard_pb2.WORK_KIND_BACKWARD, shard_pb2.WORK_KIND_OPTIMIZER


def stats(stage: int, *spans: tuple[int, int, float, float]) -> shard_pb2.StageStats:
    return shard_pb2.StageStats(stage=stage, spans=[shard_pb2.WorkSpan(kind=kind, microbatch=k, start=start, end=end)
                                                   for kind, k, start, end in spans])


def two_stages() -> Timeline:
    """Two stages, one micro-batch, on a wall clock far from zero: F0 F1 then B1 B0, then both optimizers."""
    t = 1_700_000_000.0
    return Timeline.from_stats([stats(1, (F, 0, t + 1, t + 2), (B, 0, t + 2, t + 3), (O, 0, t + 4, t + 5)),
                                stats(0, (F, 0, t, t + 1), (B, 0, t + 3, t + 4), (O, 0, t + 4, t + 5))])


def test_spans_share_one_axis_from_the_first_span_and_lanes_come_in_stage_order():
    timeline = two_stages()
    assert list(timeline.lanes()) == [(0, 0), (0, 1)]
    assert [(s.kind, s.start, s.end) for s in timeline.lanes()[(0, 0)]] == [
        ("forward", 0.0, 1.0), ("backward", 3.0, 4.0), ("optimizer", 4.0, 5.0)]
    assert timeline.makespan == 4.0


def test_the_bubble_is_the_mean_idle_share_of_the_makespan():
    assert two_stages().bubble() == pytest.approx(0.5)  # each stage works 2 of the 4 seconds


def test_the_picture_marks_what_filled_each_column():
    rows = two_stages().text(width=5).splitlines()
    assert rows[0].endswith("|F..BO|") and rows[1].endswith("|.FB.O|")
    assert rows[2].strip().endswith("5000 ms")
    assert Timeline(()).text() == "(no planned step recorded)"
