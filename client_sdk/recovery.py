"""Replacing a dead shard: with replicas nothing is lost, without them the model goes back to its last snapshots.

With replicas (recover): when a step fails and some shard no longer answers, every surviving shard snapshots its
stage (weights and optimizer state, and the last optimizer step it applied); the model is deployed again with the
same split, each stage on the shard that held it where that shard lives and on a spare otherwise; every new stage
restores from a survivor's snapshot of the same stage (its own, or a live replica's, read shard to shard); then
the steps the restored state lacks run again (client_sdk/planned_steps.py).

Without (take_snapshots, roll_back): every few steps each stage snapshots itself and the next stage's shard keeps
a copy; after a death the model is deployed again the same way and every stage restores from those snapshots.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from shardtrain import errors
from shardtrain.rpc import Peer
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.sdk.recovery")
SNAPSHOT_RETRIES, SNAPSHOT_RETRY_SECONDS = 5, 0.2  # snapshots taken again of survivors a step behind the others

# redeploy(prefer_addresses, layers_per_stage) -> the new deployment's replicas' StageClients and its handle
Redeploy = Callable[[list[str], list[int]], Awaitable]


@dataclass(frozen=True)
class Recovery:
    """One dead shard (or several) replaced: model.recoveries lists them."""

    dead: tuple[str, ...]     # the addresses that stopped answering
    replaced_by: tuple[str, ...]  # the shards that took their places
    steps_run_again: int      # train_step calls whose optimizer step the survivors had not applied
    bytes_moved: int          # state streamed between shards to restore the stages
    seconds: float            # from finding the dead shard to every stage restored


async def recover(replicas: Sequence, layers_per_stage: list[int], redeploy: Redeploy):
    """Replaces the shards of `replicas` (StageClients, one per replica) that do not answer. Returns (the last
    optimizer step of the restored state, in the old deployment's numbering; the new handle; a Recovery whose
    steps_run_again the caller fills in), or None when every shard answers (the failure was something else).
    Unavailable when some stage has no live replica left, FailedPrecondition when the survivors' stages are at
    different steps."""
    started = time.perf_counter()
    grid = [list(clients.stages) for clients in replicas]  # [replica][stage] Peer
    alive = await asyncio.gather(*(clients.answering() for clients in replicas))
    width = len(grid[0])
    dead = [(r, s) for r in range(len(grid)) for s in range(width) if not alive[r][s]]
    if not dead:
        return None
    old = replicas[0]
    log.warning("deployment %s: %s did not answer; replacing it from the live replicas", old.deployment_id,
                ", ".join(grid[r][s].name for r, s in dead))
    name = f"recovery-{old.deployment_id}"
    request = shard_pb2.SnapshotRequest(deployment_id=old.deployment_id, name=name, copy=True)
    survivors = [(r, s) for r in range(len(grid)) for s in range(width) if (r, s) not in dead]

    async def snapshot(r: int, s: int):
        try:
            return (await grid[r][s].call("Snapshot", request)).optimizer_step
        except errors.ShardtrainError as error:  # died meanwhile, or cannot: not a source
            log.warning("%s could not snapshot its stage: %s", grid[r][s].name, error)
            return None
    steps = dict(zip(survivors, await asyncio.gather(*(snapshot(r, s) for r, s in survivors))))
    for _ in range(SNAPSHOT_RETRIES):  # a step's verdict may still be on its way down to a survivor: wait for it
        latest = max((step for step in steps.values() if step is not None), default=0)
        behind = [key for key, step in steps.items() if step is not None and step < latest]
        if not behind or _common(steps, width):
            break
        await asyncio.sleep(SNAPSHOT_RETRY_SECONDS)
        steps.update(zip(behind, await asyncio.gather(*(snapshot(r, s) for r, s in behind))))
    try:
        restored = _common_step(steps, len(grid), width, grid)
        sources = {s: [r for r in range(len(grid)) if steps.get((r, s)) == restored] for s in range(width)}
        new_replicas, handle = await _redeploy(redeploy, [peer.address for row in grid for peer in row],
                                               layers_per_stage, [grid[r][s].name for r, s in dead])
        restores = []
        for r, clients in enumerate(new_replicas):
            for s, peer in enumerate(clients.stages):
                source = r if r in sources[s] else sources[s][0]  # its own state where it lives, else a replica's
                restores.append(peer.call("RestoreStage", shard_pb2.RestoreStageRequest(
                    deployment_id=clients.deployment_id, source_address=grid[source][s].address, snapshot=name,
                    source_deployment_secret=old.secret)))
        moved = sum(answer.bytes for answer in await asyncio.gather(*restores))
        log.warning("deployment %s replaces %s: restored at optimizer step %d (%d bytes moved between shards)",
                    new_replicas[0].deployment_id, old.deployment_id, restored, moved)
        replaced_by = tuple(new_replicas[r].stages[s].address for r, s in dead)
        return restored, handle, Recovery(tuple(grid[r][s].address for r, s in dead), replaced_by, 0, moved,
                                          time.perf_counter() - started)
    finally:
        await asyncio.gather(*(_drop(grid[r][s], name) for r, s in steps))


def _by_stage(steps: dict[tuple[int, int], int | None], width: int) -> list[set[int]]:
    """Per stage, the optimizer steps its live snapshots are at."""
    return [{step for (_, stage), step in steps.items() if stage == s and step is not None} for s in range(width)]


def _common(steps: dict[tuple[int, int], int | None], width: int) -> set[int]:
    """The optimizer steps at which every stage has a live snapshot."""
    return set.intersection(*_by_stage(steps, width))


def _common_step(steps: dict[tuple[int, int], int | None], num_replicas: int, width: int, grid) -> int:
    """The latest optimizer step at which every stage has a live snapshot."""
    at = _by_stage(steps, width)
    for s, found in enumerate(at):
        if not found:
            lost = ", ".join(grid[r][s].address for r in range(num_replicas))
            raise errors.Unavailable(f"stage {s} lost every replica ({lost}): its weights survive only in a "
                                     "checkpoint; deploy again and load_checkpoint")
    common = set.intersection(*at)
    if not common:
        raise errors.FailedPrecondition(f"the surviving stages stopped at different optimizer steps "
                                        f"({[sorted(found) for found in at]} by stage), so no state of the whole "
                                        "model is left; deploy again and load_checkpoint")
    return max(common)


async def _redeploy(redeploy: Redeploy, prefer: list[str], layers_per_stage: list[int], dead: list[str]):
    """The redeploy's (replicas, handle); Unavailable naming the dead shards when it is refused (no spare, most
    often: the model stays as it was)."""
    try:
        return await redeploy(prefer, layers_per_stage)
    except errors.ShardtrainError as error:
        raise errors.Unavailable(f"{', '.join(dead)} did not answer, and no shard could take its place (start one, "
                                 f"and it registers as a spare): {error}") from None


async def _drop(peer: Peer, name: str) -> None:
    try:
        await peer.call("DropSnapshot", shard_pb2.DropSnapshotRequest(name=name))
    except errors.ShardtrainError:  # it died since: its snapshot went with it
        pass


PERIODIC = "periodic"  # each stage's own snapshot every snapshot_every steps; the next stage's shard keeps a copy


@dataclass(frozen=True)
class Periodic:
    """The snapshots a deployment without replicas last took: every stage at optimizer step `optimizer_step`,
    when `steps_done` train_step calls stood."""

    optimizer_step: int
    steps_done: int
    secret: str  # the deployment's that took them
    name: str    # each stage's own; the copy of stage s's is f"{name}-of-{s}"


async def take_snapshots(clients, steps_done: int) -> Periodic:
    """Snapshots every stage of `clients` (settled: every stage at the same step), and has the next stage's shard
    (the last's: the first's) keep a copy of each, so that one dead shard loses no snapshot."""
    name = f"{PERIODIC}-{clients.deployment_id}"  # a shard keeps snapshots of two deployments: names apart
    request = shard_pb2.SnapshotRequest(deployment_id=clients.deployment_id, name=name, copy=True)
    taken = await asyncio.gather(*(stage.call("Snapshot", request) for stage in clients.stages))
    steps = {answer.optimizer_step for answer in taken}
    if len(steps) != 1:
        raise errors.InternalError(f"the stages snapshotted at different optimizer steps {sorted(steps)}, though "
                                   "every step had settled")
    stages, count = clients.stages, len(clients.stages)
    if count > 1:
        await asyncio.gather(*(stages[(s + 1) % count].call("CopySnapshot", shard_pb2.CopySnapshotRequest(
            name=f"{name}-of-{s}", source_address=stages[s].address, snapshot=name,
            source_deployment_secret=clients.secret)) for s in range(count)))
    return Periodic(steps.pop(), steps_done, clients.secret, name)


async def roll_back(clients, periodic: Periodic, layers_per_stage: list[int], redeploy: Redeploy):
    """Replaces the shards of a deployment without replicas that do not answer, and restores every stage from
    the last snapshots: its own shard's, or for the replacement the copy on the next stage's shard. Returns (the
    new handle, a Recovery), or None when every shard answers. Unavailable when a stage's shard and the one
    holding the copy of its snapshot both died, or no shard can take the dead one's place."""
    started = time.perf_counter()
    stages = list(clients.stages)
    alive = await clients.answering()
    dead = [s for s, answered in enumerate(alive) if not answered]
    if not dead:
        return None
    count = len(stages)
    log.warning("deployment %s: %s did not answer; going back to the snapshots of optimizer step %d",
                clients.deployment_id, ", ".join(stages[s].name for s in dead), periodic.optimizer_step)
    sources = []
    for s in range(count):
        keeper = (s + 1) % count
        if alive[s]:
            sources.append((stages[s].address, periodic.name))
        elif count > 1 and alive[keeper]:
            sources.append((stages[keeper].address, f"{periodic.name}-of-{s}"))
        elif count == 1:
            raise errors.Unavailable(f"{stages[s].name} died with the only snapshot of the model's one stage: go on "
                                     "from a checkpoint")
        else:
            raise errors.Unavailable(f"{stages[s].name} died, and so did {stages[keeper].name}, which kept the copy "
                                     "of its snapshot: go on from a checkpoint")
    new_replicas, handle = await _redeploy(redeploy, [stage.address for stage in stages], layers_per_stage,
                                           [stages[s].name for s in dead])
    new = new_replicas[0]
    restored = await asyncio.gather(*(stage.call("RestoreStage", shard_pb2.RestoreStageRequest(
        deployment_id=new.deployment_id, source_address=address, snapshot=name,
        source_deployment_secret=periodic.secret)) for stage, (address, name) in zip(new.stages, sources)))
    moved = sum(answer.bytes for answer in restored)
    await asyncio.gather(*(_drop(stages[s], name) for s in range(count) if alive[s]
                           for name in (periodic.name, f"{periodic.name}-of-{(s - 1) % count}")))
    return handle, Recovery(tuple(stages[s].address for s in dead), tuple(new.stages[s].address for s in dead),
                            0, moved, time.perf_counter() - started)
