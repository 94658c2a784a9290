"""Each service's Prometheus endpoint (--metrics-port): scraped after training, its counts say what ran, what moved
on which path, every request answered and refused; each role exports its own families and those docs/operations.md
lists, in text `promtool check metrics` passes; without the flag there is no endpoint."""

from __future__ import annotations

import asyncio
import pathlib
import re
import shutil
import subprocess
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from client_sdk import Cluster
from shardtrain import errors, rpc
from shardtrain.settings import Security
from shardtrain.v1 import coordinator_pb2
from tests.integration.training import regression_batches

OPERATIONS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md"
PROMTOOL = shutil.which("promtool")
# Beside shardtrain's own: prometheus_client's process, platform and garbage collector families.
STANDARD = {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds",
            "process_open_fds", "python_info", "python_gc_collections_total", "python_gc_objects_collected_total"}


def exposition(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(exposition(url)) for sample in family.samples}


def families(text: str) -> set[str]:
    """The names of the families in an exposition, as its TYPE lines give them (counters with _total)."""
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))


def total(samples: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(value for (sample, have), value in samples.items()
               if sample == name and set(labels.items()) <= set(have))


def documented() -> dict[str, set[str]]:
    """The families docs/operations.md's metrics table lists, by the roles its "Exported by" column names."""
    section = OPERATIONS.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    by_role: dict[str, set[str]] = {"shard": set(), "coordinator": set()}
    for name, roles in re.findall(r"^\| `(shardtrain_\w+)` \|[^|]*\|[^|]*\| ([^|]+) \|", section, re.MULTILINE):
        for role in by_role:
            if role in roles or "both" in roles:
                by_role[role].add(name)
    return by_role


@pytest.fixture(scope="module")
def measured():
    with Cluster.local(num_shards=3, metrics=True) as cluster:
        yield cluster


def deploy_and_train(cluster, steps: int = 3):
    model = cluster.deploy(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)),
                           optimizer=(torch.optim.SGD, {"lr": 0.1}), num_stages=3)
    urls = [cluster.metrics_urls[placement.shard_address] for placement in model.placements]  # stage order
    before = [scrape(url) for url in urls]
    for x, y in regression_batches(steps=steps, batch=16, features=4, outputs=2):
        model.train_step(x, y, "MSELoss", microbatches=4, schedule="zb-h1")
    model.state_dict()  # the optimizer steps are over everywhere once the weights can be read
    return urls, before


def test_a_scrape_counts_the_work_the_steps_and_the_items_of_a_few_steps(measured):
    cluster = measured
    urls, before = deploy_and_train(cluster)
    after = [scrape(url) for url in urls]
    assert len(after) == 3
    for stage, (old, new) in enumerate(zip(before, after)):
        def grew(name, **labels):
            return total(new, name, **labels) - total(old, name, **labels)
        assert grew("shardtrain_work_seconds_count", work="forward") == 12
        assert grew("shardtrain_work_seconds_count", work="backward_input") == 12
        assert grew("shardtrain_work_seconds_count", work="backward_weight") == 12
        assert grew("shardtrain_work_seconds_count", work="step") == 3
        assert grew("shardtrain_work_seconds_sum", work="forward") > 0
        assert total(new, "shardtrain_work_seconds_count", work="stage") >= 1  # building it, in snake_case
        assert total(new, "shardtrain_work_seconds_bucket", work="forward", le="+Inf") == \
            total(new, "shardtrain_work_seconds_count", work="forward")
        assert total(new, "shardtrain_work_seconds_bucket", work="forward", le="0.0005") <= \
            total(new, "shardtrain_work_seconds_bucket", work="forward", le="30.0")
        assert grew("shardtrain_step_seconds_count") == 3
        assert grew("shardtrain_step_seconds_sum") > 0
        assert grew("shardtrain_samples_total") == 3 * 16, f"stage {stage}: every row of every step"
        received = grew("shardtrain_link_items_total", direction="received", kind="forward")
        assert received == 12, f"stage {stage} received {received} forward items"
        assert grew("shardtrain_tensor_bytes_total", direction="received", kind="forward") >= 12 * 4 * 4
        if stage > 0:
            assert grew("shardtrain_link_items_total", direction="sent", kind="backward") == 12
            # Shards on one host: their links carry items on a local socket, or tensors in shared memory.
            assert grew("shardtrain_link_items_total", direction="received", kind="forward", path="grpc") == 0
        assert total(new, "shardtrain_links_open") >= 1
        assert total(new, "shardtrain_activation_bytes") == 0  # nothing in flight between steps
        assert grew("shardtrain_requests_total", method="ReadState", code="OK") == 1  # state_dict()
    coordinator = scrape(cluster.metrics_urls[cluster.address])
    assert total(coordinator, "shardtrain_registered_shards") == 3
    assert total(coordinator, "shardtrain_deploys_total") >= 1
    assert total(coordinator, "shardtrain_requests_total", method="Deploy", code="OK") >= 1


def test_every_request_is_counted_by_method_and_code_and_timed(measured):
    cluster = measured
    url = cluster.metrics_urls[cluster.address]
    before = scrape(url)
    good = coordinator_pb2.PlanScheduleRequest(num_stages=2, microbatches=2, schedule="gpipe")
    cluster._io.run(cluster._coordinator.call("PlanSchedule", good))
    with pytest.raises(errors.InvalidArgument, match="zigzag"):
        bad = coordinator_pb2.PlanScheduleRequest(num_stages=2, microbatches=2, schedule="zigzag")
        cluster._io.run(cluster._coordinator.call("PlanSchedule", bad))

    async def without_the_token() -> None:  # refused by the token check, before any servicer runs
        stranger = rpc.Peer("coordinator", cluster.address, rpc.COORDINATOR_SERVICE, Security(token="wrong"), 10)
        try:
            with pytest.raises(errors.Unauthenticated):
                await stranger.call("PlanSchedule", good)
        finally:
            await stranger.close()
    asyncio.run(without_the_token())
    after = scrape(url)

    def grew(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)
    for code in ("OK", "INVALID_ARGUMENT", "UNAUTHENTICATED"):
        assert grew("shardtrain_requests_total", method="PlanSchedule", code=code) == 1, code
    assert grew("shardtrain_request_seconds_count", method="PlanSchedule") == 3
    assert grew("shardtrain_request_seconds_bucket", method="PlanSchedule", le="+Inf") == 3
    assert grew("shardtrain_request_seconds_sum", method="PlanSchedule") > 0


def test_each_role_exports_its_own_families_and_those_the_docs_list(measured):
    cluster = measured
    urls, _ = deploy_and_train(cluster, steps=1)
    shard = families(exposition(urls[-1]))
    coordinator = families(exposition(cluster.metrics_urls[cluster.address]))
    both = {"shardtrain_build_info", "shardtrain_requests_total", "shardtrain_request_seconds"} | STANDARD
    only_shard = {"shardtrain_work_seconds", "shardtrain_step_seconds", "shardtrain_samples_total",
                  "shardtrain_link_items_total", "shardtrain_tensor_bytes_total", "shardtrain_links_open",
                  "shardtrain_activation_bytes"}
    only_coordinator = {"shardtrain_registered_shards", "shardtrain_deploys_total"}
    assert both | only_shard <= shard and not only_coordinator & shard, shard
    assert both | only_coordinator <= coordinator and not only_shard & coordinator, coordinator
    listed = documented()
    assert listed["shard"] == {name for name in shard if name.startswith("shardtrain_")}
    assert listed["coordinator"] == {name for name in coordinator if name.startswith("shardtrain_")}
    info = scrape(cluster.metrics_urls[cluster.address])
    (labels,) = [dict(have) for name, have in info if name == "shardtrain_build_info"]
    assert labels["role"] == "coordinator" and labels["torch"].startswith(torch.__version__.split("+")[0])
    assert {"version", "grpcio", "python"} <= labels.keys()


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus; .ci/run "
                    "installs it)")
def test_promtool_finds_nothing_to_fix_in_either_roles_metrics(measured):
    cluster = measured
    urls, _ = deploy_and_train(cluster, steps=1)
    for name, url in (("shard", urls[-1]), ("coordinator", cluster.metrics_urls[cluster.address])):
        text = exposition(url)
        done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), \
            f"{name}: promtool exited {done.returncode}: {done.stdout}{done.stderr}"


def test_without_the_flag_a_service_serves_no_metrics(cluster4):
    assert cluster4.metrics_urls == {}
