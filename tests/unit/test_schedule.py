"""shardtrain.schedule: pipeline schedules against hand-worked tables, and their simulated timelines."""

from __future__ import annotations

import pytest

from shardtrain import schedule
from shardtrain.errors import InvalidArgument
from shardtrain.schedule import (
    INTERLEAVED, SCHEDULES, SPLIT_BACKWARD, Action, bubble_fraction, device_actions, ideal_bubble_fraction, makespan,
    peak_in_flight, stage_actions, timeline,
)

PER_STAGE = [name for name in SCHEDULES if name not in INTERLEAVED]  # one stage per device
ONE_PASS = [name for name in PER_STAGE if name not in SPLIT_BACKWARD]
OPS = {"F": "forward", "B": "backward", "W": "weight"}

# (p, m) pairs covering m > p, m == p, m < p, m == 1 and p == 1.
GRID = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 5), (3, 4), (4, 1), (4, 2), (4, 4), (4, 8), (5, 3), (6, 11)]


def fmt(actions: list[Action]) -> str:
    """'F0 F1 B0 ...': the written-out form the tables below use."""
    return " ".join(f"{a.op[0].upper()}{a.microbatch}" for a in actions)


def parse(text: str) -> list[Action]:
    """The inverse of fmt, for hand-written sequences."""
    return [Action(OPS[t[0]], int(t[1:])) for t in text.split()]


# Worked out by hand from the definition: stage s runs min(p - s - 1, m) warmup forwards, then F/B pairs
# while forwards remain, then the remaining backwards; backwards in increasing micro-batch order.
ONE_F_ONE_B = {
    (4, 8): [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ],
    (3, 4): [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ],
    (4, 2): [  # m < p: warmup is capped at m, so stages 0 and 1 never alternate; stage 2 is F0, F1 B0, B1
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 B0 F1 B1",
    ],
    (1, 3): ["F0 B0 F1 B1 F2 B2"],
}

GPIPE = {
    (4, 8): ["F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7"] * 4,
    (3, 4): ["F0 F1 F2 F3 B0 B1 B2 B3"] * 3,
    (1, 1): ["F0 B0"],
}


# Worked out by hand: 1F1B's order, each B followed by a W, except that stage s holds back its first s W's
# (they follow the last backward), so the upper stages have weight work for the waits of their cooldown.
ZERO_BUBBLE_H1 = {
    (4, 8): [
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
    ],
    (3, 2): [  # m < p: stage 2 holds back both W's
        "F0 F1 B0 W0 B1 W1",
        "F0 F1 B0 B1 W0 W1",
        "F0 B0 F1 B1 W0 W1",
    ],
}


@pytest.mark.parametrize(("shape", "expected"), ZERO_BUBBLE_H1.items())
def test_zero_bubble_h1_table(shape, expected):
    p, m = shape
    assert [fmt(stage_actions("zb-h1", s, p, m)) for s in range(p)] == expected


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= p])
def test_zero_bubble_h1_makespan(p, m):
    # With F = B = W the bubble is (p - 1) * (F + B - W) (Qi et al., 2024): a third of 1F1B's (p - 1) * 3F.
    assert makespan("zb-h1", p, m, 1.0, 2.0) == (p - 1) * 1.0 + m * 3.0
    assert makespan("zb-h1", p, m, 1.0, 2.0) <= makespan("1f1b", p, m, 1.0, 2.0)


@pytest.mark.parametrize(("shape", "expected"), ONE_F_ONE_B.items())
def test_1f1b_table(shape, expected):
    p, m = shape
    assert [fmt(stage_actions("1f1b", s, p, m)) for s in range(p)] == expected


@pytest.mark.parametrize(("shape", "expected"), GPIPE.items())
def test_gpipe_table(shape, expected):
    p, m = shape
    assert [fmt(stage_actions("gpipe", s, p, m)) for s in range(p)] == expected


def test_1f1b_timeline_p3_m4_by_hand():
    # Start times worked out by hand with forward = backward = 1, in each stage's order from the table above.
    expected_starts = [
        [0, 1, 2, 5, 6, 7, 9, 11],
        [1, 2, 4, 5, 6, 7, 8, 10],
        [2, 3, 4, 5, 6, 7, 8, 9],
    ]
    lanes = timeline("1f1b", 3, 4)
    assert [[start for start, _, _ in lanes[s]] for s in range(3)] == expected_starts
    assert [fmt([a for _, _, a in lanes[s]]) for s in range(3)] == ONE_F_ONE_B[(3, 4)]
    assert makespan("1f1b", 3, 4) == 12


@pytest.mark.parametrize("name", PER_STAGE)
@pytest.mark.parametrize(("p", "m"), GRID)
def test_every_action_once_and_forward_before_backward(name, p, m):
    ops = ("forward", "backward", "weight") if name in SPLIT_BACKWARD else ("forward", "backward")
    for s in range(p):
        actions = stage_actions(name, s, p, m)
        expected = {Action(op, k) for op in ops for k in range(m)}
        assert len(actions) == len(ops) * m and set(actions) == expected
        for k in range(m):
            positions = [actions.index(Action(op, k)) for op in ops]
            assert positions == sorted(positions)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_in_flight(p, m):
    for s in range(p):
        assert peak_in_flight(stage_actions("1f1b", s, p, m)) == min(p - s, m) <= p
        assert peak_in_flight(stage_actions("gpipe", s, p, m)) == m
        assert peak_in_flight(stage_actions("zb-h1", s, p, m)) <= min(p, m)  # held until W: at most 1F1B's p


def test_peak_in_flight_of_written_sequences():
    assert peak_in_flight([]) == 0
    assert peak_in_flight(parse("F0 B0 F1 B1")) == 1
    assert peak_in_flight(parse("F0 F1 B1 F2 F3 B0")) == 3
    assert peak_in_flight(parse("F0 B0 F1 B1 W0 W1")) == 2  # a split backward frees its micro-batch at W


@pytest.mark.parametrize("name", ONE_PASS)
@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("t", [1.0, 0.5, 2.0])
def test_equal_times_give_the_ideal_makespan_and_bubble(name, p, m, t):
    # Powers of two keep every sum exact, so exact equality is fair.
    assert makespan(name, p, m, t, t) == (m + p - 1) * 2 * t
    assert bubble_fraction(name, p, m, t, t) == ideal_bubble_fraction(p, m)


def test_ideal_bubble_fraction_values():
    assert ideal_bubble_fraction(1, 5) == 0.0
    assert ideal_bubble_fraction(4, 8) == 3 / 11
    assert ideal_bubble_fraction(4, 1) == 3 / 4


def dependencies(s: int, p: int, action: Action) -> list[tuple[int, Action]]:
    """Written independently of the module: what must end before `action` on stage s may start."""
    k = action.microbatch
    if action.op == "forward":
        return [(s - 1, Action("forward", k))] if s > 0 else []
    if action.op == "weight":
        return [(s, Action("backward", k))]
    deps = [(s, Action("forward", k))]
    return deps + [(s + 1, Action("backward", k))] if s < p - 1 else deps


@pytest.mark.parametrize("name", PER_STAGE)
@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (2.0, 1.0), (0.3, 0.7), (1.0, 3.0)])
def test_uneven_times_respect_dependencies(name, p, m, f, b):
    lanes = timeline(name, p, m, f, b)
    ends = {(s, a): end for s, lane in lanes.items() for _, end, a in lane}
    for s, lane in lanes.items():
        assert [a for _, _, a in lane] == stage_actions(name, s, p, m)
        previous_end = 0.0
        for start, end, action in lane:
            share = {"forward": f, "backward": b, "weight": b / 2}
            if name in SPLIT_BACKWARD:
                share["backward"] = b / 2
            assert end - start == pytest.approx(share[action.op])
            assert start >= previous_end  # one action at a time per stage
            assert all(start >= ends[dep] for dep in dependencies(s, p, action))
            previous_end = end
    assert lanes[0][0][0] == 0.0
    assert 0.0 <= bubble_fraction(name, p, m, f, b) < 1.0


@pytest.mark.parametrize("name", ONE_PASS)
@pytest.mark.parametrize(("p", "m"), GRID)
def test_uneven_makespan(name, p, m):
    # GPipe: forwards fill the pipe in (m + p - 1) f, then backwards drain it in (m + p - 1) b. 1F1B with
    # equal stages has the same makespan (Narayanan et al. 2021); it only lowers the activations in flight.
    assert makespan(name, p, m, 1.0, 2.0) == (m + p - 1) * 3.0


def test_deadlocking_orders_raise(monkeypatch):
    # Stage 0 wants B0 before F1, but stage 1 can only reach B0 after F1, which needs stage 0's F1.
    orders = {0: parse("F0 B0 F1 B1"), 1: parse("F0 F1 B0 B1")}
    monkeypatch.setattr(schedule, "stage_actions", lambda name, s, p, m: orders[s])
    with pytest.raises(InvalidArgument, match="deadlock.*stage 0 waits at B0.*stage 1 waits at F1"):
        timeline("1f1b", 2, 2)


def test_backward_before_own_forward_deadlocks(monkeypatch):
    monkeypatch.setattr(schedule, "stage_actions", lambda name, s, p, m: parse("B0 F0"))
    with pytest.raises(InvalidArgument, match="stage 0 waits at B0"):
        timeline("gpipe", 1, 1)


BAD_SHAPES = [
    # schedule, stage, num_stages, microbatches, words the message must contain
    ("pipedream", 0, 2, 2, "'pipedream'.*gpipe, 1f1b, zb-h1, interleaved"),
    ("", 0, 2, 2, "''.*gpipe, 1f1b"),
    ("1f1b", 2, 2, 2, r"stage 2.*\[0, 2\)"),
    ("1f1b", -1, 2, 2, r"stage -1.*\[0, 2\)"),
    ("gpipe", 0, 0, 2, r"num_stages 0.*\[1, 1024\]"),
    ("gpipe", 0, 2, 0, r"microbatches 0.*\[1, 4096\]"),
    ("gpipe", 0, 2, -3, r"microbatches -3.*\[1, 4096\]"),
    ("gpipe", 0, 2, 2.0, r"microbatches 2.0.*\[1, 4096\]"),
    ("gpipe", 0, 2, 2**31 - 1, r"microbatches 2147483647.*\[1, 4096\]"),
    ("gpipe", 0, 1025, 2, r"num_stages 1025.*\[1, 1024\]"),
    ("gpipe", True, 2, 2, "stage True"),
]


@pytest.mark.parametrize(("name", "stage", "p", "m", "message"), BAD_SHAPES)
def test_stage_actions_rejects(name, stage, p, m, message):
    with pytest.raises(InvalidArgument, match=message):
        stage_actions(name, stage, p, m)


@pytest.mark.parametrize("function", [timeline, makespan, bubble_fraction])
@pytest.mark.parametrize(("name", "p", "m", "message"), [
    ("zigzag", 2, 2, "'zigzag'.*gpipe, 1f1b"),
    ("gpipe", 0, 2, "num_stages 0"),
    ("1f1b", 2, 0, "microbatches 0"),
])
def test_simulations_reject(function, name, p, m, message):
    with pytest.raises(InvalidArgument, match=message):
        function(name, p, m)


@pytest.mark.parametrize(("f", "b", "message"), [
    (0.0, 1.0, "forward_time 0.0.*> 0"),
    (1.0, -1.0, "backward_time -1.0.*> 0"),
    (float("inf"), 1.0, "forward_time inf"),
    (1.0, float("nan"), "backward_time nan"),
])
def test_timeline_rejects_bad_times(f, b, message):
    with pytest.raises(InvalidArgument, match=message):
        timeline("1f1b", 2, 2, f, b)


@pytest.mark.parametrize(("p", "m", "message"), [(0, 1, "num_stages 0"), (1, 0, "microbatches 0")])
def test_ideal_bubble_fraction_rejects(p, m, message):
    with pytest.raises(InvalidArgument, match=message):
        ideal_bubble_fraction(p, m)


def test_timeline_is_pure():
    assert timeline("1f1b", 4, 8, 1.0, 2.0) == timeline("1f1b", 4, 8, 1.0, 2.0)
    assert sorted(timeline("gpipe", 4, 8)) == [0, 1, 2, 3]


@pytest.mark.parametrize("share", [0, 1, -0.5, "half", 1.5])
def test_timeline_rejects_bad_weight_share(share):
    with pytest.raises(InvalidArgument, match=f"weight_share {share!r}.*fraction in"):
        timeline("zb-h1", 2, 2, 1.0, 1.0, share)


# Interleaved: worked out by hand from the definition (p = 2 devices, v = 2 stages each, m = 4 in 2 rounds of 2;
# device d warms up with (v - 1) x 2 + 2 x (p - 1 - d) forwards). Stage s sits on device s mod 2.
INTERLEAVED_P2_V2_M4 = [
    "0:F0 0:F1 2:F0 2:F1 0:F2 2:B0 0:F3 2:B1 2:F2 0:B0 2:F3 0:B1 2:B2 2:B3 0:B2 0:B3",
    "1:F0 1:F1 3:F0 3:B0 3:F1 3:B1 1:F2 1:B0 1:F3 1:B1 3:F2 3:B2 3:F3 3:B3 1:B2 1:B3",
]


def test_interleaved_device_orders_by_hand():
    lanes = [" ".join(f"{s}:{fmt([a])}" for s, a in device_actions("interleaved", d, 4, 4, 2)) for d in range(2)]
    assert lanes == INTERLEAVED_P2_V2_M4
    assert fmt(stage_actions("interleaved", 2, 4, 4, 2)) == "F0 F1 B0 B1 F2 F3 B2 B3"


SHAPES = [(p, v, m) for p in (1, 2, 3, 4) for v in (2, 3) for m in (1, 2, 3, 4, 6, 8, 12)
          if m % max(1, m // p) == 0]


@pytest.mark.parametrize(("p", "v", "m"), SHAPES)
def test_interleaved_runs_every_action_once_one_at_a_time_per_device(p, v, m):
    n = p * v
    for s in range(n):
        actions = stage_actions("interleaved", s, n, m, v)
        assert sorted(actions, key=lambda a: (a.op, a.microbatch)) == sorted(
            {Action(op, k) for op in ("forward", "backward") for k in range(m)}, key=lambda a: (a.op, a.microbatch))
        assert [a.microbatch for a in actions if a.op == "forward"] == list(range(m))
    lanes = timeline("interleaved", n, m, 1.0, 2.0, virtual_stages=v)  # deadlock-free, or it raises
    for device in range(p):
        spans = sorted(span for s, lane in lanes.items() if s % p == device for span in lane)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one action at a time on a device
        assert all(end - start == pytest.approx((1.0 if a.op == "forward" else 2.0) / v) for start, end, a in spans)


@pytest.mark.parametrize(("p", "v", "m"), [(p, v, m) for p, v, m in SHAPES if m >= p and m % p == 0])
def test_interleaved_bubble_is_1f1b_s_divided_by_v(p, v, m):
    # Narayanan et al. (2021): the bubble shrinks from (p - 1)(F + B) to (p - 1)(F + B) / v.
    assert makespan("interleaved", p * v, m, 1.0, 2.0, virtual_stages=v) == pytest.approx(
        m * 3.0 + (p - 1) * 3.0 / v)
    assert bubble_fraction("interleaved", p * v, m, 1.0, 2.0, virtual_stages=v) == pytest.approx(
        (p - 1) / v / (m + (p - 1) / v))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: stage_actions("interleaved", 0, 4, 4), "virtual_stages >= 2 dividing the 4 stages, got 1"),
    (lambda: stage_actions("interleaved", 0, 5, 4, 2), "virtual_stages >= 2 dividing the 5 stages, got 2"),
    (lambda: stage_actions("interleaved", 0, 8, 9, 2), r"9 over 4 devices does not split into 2 rounds; "
                                                       r"use one of \[5, 6, 7, 8, 10, 12\]"),
    (lambda: device_actions("1f1b", 0, 4, 4, 2), "orders one stage per device; with 2 stages per device use"),
    (lambda: device_actions("interleaved", 2, 4, 4, 2), r"device 2 is invalid; expected a device index in \[0, 2\)"),
    (lambda: timeline("interleaved", 4, 4, virtual_stages=0), "virtual_stages 0 is invalid"),
])
def test_interleaved_refusals_say_what_fits(call, message):
    with pytest.raises(InvalidArgument, match=message):
        call()


@pytest.mark.parametrize("given, expected", [
    ("GPipe", "gpipe"), ("1F1B", "1f1b"), ("Interleaved1F1B", "interleaved"), ("ZBH1", "zb-h1"), ("ZB-H1", "zb-h1"),
    ("gpipe", "gpipe"), ("zb-h1", "zb-h1"), ("no-such", "no-such")])
def test_schedules_are_taken_by_torch_names_and_any_case(given, expected):
    assert schedule.canonical(given) == expected


def test_torch_schedule_classes_are_taken_by_their_names():
    pipelining = pytest.importorskip("torch.distributed.pipelining")
    assert schedule.canonical(pipelining.ScheduleGPipe) == "gpipe"
    assert schedule.canonical(pipelining.Schedule1F1B) == "1f1b"
    assert schedule.canonical(pipelining.ScheduleInterleaved1F1B) == "interleaved"
