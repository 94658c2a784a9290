"""shardtrain.slurm: SLURM's compressed host lists, and where a shard started by srun serves."""

from __future__ import annotations

import pytest

from shardtrain import slurm
from shardtrain.settings import shard_settings


@pytest.mark.parametrize("hostlist, hosts", [
    ("gpu5", ["gpu5"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a,b[2],c", ["a", "b2", "c"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("x[1-2]y", ["x1y", "x2y"]),
    ("node-1.cluster,node-2.cluster", ["node-1.cluster", "node-2.cluster"]),
])
def test_host_lists_expand_in_order(hostlist, hosts):
    assert slurm.expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist, complaint", [
    ("", "names no host"), ("node[1-3", "never closed"), ("node1-3]", "unbalanced"),
    ("node[[1]]", "nested"), ("node[3-1]", "ends before it starts"), ("node[a-b]", "not a number"),
    ("node[]", "not a number"), ("node[1,,2]", "not a number"),
])
def test_malformed_host_lists_say_what_is_wrong(hostlist, complaint):
    with pytest.raises(ValueError, match=complaint):
        slurm.expand_hostlist(hostlist)


@pytest.mark.parametrize("local_id, cuda_devices, device", [
    (0, 0, "cpu"), (3, 0, "cpu"), (0, 1, "cuda:0"), (2, 1, "cuda:0"), (0, 4, "cuda:0"), (3, 4, "cuda:3")])
def test_each_task_computes_on_its_own_gpu(local_id, cuda_devices, device):
    assert slurm.device_for(local_id, cuda_devices) == device


def test_more_tasks_than_gpus_is_refused():
    with pytest.raises(slurm.SlurmEnvironmentError, match="SLURM_LOCALID=4 but this task sees only 4 GPUs"):
        slurm.device_for(4, 4)


JOB = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_LOCALID": "2", "SLURMD_NODENAME": "gpu08"}


def test_a_shard_registers_with_the_first_node_and_advertises_its_own():
    place = slurm.shard_place(JOB, coordinator_port=50051, port=50052, cuda_devices=4)
    assert place == slurm.ShardPlace(coordinator="gpu07:50051", bind="0.0.0.0:50054", advertise="gpu08:50054",
                                     device="cuda:2")


def test_shards_of_several_stages_leave_room_for_each_and_port_0_stays_0():
    assert slurm.shard_place(JOB, 50051, 50052, 0, ports_per_shard=3).bind == "0.0.0.0:50058"
    assert slurm.shard_place(JOB, 50051, 0, 0).advertise == "gpu08:0"
    assert slurm.shard_place({**JOB, "SLURM_JOB_NODELIST": "", "SLURM_NODELIST": "c1"}, 1, 0, 0).coordinator == "c1:1"


@pytest.mark.parametrize("change, complaint", [
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NODELIST": "gpu[07"}, "SLURM_JOB_NODELIST is not a SLURM host list"),
    ({"SLURM_LOCALID": None}, "SLURM_LOCALID is not set"),
    ({"SLURM_LOCALID": "two"}, "SLURM_LOCALID='two' is not a count"),
    ({"SLURMD_NODENAME": ""}, "SLURMD_NODENAME is not set"),
])
def test_missing_or_bad_variables_are_named(change, complaint):
    env = {key: value for key, value in {**JOB, **change}.items() if value is not None}
    with pytest.raises(slurm.SlurmEnvironmentError, match=complaint):
        slurm.shard_place(env, 50051, 50052, 0)


def test_each_shard_of_a_node_serves_metrics_at_the_port_its_local_id_after_the_first():
    assert slurm.shard_place(JOB, 50051, 50052, 0, metrics_port=9401).metrics_port == 9403
    assert slurm.shard_place(JOB, 50051, 50052, 0, metrics_port=0).metrics_port == 0
    assert slurm.shard_place(JOB, 50051, 50052, 0).metrics_port is None
    assert shard_settings(["--from-slurm", "--metrics-port", "9401"], env=JOB).metrics_port == 9403
    with pytest.raises(slurm.SlurmEnvironmentError, match="metrics at port 65536, past 65535"):
        slurm.shard_place(JOB, 50051, 50052, 0, metrics_port=65534)


def test_ports_past_the_last_are_refused():
    with pytest.raises(slurm.SlurmEnvironmentError, match="port 65536, past 65535"):
        slurm.shard_place(JOB, 50051, 65534, 0)


def test_the_shard_flag_fills_its_settings_and_an_explicit_coordinator_wins():
    settings = shard_settings(["--from-slurm", "--port", "7000", "--coordinator-port", "6000"], env=JOB)
    assert (settings.coordinator, settings.bind, settings.advertise) == ("gpu07:6000", "0.0.0.0:7002", "gpu08:7002")
    assert settings.device in ("cpu", "cuda:2")
    given = shard_settings(["--coordinator", "head:1"], env={**JOB, "SHARDTRAIN_FROM_SLURM": "1"})
    assert (given.coordinator, given.bind) == ("head:1", "0.0.0.0:50054")


def test_the_shard_flag_outside_a_job_exits_naming_the_variable(capsys):
    with pytest.raises(SystemExit) as stopped:
        shard_settings(["--from-slurm"], env={})
    assert stopped.value.code == 2
    assert "--from-slurm: SLURM_JOB_NODELIST is not set" in capsys.readouterr().err
