"""Pipeline-parallel micro-batch schedules as pure data: per-stage action orders and their simulated timelines.

A model is split into p stages (stage 0 first) and a step's batch into m micro-batches. Every stage runs a
forward F(k) and a backward B(k) for each micro-batch k. F(k) on stage s needs F(k) on stage s - 1; B(k) on
stage s needs F(k) on stage s and B(k) on stage s + 1 (on the last stage the loss links F(k) to B(k)).
Zero-bubble schedules split the backward: B(k) then computes only the gradient the stage before waits for, and
a later W(k) on the same stage computes the weights' gradients, where the stage would otherwise wait.
The interleaved schedule puts v stages on each of p = stages / v devices (stage s on device s mod p), each a
v-th of the device's share of the model, and orders every device's actions over its stages.
Nothing here touches tensors or the network: the coordinator reads the orders, tests and benches read the
simulated timelines.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from shardtrain.errors import InvalidArgument

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved")
# Other spellings users bring: torch.distributed.pipelining's names (and its classes' names without "Schedule").
_SPELLINGS = {"gpipe": "gpipe", "1f1b": "1f1b", "zbh1": "zb-h1", "zb-h1": "zb-h1", "zerobubble": "zb-h1",
              "interleaved": "interleaved", "interleaved1f1b": "interleaved"}


def canonical(schedule) -> str:
    """A schedule's name as this module spells it, from any case of it or of torch's names ("GPipe", "1F1B",
    "Interleaved1F1B", "ZBH1") or torch's schedule class itself (ScheduleGPipe); unknown names pass through, to be
    refused naming the known ones."""
    name = getattr(schedule, "__name__", schedule)
    if not isinstance(name, str):
        return schedule
    key = name.lower().removeprefix("schedule").replace("_", "")
    return _SPELLINGS.get(key, name)
SPLIT_BACKWARD = ("zb-h1",)  # schedules whose backward is B (input gradient) then W (weight gradient)
INTERLEAVED = ("interleaved",)  # schedules of several stages per device, ordered per device
# A plan holds 2 * microbatches actions per stage; these bound what one request can make a server build.
MAX_STAGES = 1024
MAX_MICROBATCHES = 4096
MAX_PLAN_ACTIONS = 1 << 16  # every stage's actions together, in one PlanSchedule answer
FORWARD = "forward"
BACKWARD = "backward"  # the whole backward, or its input-gradient half where a WEIGHT action follows
WEIGHT = "weight"      # the weight-gradient half of a split backward

Key = tuple[int, str, int]  # (stage, op, micro-batch): one action on one stage
Timeline = dict[int, list[tuple[float, float, "Action"]]]
Lane = list[tuple[int, "Action"]]  # what one device runs, in order: (stage, action)


@dataclass(frozen=True)
class Action:
    """One unit of work on a stage: the forward, the backward or the weight gradient of one micro-batch."""

    op: str  # FORWARD, BACKWARD or WEIGHT
    microbatch: int


def stage_actions(schedule: str, stage: int, num_stages: int, microbatches: int,
                  virtual_stages: int = 1) -> list[Action]:
    """The order in which `stage` runs its actions under `schedule` (2 per micro-batch, 3 with a split
    backward); with the interleaved schedule, its share of its device's order."""
    _check_shape(schedule, num_stages, microbatches, virtual_stages)
    _check_int("stage", stage, 0, f"a stage index in [0, {num_stages})")
    if stage >= num_stages:
        raise InvalidArgument(f"stage {stage!r} is outside [0, {num_stages}) for {num_stages} stages")
    if schedule in INTERLEAVED:
        devices = num_stages // virtual_stages
        return [action for owner, action in _interleaved(stage % devices, devices, virtual_stages, microbatches)
                if owner == stage]
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


def device_actions(schedule: str, device: int, num_stages: int, microbatches: int, virtual_stages: int = 1) -> Lane:
    """What device `device` runs, in order: its stages' actions, (stage, action). Stage s sits on device
    s mod (num_stages / virtual_stages); with one stage per device, that stage's actions."""
    _check_shape(schedule, num_stages, microbatches, virtual_stages)
    devices = num_stages // virtual_stages
    _check_int("device", device, 0, f"a device index in [0, {devices})", devices - 1)
    if schedule in INTERLEAVED:
        return _interleaved(device, devices, virtual_stages, microbatches)
    if virtual_stages != 1:
        raise InvalidArgument(f"schedule {schedule!r} orders one stage per device; with {virtual_stages} stages "
                              "per device use 'interleaved'")
    return [(device, action) for action in stage_actions(schedule, device, num_stages, microbatches)]


def _interleaved(device: int, devices: int, chunks: int, microbatches: int) -> Lane:
    """Interleaved 1F1B (Narayanan et al., 2021), as Megatron-LM and torch.distributed.pipelining order it: the
    micro-batches go in rounds of `per_round`; forwards take each round through the device's stages in turn
    (first to last), backwards in reverse, after a warm-up of forwards, one forward then one backward."""
    rounds = max(1, microbatches // devices)
    per_round = microbatches // rounds
    total = microbatches * chunks
    warmup = min((chunks - 1) * per_round + 2 * (devices - 1 - device), total)

    def forward_stage(number: int) -> int:
        return (number // per_round) % chunks * devices + device

    def backward_stage(number: int) -> int:
        return (chunks - 1 - (number - warmup) // per_round % chunks) * devices + device
    forwards: collections.Counter = collections.Counter()
    backwards: collections.Counter = collections.Counter()
    lane: Lane = []

    def add(stage: int, op: str, counter: collections.Counter) -> None:
        lane.append((stage, Action(op, counter[stage])))
        counter[stage] += 1
    for number in range(total + warmup):
        if number < total:
            add(forward_stage(number), FORWARD, forwards)
        if number >= warmup:
            add(backward_stage(number), BACKWARD, backwards)
    return lane


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
             backward_time: float = 1.0, weight_share: float = 0.5, virtual_stages: int = 1) -> Timeline:
    """Every device running its device_actions in order, as early as dependencies allow: per stage,
    (start, end, action). `forward_time` and `backward_time` are one device's share of the model (each of its
    `virtual_stages` stages takes a v-th of them); a split backward gives `weight_share` of it to W."""
    _check_shape(schedule, num_stages, microbatches, virtual_stages)
    _check_time("forward_time", forward_time)
    _check_time("backward_time", backward_time)
    if not isinstance(weight_share, (int, float)) or not 0 < weight_share < 1:
        raise InvalidArgument(f"weight_share {weight_share!r} is invalid; expected a fraction in (0, 1)")
    devices = num_stages // virtual_stages
    lanes = {d: device_actions(schedule, d, num_stages, microbatches, virtual_stages) for d in range(devices)}
    split = schedule in SPLIT_BACKWARD
    durations = {FORWARD: forward_time, BACKWARD: backward_time * (1 - weight_share if split else 1),
                 WEIGHT: backward_time * weight_share}
    return _simulate(lanes, {op: time / virtual_stages for op, time in durations.items()}, num_stages)


def _simulate(lanes: dict[int, Lane], durations: dict[str, float], num_stages: int) -> Timeline:
    """Event-driven: commit a device's next actions while their dependencies are done; a commit wakes the
    devices of the neighbouring stages, whose next action may have waited on it. Linear in the number of actions."""
    ends: dict[Key, float] = {}
    result: Timeline = {s: [] for s in range(num_stages)}
    done = {device: 0 for device in lanes}
    free = {device: 0.0 for device in lanes}
    remaining = sum(len(lane) for lane in lanes.values())
    waking, woken = collections.deque(lanes), set(lanes)
    while waking:
        device = waking.popleft()
        woken.discard(device)
        lane = lanes[device]
        while done[device] < len(lane):
            stage, action = lane[done[device]]
            deps = _dependencies(stage, action, num_stages)
            if any(dep not in ends for dep in deps):
                break
            start = max([free[device], *(ends[dep] for dep in deps)])
            free[device] = ends[(stage, action.op, action.microbatch)] = start + durations[action.op]
            result[stage].append((start, free[device], action))
            done[device] += 1
            remaining -= 1
            for neighbour in (stage - 1, stage + 1):
                other = neighbour % len(lanes)
                if 0 <= neighbour < num_stages and other not in woken:
                    waking.append(other)
                    woken.add(other)
    if remaining:  # no device can move and work is left: the orders wait on each other
        waits = [f"stage {lane[done[d]][0]} waits at {_short(lane[done[d]][1])}"
                 for d, lane in lanes.items() if done[d] < len(lane)]
        raise InvalidArgument(f"schedule deadlocks: {', '.join(waits)}")
    return result


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


def _short(action: Action) -> str:
    """'F3' for the forward of micro-batch 3, 'B3' for its backward, 'W3' for its weight gradient."""
    return f"{action.op[0].upper()}{action.microbatch}"


def makespan(schedule: str, num_stages: int, microbatches: int, forward_time: float = 1.0,
             backward_time: float = 1.0, weight_share: float = 0.5, virtual_stages: int = 1) -> float:
    """Time from the first action starting (at 0) to the last one ending."""
    lanes = timeline(schedule, num_stages, microbatches, forward_time, backward_time, weight_share, virtual_stages)
    return max(end for lane in lanes.values() for _, end, _ in lane)


def bubble_fraction(schedule: str, num_stages: int, microbatches: int, forward_time: float = 1.0,
                    backward_time: float = 1.0, weight_share: float = 0.5, virtual_stages: int = 1) -> float:
    """Idle time of all devices over devices * makespan."""
    span = makespan(schedule, num_stages, microbatches, forward_time, backward_time, weight_share, virtual_stages)
    devices = num_stages // virtual_stages
    busy = devices * microbatches * (forward_time + backward_time)
    return max(0.0, (devices * span - busy) / (devices * span))  # a split backward's halves may round


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


def _check_shape(schedule: str, num_stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    if schedule not in SCHEDULES:
        raise InvalidArgument(f"schedule {str(schedule)[:40]!r} is unknown; expected one of {', '.join(SCHEDULES)}")
    _check_int("num_stages", num_stages, 1, f"a stage count in [1, {MAX_STAGES}]", MAX_STAGES)
    _check_int("microbatches", microbatches, 1, f"a micro-batch count in [1, {MAX_MICROBATCHES}]", MAX_MICROBATCHES)
    _check_int("virtual_stages", virtual_stages, 1, "a count of stages per device >= 1")
    if schedule in INTERLEAVED:
        _check_interleaved(num_stages, microbatches, virtual_stages)


def _check_interleaved(num_stages: int, microbatches: int, virtual_stages: int) -> None:
    """InvalidArgument unless the interleaved schedule can order this shape."""
    if virtual_stages < 2 or num_stages % virtual_stages:
        raise InvalidArgument(f"the interleaved schedule puts several stages on each device: virtual_stages >= 2 "
                              f"dividing the {num_stages} stages, got {virtual_stages}")
    devices = num_stages // virtual_stages
    rounds = max(1, microbatches // devices)
    if microbatches % rounds:
        fits = [m for m in range(max(1, microbatches - devices), microbatches + devices + 1)
                if m % max(1, m // devices) == 0]
        raise InvalidArgument(f"the interleaved schedule takes micro-batches in rounds of equal size: "
                              f"{microbatches} over {devices} devices does not split into {rounds} rounds; "
                              f"use one of {fits}")


def _check_int(name: str, value: object, low: int, expected: str, high: float = math.inf) -> None:
    # bool is an int subclass, but True stages or micro-batches are always a caller's mistake.
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidArgument(f"{name} {value!r} is invalid; expected {expected}")


def _check_time(name: str, value: float) -> None:
    # A zero or negative duration would make makespan 0 (bubble undefined) or let actions end before they start.
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{name} {value!r} is invalid; expected a finite duration > 0")
