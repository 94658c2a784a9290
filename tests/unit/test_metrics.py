"""metrics.py's records and their families, the step meter, and the status a counted request ended with."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from shard_service.step_meter import StepMeter
from shardtrain import metrics
from shardtrain.request_metrics import _code


@pytest.fixture
def recording(monkeypatch):
    """Metrics on, as a shard's, without an HTTP endpoint: the records."""
    records = metrics._Records("shard")
    monkeypatch.setattr(metrics, "_on", records)
    return records


def samples(records) -> dict[tuple, float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in records.collect() for sample in family.samples}


def test_work_is_labelled_in_snake_case_whatever_the_function_is_called(recording):
    for name in ("Stage", "_stage_state", "backward_input", "forward"):
        metrics.work(name, 0.001)
    assert {labels[0][1] for name, labels in samples(recording) if name == "shardtrain_work_seconds_count"} == \
        {"stage", "stage_state", "backward_input", "forward"}


def test_a_histogram_counts_each_value_in_its_bucket_and_every_bucket_above(recording):
    for seconds in (0.0001, 0.0005, 0.003, 100.0):
        metrics.request("Describe", "OK", seconds)
    found = samples(recording)

    def bucket(le: str) -> float:
        return found["shardtrain_request_seconds_bucket", (("le", le), ("method", "Describe"))]
    assert (bucket("0.0001"), bucket("0.0005"), bucket("0.005"), bucket("60.0"), bucket("+Inf")) == (1, 2, 3, 3, 4)
    assert found["shardtrain_request_seconds_count", (("method", "Describe"),)] == 4
    assert found["shardtrain_requests_total", (("code", "OK"), ("method", "Describe"))] == 4


def test_each_role_exports_only_its_own_families():
    shard = {family.name for family in metrics._Records("shard").collect()}
    coordinator = {family.name for family in metrics._Records("coordinator").collect()}
    assert shard & coordinator == {"shardtrain_requests", "shardtrain_request_seconds"}
    assert "shardtrain_registered_shards" in coordinator and "shardtrain_links_open" in shard
    with pytest.raises(ValueError, match="roles are"):
        metrics.serve("127.0.0.1", 0, "client")


def test_the_step_meter_times_a_step_from_its_first_forward_and_counts_its_rows(recording):
    meter = StepMeter()
    meter.stepped()  # no forward since the last step: nothing to record
    meter.forward(torch.zeros(4, 3), 0.5)
    meter.forward(torch.zeros(6, 3), 0.1)
    meter.forward(None, 0.1)  # a stage without a main input: no rows
    meter.stepped()
    meter.forward(torch.zeros(8, 3), 0.0)
    meter.clear()  # that step was refused
    found = samples(recording)
    assert found["shardtrain_step_seconds_count", ()] == 1 and found["shardtrain_step_seconds_sum", ()] >= 0.5
    assert found["shardtrain_samples_total", ()] == 10


def test_the_step_meter_records_nothing_while_metrics_are_off():
    meter = StepMeter()
    meter.forward(torch.zeros(4, 3), 0.5)
    assert meter._started is None and meter._samples == 0


class Context:
    """What _code reads of a call's context: the code set, and the time left."""

    def __init__(self, code=None, remaining=None):
        self._code, self._remaining = code, remaining

    def code(self):
        return self._code

    def time_remaining(self):
        return self._remaining


@pytest.mark.parametrize("context, error, code", [
    (Context(), None, "OK"),
    (Context(grpc.StatusCode.INVALID_ARGUMENT), Exception("aborted"), "INVALID_ARGUMENT"),
    (Context(remaining=0.0), asyncio.CancelledError(), "DEADLINE_EXCEEDED"),
    (Context(remaining=5.0), asyncio.CancelledError(), "CANCELLED"),
    (Context(), GeneratorExit(), "CANCELLED"),
    (Context(), RuntimeError("a bug"), "UNKNOWN"),
])
def test_a_call_is_counted_under_the_code_it_ended_with(context, error, code):
    assert _code(context, error) == code
