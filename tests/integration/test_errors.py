"""Bad input gets a clear error with the right status code; the shard keeps serving and the next step works."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from shardtrain import errors
from shardtrain.v1 import shard_pb2
from tests.integration.training import regression_batches, train_remotely


class Picky(nn.Module):
    """A layer that fails on its data: values of 100 or more are refused at run time."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        torch._assert_async(x.abs().max() < 100, "input values must stay below 100")
        return self.linear(x)


@pytest.fixture
def picky_model(cluster4):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), Picky(), nn.Linear(4, 1))
    return cluster4.deploy(net, optimizer=(torch.optim.SGD, {"lr": 0.01}), num_stages=3)


def a_good_step_works(model) -> None:
    """One full training step succeeds and changes the weights."""
    before = model.state_dict()
    train_remotely(model, regression_batches(steps=1, batch=4, features=3))
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_wrong_input_shape_names_stage_and_expected_shape(picky_model):
    with pytest.raises(errors.InvalidArgument, match=r"stage 0 input .*expected float32 of shape \[batch, 3\], "
                                                     r"got float32 of shape \[4, 5\]") as caught:
        picky_model(torch.randn(4, 5))
    assert "127.0.0.1:" in str(caught.value)
    a_good_step_works(picky_model)


def test_wrong_input_dtype(picky_model):
    with pytest.raises(errors.InvalidArgument, match="expected float32 .* got float64"):
        picky_model(torch.randn(4, 3, dtype=torch.float64))
    a_good_step_works(picky_model)


def test_a_stage_that_raises_names_the_stage_and_the_cause(picky_model):
    with pytest.raises(errors.InternalError,
                       match=r"stage 1 \(layers 1-1\) failed: .*input values must stay below 100"):
        picky_model(torch.full((4, 3), 1e4))
    a_good_step_works(picky_model)


def test_backward_of_an_unknown_step_is_not_found(picky_model):
    request = picky_model._clients.backward(10_000, torch.zeros(4, 1))
    with pytest.raises(errors.NotFound, match="no step 10000 micro-batch 0 in flight"):
        picky_model._io.run(request)
    a_good_step_works(picky_model)


def test_wrong_gradient_shape_fails_backward_and_nothing_is_stepped(picky_model):
    before = picky_model.state_dict()
    pred = picky_model(torch.randn(4, 3))
    picky_model._script_loop.remote_backward(picky_model._call_order.last_step, torch.zeros(4, 7))
    with pytest.raises(errors.InvalidArgument, match=r"output gradient: expected torch.float32 of shape \[4, 1\]"):
        picky_model.step()
        picky_model.synchronize()
    after = picky_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed backward must not step any stage"
    del pred
    a_good_step_works(picky_model)


def test_handle_of_a_replaced_deployment_is_refused(cluster4):
    old = cluster4.deploy(nn.Sequential(nn.Linear(2, 2)), num_stages=1)
    # Someone else redeploys on the same shards.
    with Cluster.connect(cluster4.address, cluster4.security) as other_client:
        other_client.deploy(nn.Sequential(nn.Linear(2, 3)), num_stages=1)
    with pytest.raises(errors.FailedPrecondition, match="holds deployment .* the model was redeployed"):
        old(torch.randn(1, 2))
    cluster4.deploy(nn.Sequential(nn.Linear(2, 2)), num_stages=1)  # this client redeploys: its old handle closes
    with pytest.raises(errors.FailedPrecondition, match="is closed: .*deployed another model"):
        old(torch.randn(1, 2))


def test_a_model_refused_before_it_is_sent_leaves_the_working_deployment_training(cluster4):
    """A notebook's next attempt that cannot be captured, or names a bad option, must not cost the model that
    trains: only a deploy sent to the coordinator replaces it."""
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x) if x.sum() > 0 else x
    torch.manual_seed(0)
    working = cluster4.deploy(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), num_stages=2)
    batches = regression_batches(steps=2, batch=8, features=4)
    train_remotely(working, batches[:1])
    with pytest.raises(errors.InvalidArgument, match="cannot be captured"):
        cluster4.deploy(DataDependent(), example_input=torch.randn(2, 4))
    with pytest.raises(errors.InvalidArgument, match="balance must be one of"):
        cluster4.deploy(nn.Sequential(nn.Linear(4, 1)), balance="evenly")
    with pytest.raises(errors.InvalidArgument, match="not allowed"):
        cluster4.deploy(nn.Sequential(nn.Linear(4, 1)), optimizer=("Lion", {"lr": 0.1}))
    train_remotely(working, batches[1:])
    assert set(working.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_a_deploy_the_coordinator_refuses_leaves_the_working_deployment_training(cluster4):
    torch.manual_seed(0)
    working = cluster4.deploy(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), num_stages=2)
    batches = regression_batches(steps=2, batch=8, features=4)
    train_remotely(working, batches[:1])
    with pytest.raises(errors.FailedPrecondition, match="9 stages need 9 shards but 4 have registered"):
        cluster4.deploy(nn.Sequential(*[nn.Linear(4, 4) for _ in range(9)]), num_stages=9)
    train_remotely(working, batches[1:])
    assert set(working.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_optimizer_outside_the_allow_list_is_refused(cluster4):
    class Mine(torch.optim.SGD):
        pass

    with pytest.raises(errors.InvalidArgument, match="not allowed"):
        cluster4.deploy(nn.Sequential(nn.Linear(2, 2)), optimizer=(Mine, {"lr": 0.1}))
    with pytest.raises(errors.InvalidArgument, match="cannot build SGD"):
        cluster4.deploy(nn.Sequential(nn.Linear(2, 2)), optimizer=(torch.optim.SGD, {"lr": 0.1, "bogus": 1}))


def test_more_stages_than_shards_is_refused(cluster4):
    with pytest.raises(errors.InvalidArgument, match="5 stages asked for but only 4 shards"):
        cluster4.deploy(nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)]), split_points=[1, 2, 3, 4])


def test_unknown_state_dict_keys_are_refused(cluster4):
    model = cluster4.deploy(nn.Sequential(nn.Linear(2, 2)), num_stages=1)
    with pytest.raises(errors.InvalidArgument, match=r"unexpected keys \['9.weight'\]"):
        model.load_state_dict({"9.weight": torch.zeros(2, 2)})
    with pytest.raises(errors.InvalidArgument, match=r"weight '0.weight': expected .* shape \[2, 2\]"):
        model.load_state_dict({"0.weight": torch.zeros(3, 3), "0.bias": torch.zeros(2)})


def test_a_stage_sent_straight_to_a_shard_is_refused_and_the_shard_serves_on(cluster4):
    """LoadStage comes only from the coordinator (a tampered program sent through it: test_hostile_programs.py)."""
    model = cluster4.deploy(nn.Sequential(nn.Linear(2, 2)), num_stages=1)
    shard = model._clients.stages[0]
    layer = shard_pb2.CapturedLayer(index=0, program=b'{"graph_module": {"graph": {"nodes": [{"target": '
                                                     b'"torch.os.system", "metadata": {}}]}}}')
    request = shard_pb2.LoadStageRequest(deployment_id="evil", plan=shard_pb2.StagePlan(stage=0, num_stages=1),
                                         layers=[layer], optimizer=shard_pb2.OptimizerSpec(name="SGD"))
    with pytest.raises(errors.PermissionDenied, match="LoadStage comes only from the coordinator"):
        model._io.run(shard.call("LoadStage", request))
    a_good_step_works_on = model(torch.randn(1, 2))  # the shard kept its stage and serves on
    assert a_good_step_works_on.shape == (1, 2)


def test_nothing_listening_is_unavailable_with_the_address():
    with pytest.raises(errors.Unavailable, match=r"coordinator at 127.0.0.1:1 is unavailable"):
        Cluster.connect("127.0.0.1:1")


def kill_shard(cluster: Cluster, address: str) -> None:
    """SIGKILLs the local shard process serving at `address` and waits until it is gone."""
    service = next(s for s in cluster._services.services if s.address == address)
    service.process.kill()
    service.process.wait()


def trained_then_stage_one_killed(cluster: Cluster, num_stages: int, steps: int):
    """A small model trained for `steps` steps over `num_stages` stages, then the shard of its stage 1
    SIGKILLed: (the model, that shard's address)."""
    torch.manual_seed(0)
    model = cluster.deploy(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1)), num_stages=num_stages)
    train_remotely(model, regression_batches(steps=steps, batch=2, features=2))
    victim = model.placements[1].shard_address
    kill_shard(cluster, victim)
    return model, victim


def test_a_dead_shard_makes_the_call_fail_with_its_address(own_cluster):
    model, victim = trained_then_stage_one_killed(own_cluster, num_stages=2, steps=1)
    with pytest.raises(errors.Unavailable, match=rf"{victim} .*is unavailable"):
        model(torch.randn(2, 2))


def test_a_cluster_removes_its_logs_at_close_unless_a_service_had_died():
    with Cluster.local(num_shards=1) as clean:
        clean_logs = clean._services.log_dir
        assert (clean_logs / "shard-0.log").exists()
    assert not clean_logs.exists()
    crashed = Cluster.local(num_shards=1)
    crashed_logs = crashed._services.log_dir
    try:
        kill_shard(crashed, crashed._services.services[1].address)
    finally:
        crashed.close()
    try:
        assert (crashed_logs / "shard-0.log").exists(), "the dead shard's log stays for debugging"
    finally:
        shutil.rmtree(crashed_logs)


@pytest.mark.parametrize("own_cluster", [3], indirect=True)
def test_a_dead_middle_shard_fails_the_next_step_with_its_address_not_a_hang(own_cluster):
    """The SDK has no link to a middle stage: the stages around it report it, over their own links."""
    model, victim = trained_then_stage_one_killed(own_cluster, num_stages=3, steps=2)
    started = time.monotonic()
    with pytest.raises(errors.Unavailable, match=rf"shard at {victim}.* is unavailable"):
        for _ in range(2):  # the first call may already see the news; the second at the latest
            model(torch.randn(2, 2)).sum().backward()
            model.step()
            model.synchronize()
    assert time.monotonic() - started < 30
