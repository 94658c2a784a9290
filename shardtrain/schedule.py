"""Pipeline-parallel micro-batch schedules as pure data: per-stage action orders and their simulated timelines.

A model is split into p stages (stage 0 first) and a step's batch into m micro-batches. Every stage runs a
forward F(k) and a backward B(k) for each micro-batch k. F(k) on stage s needs F(k) on stage s - 1; B(k) on
stage s needs F(k) on stage s and B(k) on stage s + 1 (on the last stage the loss links F(k) to B(k)).
Zero-bubble schedules split the backward: B(k) then computes only the gradient the stage before waits for, and
a later W(k) on the same stage computes the weights' gradients, where the stage would otherwise wait.
Nothing here touches tensors or the network: the coordinator reads the orders, tests and benches read the
simulated timelines.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from shardtrain.errors import InvalidArgument

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
SPLIT_BACKWARD = ("zb-h1",)  # schedules whose backward is B (input gradient) then W (weight gradient)
# A plan holds 2 * microbatches actions per stage; these bound what one request can make a server build.
MAX_STAGES = 1024
MAX_MICROBATCHES = 4096
MAX_PLAN_ACTIONS = 1 << 16  # every stage's actions together, in one PlanSchedule answer
FORWARD = "forward"
BACKWARD = "backward"  # the whole backward, or its input-gradient half where a WEIGHT action follows
WEIGHT = "weight"      # the weight-gradient half of a split backward

Key = tuple[int, str, int]  # (stage, op, micro-batch): one action on one stage
Timeline = dict[int, list[tuple[float, float, "Action"]]]


@dataclass(frozen=True)
class Action:
    """One unit of work on a stage: the forward, the backward or the weight gradient of one micro-batch."""

    op: str  # FORWARD, BACKWARD or WEIGHT
    microbatch: int


def stage_actions(schedule: str, stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """The order in which `stage` runs its 2*m actions under `schedule`."""
    _check_shape(schedule, num_stages, microbatches)
    _check_int("stage", stage, 0, f"a stage index in [0, {num_stages})")
    if stage >= num_stages:
        raise InvalidArgument(f"stage {stage!r} is outside [0, {num_stages}) for {num_stages} stages")
    if schedule == "gpipe":
        return _gpipe(microbatches)
    if schedule == "zb-h1":
        return _zero_bubble_h1(stage, num_stages, microbatches)
    return _one_f_one_b(stage, num_stages, microbatches)


def _gpipe(microbatches: int) -> list[Action]:
    """All forwards, then all backwards, both in increasing micro-batch order.

    Backwards run B(0), B(1), ... (not GPipe's usual reverse order) so that the last stage sends gradients
    in the order the stage above consumes them and so that both schedules hand micro-batches to gradient
    accumulation in one order; with equal stage times the makespan is the same as with the reverse order.
    """
    forwards = [Action(FORWARD, k) for k in range(microbatches)]
    return forwards + [Action(BACKWARD, k) for k in range(microbatches)]


def _one_f_one_b(stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """PipeDream-flush: warmup forwards, then one forward + one backward while forwards remain, then cooldown."""
    # Stage s needs p - s - 1 forwards in flight before the first gradient can come back down to it.
    warmup = min(num_stages - stage - 1, microbatches)
    actions = [Action(FORWARD, k) for k in range(warmup)]
    for k in range(warmup, microbatches):
        actions += [Action(FORWARD, k), Action(BACKWARD, k - warmup)]
    return actions + [Action(BACKWARD, k) for k in range(microbatches - warmup, microbatches)]


def _zero_bubble_h1(stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2024): 1F1B's order with each backward split, stage s holding back its first s weight
    gradients, which then fill the waits of its cooldown. A micro-batch is held until its W: no stage holds more
    than p at once, 1F1B's peak on its first stage."""
    warmup = min(num_stages - stage - 1, microbatches)
    actions = [Action(FORWARD, k) for k in range(warmup)]
    weights = iter(range(microbatches))
    for k in range(microbatches):  # the k-th backward, preceded by a forward while forwards remain
        if warmup + k < microbatches:
            actions.append(Action(FORWARD, warmup + k))
        actions.append(Action(BACKWARD, k))
        if k >= stage:
            actions.append(Action(WEIGHT, next(weights)))
    return actions + [Action(WEIGHT, k) for k in weights]


def timeline(schedule: str, num_stages: int, microbatches: int, forward_time: float = 1.0,
             backward_time: float = 1.0, weight_share: float = 0.5) -> Timeline:
    """Every stage running its stage_actions in order, as early as dependencies allow: (start, end, action).
    `backward_time` is a whole backward; a split one gives `weight_share` of it to W and the rest to B."""
    _check_shape(schedule, num_stages, microbatches)
    _check_time("forward_time", forward_time)
    _check_time("backward_time", backward_time)
    if not isinstance(weight_share, (int, float)) or not 0 < weight_share < 1:
        raise InvalidArgument(f"weight_share {weight_share!r} is invalid; expected a fraction in (0, 1)")
    orders = {s: stage_actions(schedule, s, num_stages, microbatches) for s in range(num_stages)}
    split = schedule in SPLIT_BACKWARD
    durations = {FORWARD: forward_time, BACKWARD: backward_time * (1 - weight_share if split else 1),
                 WEIGHT: backward_time * weight_share}
    return _simulate(orders, durations)


def _simulate(orders: dict[int, list[Action]], durations: dict[str, float]) -> Timeline:
    """Event-driven: commit a stage's next actions while their dependencies are done; a commit wakes the
    neighbouring stages, whose next action may have waited on it. Linear in the number of actions."""
    ends: dict[Key, float] = {}
    result: Timeline = {s: [] for s in orders}
    remaining = sum(len(order) for order in orders.values())
    waking, woken = collections.deque(orders), set(orders)
    while waking:
        stage = waking.popleft()
        woken.discard(stage)
        order = orders[stage]
        while len(result[stage]) < len(order) and _commit(stage, order, len(orders), durations, ends, result):
            remaining -= 1
            for neighbour in (stage - 1, stage + 1):
                if neighbour in orders and neighbour not in woken:
                    waking.append(neighbour)
                    woken.add(neighbour)
    if remaining:  # no stage can move and work is left: the orders wait on each other
        raise InvalidArgument(f"schedule deadlocks: {_stuck(orders, result)}")
    return result


def _commit(stage: int, order: list[Action], num_stages: int, durations: dict[str, float],
            ends: dict[Key, float], result: Timeline) -> bool:
    """Run the stage's next action if its dependencies are done; whether it ran."""
    action = order[len(result[stage])]
    deps = _dependencies(stage, action, num_stages)
    if any(dep not in ends for dep in deps):
        return False
    free = result[stage][-1][1] if result[stage] else 0.0
    start = max([free, *(ends[dep] for dep in deps)])
    end = start + durations[action.op]
    ends[(stage, action.op, action.microbatch)] = end
    result[stage].append((start, end, action))
    return True


def _dependencies(stage: int, action: Action, num_stages: int) -> list[Key]:
    """The actions on other stages (or this one) that must end before `action` can start."""
    k = action.microbatch
    if action.op == FORWARD:
        return [(stage - 1, FORWARD, k)] if stage > 0 else []
    if action.op == WEIGHT:
        return [(stage, BACKWARD, k)]
    deps = [(stage, FORWARD, k)]
    if stage < num_stages - 1:
        deps.append((stage + 1, BACKWARD, k))
    return deps


def _stuck(orders: dict[int, list[Action]], result: Timeline) -> str:
    """Where each unfinished stage waits, e.g. 'stage 0 waits at B0, stage 1 waits at F1'."""
    waits = [f"stage {s} waits at {_short(order[len(result[s])])}"
             for s, order in orders.items() if len(result[s]) < len(order)]
    return ", ".join(waits)


def _short(action: Action) -> str:
    """'F3' for the forward of micro-batch 3, 'B3' for its backward, 'W3' for its weight gradient."""
    return f"{action.op[0].upper()}{action.microbatch}"


def makespan(schedule: str, num_stages: int, microbatches: int, forward_time: float = 1.0,
             backward_time: float = 1.0, weight_share: float = 0.5) -> float:
    """Time from the first action starting (at 0) to the last one ending."""
    lanes = timeline(schedule, num_stages, microbatches, forward_time, backward_time, weight_share)
    return max(end for lane in lanes.values() for _, end, _ in lane)


def bubble_fraction(schedule: str, num_stages: int, microbatches: int, forward_time: float = 1.0,
                    backward_time: float = 1.0, weight_share: float = 0.5) -> float:
    """Idle time of all stages over num_stages * makespan."""
    span = makespan(schedule, num_stages, microbatches, forward_time, backward_time, weight_share)
    busy = num_stages * microbatches * (forward_time + backward_time)
    return max(0.0, (num_stages * span - busy) / (num_stages * span))  # a split backward's halves may round


def ideal_bubble_fraction(num_stages: int, microbatches: int) -> float:
    """The textbook bubble with equal stage and op times: (p - 1) / (m + p - 1)."""
    _check_int("num_stages", num_stages, 1, "a stage count >= 1")
    _check_int("microbatches", microbatches, 1, "a micro-batch count >= 1")
    return (num_stages - 1) / (microbatches + num_stages - 1)


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward has run and whose backward (weight gradient, if split) has not."""
    done = WEIGHT if any(action.op == WEIGHT for action in actions) else BACKWARD
    in_flight: set[int] = set()
    peak = 0
    for action in actions:
        if action.op == FORWARD:
            in_flight.add(action.microbatch)
        elif action.op == done:
            in_flight.discard(action.microbatch)
        peak = max(peak, len(in_flight))
    return peak


def _check_shape(schedule: str, num_stages: int, microbatches: int) -> None:
    if schedule not in SCHEDULES:
        raise InvalidArgument(f"schedule {str(schedule)[:40]!r} is unknown; expected one of {', '.join(SCHEDULES)}")
    _check_int("num_stages", num_stages, 1, f"a stage count in [1, {MAX_STAGES}]", MAX_STAGES)
    _check_int("microbatches", microbatches, 1, f"a micro-batch count in [1, {MAX_MICROBATCHES}]", MAX_MICROBATCHES)


def _check_int(name: str, value: object, low: int, expected: str, high: float = math.inf) -> None:
    # bool is an int subclass, but True stages or micro-batches are always a caller's mistake.
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidArgument(f"{name} {value!r} is invalid; expected {expected}")


def _check_time(name: str, value: float) -> None:
    # A zero or negative duration would make makespan 0 (bubble undefined) or let actions end before they start.
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{name} {value!r} is invalid; expected a finite duration > 0")
