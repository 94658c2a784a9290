"""Each service's Prometheus endpoint (--metrics-port): scraped after training, its counts say what ran, what moved
on which path and what was refused; without the flag there is no endpoint."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from client_sdk import Cluster
from shardtrain import errors
from shardtrain.v1 import coordinator_pb2
from tests.integration.training import regression_batches


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(value for (sample, have), value in samples.items()
               if sample == name and set(labels.items()) <= set(have))


@pytest.fixture(scope="module")
def measured():
    with Cluster.local(num_shards=3, metrics=True) as cluster:
        yield cluster


def test_a_scrape_counts_the_work_and_the_items_of_a_few_steps(measured):
    cluster = measured
    model = cluster.deploy(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)),
                           optimizer=(torch.optim.SGD, {"lr": 0.1}), num_stages=3)
    urls = [cluster.metrics_urls[placement.shard_address] for placement in model.placements]  # stage order
    before = [scrape(url) for url in urls]
    batches = regression_batches(steps=3, batch=16, features=4, outputs=2)
    for x, y in batches:
        model.train_step(x, y, "MSELoss", microbatches=4, schedule="zb-h1")
    model.state_dict()  # the optimizer steps are over everywhere once the weights can be read
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
        assert total(new, "shardtrain_work_seconds_bucket", work="forward", le="+Inf") == \
            total(new, "shardtrain_work_seconds_count", work="forward")
        assert total(new, "shardtrain_work_seconds_bucket", work="forward", le="0.0005") <= \
            total(new, "shardtrain_work_seconds_bucket", work="forward", le="30.0")
        received = grew("shardtrain_link_items_total", direction="received", kind="forward")
        assert received == 12, f"stage {stage} received {received} forward items"
        assert grew("shardtrain_tensor_bytes_total", direction="received", kind="forward") >= 12 * 4 * 4
        if stage > 0:
            assert grew("shardtrain_link_items_total", direction="sent", kind="backward") == 12
            # Shards on one host: their links carry items on a local socket, or tensors in shared memory.
            assert grew("shardtrain_link_items_total", direction="received", kind="forward", path="grpc") == 0
        assert total(new, "shardtrain_links_open") >= 1
        assert total(new, "shardtrain_activation_bytes") == 0  # nothing in flight between steps
    coordinator = scrape(cluster.metrics_urls[cluster.address])
    assert total(coordinator, "shardtrain_registered_shards") == 3
    assert total(coordinator, "shardtrain_deploys_total") == 1


def test_a_refused_request_is_counted_by_method_and_code(measured):
    cluster = measured
    before = scrape(cluster.metrics_urls[cluster.address])
    request = coordinator_pb2.PlanScheduleRequest(num_stages=2, microbatches=2, schedule="zigzag")
    with pytest.raises(errors.InvalidArgument, match="zigzag"):
        cluster._io.run(cluster._coordinator.call("PlanSchedule", request))
    after = scrape(cluster.metrics_urls[cluster.address])
    labels = {"method": "PlanSchedule", "code": "INVALID_ARGUMENT"}
    assert (total(after, "shardtrain_requests_failed_total", **labels)
            - total(before, "shardtrain_requests_failed_total", **labels)) == 1


def test_without_the_flag_a_service_serves_no_metrics(cluster4):
    assert cluster4.metrics_urls == {}
