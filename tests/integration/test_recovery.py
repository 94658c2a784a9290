"""Training survives a dead shard. With replicas a spare takes its place, restores the stage from a live replica,
and the steps the survivors had not applied run again: the weights end as if nothing had happened. Without, with
snapshot_every, the model goes back to its last snapshots and the steps since are trained again."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import socket
import threading
import time

import pytest
import torch
from torch import nn

from client_sdk import Cluster, recovery
from shardtrain import auth, errors
from shardtrain.rpc import SHARD_SERVICE, Peer
from shardtrain.settings import Security, Timeouts
from shardtrain.v1 import shard_pb2
from tests.integration.test_errors import kill_shard
from tests.integration.training import largest_difference, regression_batches

ADAM = (torch.optim.Adam, {"lr": 0.01})
STEPS, KILLED_IN = 6, 3  # the shard dies during the fourth train_step call (or just before it)
SIMULATED_MS = 100  # per forward and backward: a step of 2 micro-batches over 2 stages takes about 0.6 s


def reference_model() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def schedule(optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A learning rate that changes every step: a step run again must apply the one of its time."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def trained_locally(batches) -> dict[str, torch.Tensor]:
    local = copy.deepcopy(reference_model())
    optimizer = torch.optim.Adam(local.parameters(), lr=0.01)
    rates = schedule(optimizer)
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(local(x), y).backward()
        optimizer.step()
        rates.step()
    return local.state_dict()


@pytest.fixture
def spared_cluster(monkeypatch):
    """Two replicas of two stages on four shards, and one spare; every forward and backward takes 100 ms more."""
    monkeypatch.setenv("SHARDTRAIN_SIMULATE_COMPUTE_MS", str(SIMULATED_MS))
    cluster = Cluster.local(num_shards=4, spares=1)
    logs = cluster._services.log_dir
    yield cluster
    cluster.close()
    shutil.rmtree(logs, ignore_errors=True)  # kept by close() because a shard died: here on purpose


def train_with_a_kill(cluster, batches, replica: int, stage: int, after_seconds: float | None) -> tuple:
    """Trains with train_step, SIGKILLing the shard of (replica, stage) `after_seconds` into call KILLED_IN (None:
    just before it). Returns (the model, the victim's address, how long that call took)."""
    model = cluster.deploy(reference_model(), optimizer=ADAM, num_stages=2, replicas=2)
    rates = schedule(model.optimizer)
    victim = model._trainer.replicas[replica].stages[stage].address
    took = 0.0
    for index, (x, y) in enumerate(batches):
        started = time.monotonic()
        if index == KILLED_IN:
            if after_seconds is None:
                kill_shard(cluster, victim)
            else:
                threading.Timer(after_seconds, kill_shard, (cluster, victim)).start()
        model.train_step(x, y, "MSELoss", microbatches=2)
        rates.step()
        if index == KILLED_IN:
            took = time.monotonic() - started
    return model, victim, took


@pytest.mark.parametrize("replica, stage, after_seconds", [
    (0, 1, None),   # between steps: the previous step's backwards and all-reduce may still be under way
    (1, 0, 0.1),    # in a forward
    (0, 0, 0.35),   # in a backward, on the shard that hosts the stage's all-reduce rendezvous
    (1, 1, 0.55),   # late in the step: all-reduce or optimizer step
])
def test_a_dead_shard_is_replaced_from_a_live_replica_and_training_ends_as_if_it_had_not_died(
        spared_cluster, replica, stage, after_seconds):
    batches = regression_batches(steps=STEPS, batch=20, features=4)
    model, victim, took = train_with_a_kill(spared_cluster, batches, replica, stage, after_seconds)
    assert largest_difference(model.state_dict(), trained_locally(batches)) <= 1e-6
    addresses = {clients.stages[s].address for clients in model._trainer.replicas for s in range(2)}
    spare = set(spared_cluster._services.shard_addresses) - addresses - {victim}
    assert victim not in addresses and not spare, "the spare took the dead shard's place, the others kept theirs"
    assert took < 30
    [record] = model.recoveries
    assert record.dead == (victim,) and record.replaced_by[0] in addresses
    # The call under way, and the one before if its step had not settled (a late kill may also come after it did).
    assert record.steps_run_again <= 2 and record.bytes_moved > 0 and record.seconds > 0


def test_fp16_training_keeps_its_loss_scaler_across_a_replaced_shard(spared_cluster):
    batches = regression_batches(steps=4, batch=20, features=4)
    model = spared_cluster.deploy(reference_model(), optimizer=ADAM, num_stages=2, replicas=2, precision="fp16")
    scaler = model.loss_scaler
    for index, (x, y) in enumerate(batches):
        if index == 2:
            kill_shard(spared_cluster, model._trainer.replicas[1].stages[0].address)
        loss = model.train_step(x, y, "MSELoss", microbatches=2)
        assert torch.isfinite(torch.tensor(loss))
    assert len(model.recoveries) == 1 and model.loss_scaler is scaler and scaler.scale > 1


def test_without_a_spare_the_step_fails_naming_the_dead_shard_and_a_shard_started_later_takes_its_place(
        own_cluster):
    own_cluster.wait_for_shards(2)
    model = own_cluster.deploy(reference_model(), optimizer=ADAM, num_stages=1, replicas=2)
    rates = schedule(model.optimizer)
    batches = regression_batches(steps=4, batch=20, features=4)
    x, y = batches[0]
    model.train_step(x, y, "MSELoss")
    rates.step()
    victim = model._trainer.replicas[1].stages[0].address
    kill_shard(own_cluster, victim)
    x, y = batches[1]
    with pytest.raises(errors.Unavailable, match=rf"{victim}.*did not answer, and no shard could take its place"):
        model.train_step(x, y, "MSELoss")
    own_cluster._services.add_shard()
    for x, y in batches[1:]:  # the failed call is made again, as a script would after starting a shard
        model.train_step(x, y, "MSELoss")
        rates.step()
    assert largest_difference(model.state_dict(), trained_locally(batches)) <= 1e-6


async def peer_with_secret(address: str, security, secret: str) -> Peer:
    """A client of the shard at `address` whose calls carry `secret` (made on the SDK's loop, as channels must)."""
    peer = Peer(f"shard at {address}", address, SHARD_SERVICE, security, 10)
    peer.metadata = auth.with_deployment(peer.metadata, secret)
    return peer


def test_snapshot_calls_refuse_bad_input_and_the_shard_serves_on(cluster4):
    model = cluster4.deploy(reference_model(), optimizer=ADAM, num_stages=2)
    first, second = model._clients.stages
    deployment, secret = model.deployment_id, model._clients.secret
    run = model._io.run
    with pytest.raises(errors.InvalidArgument, match="snapshot name 'no/slash' must be 1 to 64 of"):
        run(first.call("Snapshot", shard_pb2.SnapshotRequest(deployment_id=deployment, name="no/slash")))
    taken = run(first.call("Snapshot", shard_pb2.SnapshotRequest(deployment_id=deployment, name="s0", copy=True)))
    assert (taken.stage, taken.optimizer_step, list(taken.layer_indexes)) == (0, 0, [0])
    assert taken.bytes == 4 * 16 * 4 + 16 * 4  # the first Linear's weights; Adam keeps no state before a step
    with pytest.raises(errors.NotFound, match=r"no snapshot 'missing' is held here; held: \['s0'\]"):
        run(second.call("RestoreStage", shard_pb2.RestoreStageRequest(
            deployment_id=deployment, source_address=first.address, snapshot="missing",
            source_deployment_secret=secret)))
    with pytest.raises(errors.InvalidArgument, match=r"snapshot 's0' holds layers \[0\]; this stage holds layers"):
        run(second.call("RestoreStage", shard_pb2.RestoreStageRequest(
            deployment_id=deployment, source_address=first.address, snapshot="s0", source_deployment_secret=secret)))
    with pytest.raises(errors.PermissionDenied, match="must carry its secret"):
        run(second.call("RestoreStage", shard_pb2.RestoreStageRequest(
            deployment_id=deployment, source_address=first.address, snapshot="s0", source_deployment_secret="x")))
    stranger = run(peer_with_secret(first.address, cluster4.security, "not-the-secret"))
    with pytest.raises(errors.PermissionDenied, match="must carry its secret"):
        run(stranger.call("DropSnapshot", shard_pb2.DropSnapshotRequest(name="s0")))
    run(stranger.close())
    assert run(first.call("DropSnapshot", shard_pb2.DropSnapshotRequest(name="s0"))).dropped
    assert not run(first.call("DropSnapshot", shard_pb2.DropSnapshotRequest(name="s0"))).dropped
    x, y = regression_batches(steps=1, batch=8, features=4)[0]
    assert model.train_step(x, y, "MSELoss") > 0  # both shards serve on


def test_a_stage_restores_from_its_own_snapshot_exactly(cluster4):
    model = cluster4.deploy(reference_model(), optimizer=ADAM, num_stages=2)
    batches = regression_batches(steps=3, batch=8, features=4)
    model.train_step(*batches[0], "MSELoss")
    model.synchronize()  # train_step returns with its loss, before the optimizer step settles
    first = model._clients.stages[0]
    request = shard_pb2.SnapshotRequest(deployment_id=model.deployment_id, name="kept", copy=True)
    assert model._io.run(first.call("Snapshot", request)).optimizer_step == 1
    before = (model.state_dict(), model.optimizer_state_dict())
    model.train_step(*batches[1], "MSELoss")
    model.synchronize()  # its optimizer step applied: the restore must undo it, not race it
    restored = model._io.run(first.call("RestoreStage", shard_pb2.RestoreStageRequest(
        deployment_id=model.deployment_id, source_address=first.address, snapshot="kept",
        source_deployment_secret=model._clients.secret)))
    assert (restored.optimizer_step, restored.bytes) == (1, 0)  # nothing moved: it was held here
    after = model.state_dict()
    assert all(torch.equal(after[key], before[0][key]) for key in ("0.weight", "0.bias"))
    assert not torch.equal(after["2.weight"], before[0]["2.weight"])  # stage 1 was not restored
    state = model.optimizer_state_dict()["state"]
    assert torch.equal(state[0]["exp_avg"], before[1]["state"][0]["exp_avg"])
    model._io.run(first.call("DropSnapshot", shard_pb2.DropSnapshotRequest(name="kept")))


@pytest.fixture
def cluster_with_a_spare():
    """Three shards for three stages, and one spare."""
    cluster = Cluster.local(num_shards=3, spares=1)
    logs = cluster._services.log_dir
    yield cluster
    cluster.close()
    shutil.rmtree(logs, ignore_errors=True)


def plain_reference(batches) -> dict[str, torch.Tensor]:
    local = copy.deepcopy(reference_model())
    optimizer = torch.optim.Adam(local.parameters(), lr=0.01)
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(local(x), y).backward()
        optimizer.step()
    return local.state_dict()


@pytest.mark.parametrize("stage", [1, 2])  # the copy of stage 2's snapshot is on stage 0's shard
def test_without_replicas_a_dead_shard_sends_the_model_back_to_its_last_snapshot(cluster_with_a_spare, stage):
    batches = regression_batches(steps=7, batch=20, features=4)
    model = cluster_with_a_spare.deploy(reference_model(), optimizer=ADAM, num_stages=3, snapshot_every=2)
    victim = model._clients.stages[stage].address
    index, rolled_back = 0, []
    while index < len(batches):
        if index == 5 and not rolled_back:
            kill_shard(cluster_with_a_spare, victim)
        try:
            model.train_step(*batches[index], "MSELoss", microbatches=2)
            index += 1
        except errors.RolledBack as error:
            rolled_back.append(error)
            index = error.resume_step  # the script trains again from there
    [error] = rolled_back
    assert error.resume_step == 4 == model.steps_done - 3 and f"{victim} died" in str(error)
    [record] = model.recoveries
    assert record.dead == (victim,) and record.steps_run_again == 1 and record.bytes_moved > 0
    assert largest_difference(model.state_dict(), plain_reference(batches)) <= 1e-6


def test_a_call_made_again_after_a_roll_back_applies_the_learning_rate_of_its_time(cluster_with_a_spare):
    """The shard dies just after the snapshot of call 4, so call 4 fails and is the first made again: the rate the
    script set for it was sent with the failed call, but the stages went back to the snapshot, which holds call 3's."""
    batches = regression_batches(steps=6, batch=20, features=4)
    model = cluster_with_a_spare.deploy(reference_model(), optimizer=ADAM, num_stages=3, snapshot_every=2)
    index, rolled_back = 0, []
    while index < len(batches):
        if index == 4 and not rolled_back:
            kill_shard(cluster_with_a_spare, model._clients.stages[1].address)
        model.optimizer.param_groups[0]["lr"] = 0.01 / (1 + index)
        try:
            model.train_step(*batches[index], "MSELoss", microbatches=2)
            index += 1
        except errors.RolledBack as error:
            rolled_back.append(error)
            index = error.resume_step
    assert [error.resume_step for error in rolled_back] == [4]
    assert largest_difference(model.state_dict(), trained_locally(batches)) <= 1e-6


def test_a_shard_that_dies_while_the_stages_snapshot_fails_the_call_and_no_roll_back_mixes_two_steps(
        cluster_with_a_spare, monkeypatch):
    """Stage 1's shard dies as the stages take the snapshots due after call 4: stages 0 and 2 replace theirs with
    step 4's, while stage 1's state survives only in the copy of step 2's. No whole snapshot is left, so the call
    fails, and so does the next, rather than a roll-back to that mix."""
    batches = regression_batches(steps=6, batch=20, features=4)
    model = cluster_with_a_spare.deploy(reference_model(), optimizer=ADAM, num_stages=3, snapshot_every=2)
    victim, take = model._clients.stages[1].address, recovery.take_snapshots

    async def shard_dies_first(clients, steps_done):
        if steps_done == 4:
            kill_shard(cluster_with_a_spare, victim)
        return await take(clients, steps_done)
    monkeypatch.setattr(recovery, "take_snapshots", shard_dies_first)
    for x, y in batches[:3]:
        model.train_step(x, y, "MSELoss", microbatches=2)
    for attempt in range(2):
        with pytest.raises(errors.ShardtrainError) as raised:
            model.train_step(*batches[3], "MSELoss", microbatches=2)
        assert not isinstance(raised.value, errors.RolledBack) and not model.recoveries


def test_fit_trains_again_on_the_batches_a_roll_back_undid(cluster_with_a_spare):
    batches = regression_batches(steps=7, batch=20, features=4)
    model = cluster_with_a_spare.deploy(reference_model(), optimizer=ADAM, num_stages=3, snapshot_every=3)
    victim = model._clients.stages[0].address

    def kill_after_step_five(history, record):
        if record.step == 5:
            kill_shard(cluster_with_a_spare, victim)
    history = model.fit(batches, loss_fn="MSELoss", microbatches=2, callbacks=[kill_after_step_five], progress=False)
    assert [record.step for record in history.steps] == list(range(1, 8)) and model.steps_done == 7
    assert len(model.recoveries) == 1 and model.recoveries[0].steps_run_again == 2
    assert largest_difference(model.state_dict(), plain_reference(batches)) <= 1e-6


def test_snapshot_every_must_be_a_count(cluster4):
    with pytest.raises(errors.InvalidArgument, match="snapshot_every must be a whole number >= 0, got -1"):
        cluster4.deploy(reference_model(), snapshot_every=-1)


def test_a_shard_keeps_the_snapshots_of_its_deployment_and_the_one_before_only(cluster4):
    model = cluster4.deploy(reference_model(), optimizer=ADAM, num_stages=1)
    shard, secret = model._clients.stages[0].address, model._clients.secret
    run = model._io.run
    run(model._clients.stages[0].call("Snapshot", shard_pb2.SnapshotRequest(deployment_id=model.deployment_id,
                                                                             name="first", copy=True)))
    owner = run(peer_with_secret(shard, cluster4.security, secret))
    try:
        later = cluster4.deploy(reference_model(), optimizer=ADAM, num_stages=1)
        assert later._clients.stages[0].address == shard
        with pytest.raises(errors.PermissionDenied, match="snapshot 'first' belongs to deployment"):
            run(later._clients.stages[0].call("Snapshot", shard_pb2.SnapshotRequest(
                deployment_id=later.deployment_id, name="first", copy=True)))
        cluster4.deploy(reference_model(), optimizer=ADAM, num_stages=1)  # two deployments later: gone
        assert not run(owner.call("DropSnapshot", shard_pb2.DropSnapshotRequest(name="first"))).dropped
    finally:
        run(owner.close())


def test_a_shard_reads_snapshots_only_from_shards_of_its_deployment_and_only_for_its_owner():
    """RestoreStage and CopySnapshot make a shard call another with the shard role's token: a client, even the
    owner, cannot aim that call at an address outside the deployment, and without the deployment's secret
    cannot make it at all. The coordinator likewise calls only shards that registered."""
    roles = Security(token="client-token", shard_token="shard-token")
    bait = socket.create_server(("127.0.0.1", 0))  # would see the shard's call, token and all
    bait.setblocking(False)
    elsewhere = f"127.0.0.1:{bait.getsockname()[1]}"
    with bait, Cluster.local(num_shards=2, security=roles) as cluster:
        model = cluster.deploy(reference_model(), optimizer=ADAM, num_stages=2)
        first, second = model._clients.stages
        deployment, secret, run = model.deployment_id, model._clients.secret, model._io.run
        run(first.call("Snapshot", shard_pb2.SnapshotRequest(deployment_id=deployment, name="s0", copy=True)))
        aimed = [("CopySnapshot", shard_pb2.CopySnapshotRequest(name="stolen", source_address=elsewhere,
                                                                snapshot="s0", source_deployment_secret=secret)),
                 ("RestoreStage", shard_pb2.RestoreStageRequest(deployment_id=deployment, source_address=elsewhere,
                                                                snapshot="s0", source_deployment_secret=secret))]
        for method, request in aimed:  # the owner's client, with the secret: still not to that address
            with pytest.raises(errors.PermissionDenied, match=f"'{elsewhere}' is not a shard of this shard's "
                                                              "deployment"):
                run(second.call(method, request))
        stranger = run(peer_with_secret(second.address, roles, ""))  # the client token alone
        for source in (elsewhere, first.address):
            with pytest.raises(errors.PermissionDenied, match="must carry its secret"):
                run(stranger.call("CopySnapshot", shard_pb2.CopySnapshotRequest(
                    name="stolen", source_address=source, snapshot="s0", source_deployment_secret=secret)))
        run(stranger.close())
        copied = run(second.call("CopySnapshot", shard_pb2.CopySnapshotRequest(
            name="kept", source_address=first.address, snapshot="s0", source_deployment_secret=secret)))
        assert copied.stage == 0 and copied.bytes > 0  # a shard of the deployment: read as before
        split = [p.end_layer - p.first_layer for p in model.placements]
        again, _ = run(model._redeploy([elsewhere, first.address], split))  # an unregistered address is no choice
        assert [stage.address for stage in again[0].stages] == [second.address, first.address]
        with pytest.raises(BlockingIOError):
            bait.accept()  # nothing called it


def test_a_shard_stopped_before_the_last_step_settled_is_replaced_by_the_next_train_step_not_waited_for():
    """SIGSTOP on a shard right after train_step returned (its loss comes before the step's backward and
    optimizer step are over): that step never settles on the stopped shard's replica. The next train_step waits
    for it no longer than the deadline, finds the stopped shard and goes on without it."""
    batches = regression_batches(steps=STEPS, batch=20, features=4)
    timeouts = Timeouts(rpc=4.0, peer_wait=4.0, probe=1.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHARDTRAIN_SIMULATE_COMPUTE_MS", str(SIMULATED_MS))
        cluster = Cluster.local(num_shards=4, spares=1, timeouts=timeouts)
    logs = cluster._services.log_dir
    try:
        model = cluster.deploy(reference_model(), optimizer=ADAM, num_stages=2, replicas=2)
        rates = schedule(model.optimizer)
        victim = next(s for s in cluster._services.services
                      if s.address == model._trainer.replicas[0].stages[0].address)
        for index, (x, y) in enumerate(batches):
            model.train_step(x, y, "MSELoss", microbatches=2)
            rates.step()
            if index == KILLED_IN:
                os.kill(victim.process.pid, signal.SIGSTOP)
        assert largest_difference(model.state_dict(), trained_locally(batches)) <= 1e-6
        [record] = model.recoveries
        assert record.dead == (victim.address,)
    finally:
        victim.process.kill()
        victim.process.wait()
        cluster.close()
        shutil.rmtree(logs, ignore_errors=True)
