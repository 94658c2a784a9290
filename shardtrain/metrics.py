"""Prometheus metrics of one service process: every request it answered and how long it took, its build, its
process and garbage collector; on a shard, the work its stage ran, the steps it applied and the samples they took,
the tensors it moved and by which path, its open links; on the coordinator, its shards and deploys. Off (every
record call returns at once) unless `serve` started them.

Records go into plain dicts on the service's own thread, and become metric families only when scraped: the
prometheus_client objects take a lock and look their labels up on every update, several microseconds each,
which a Link item or a small layer's forward would pay many times a step.
"""

from __future__ import annotations

import bisect
import importlib.metadata
import itertools
import logging
import platform
import re

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

import shardtrain

log = logging.getLogger("shardtrain.metrics")

# From a small layer's forward (under a millisecond) to a large stage's optimizer step (seconds).
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# From a health check or a Describe on loopback (a tenth of a millisecond) to a deploy that ships a large model.
REQUEST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0)
# From a tiny model's step (milliseconds) to a large model's (minutes).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                300.0)
MOVED_LABELS = ["direction", "kind", "path"]
ROLES = ("shard", "coordinator")


class _Histogram:
    """Counts per bucket (the last: over every bound) and the sum of the observed values, per label values."""

    def __init__(self, bounds: tuple[float, ...], keys: tuple[tuple, ...] = ()):
        self.bounds = bounds
        self.values: dict[tuple, list] = {key: [[0] * (len(bounds) + 1), 0.0] for key in keys}

    def observe(self, key: tuple, value: float) -> None:
        entry = self.values.get(key)
        if entry is None:
            entry = self.values[key] = [[0] * (len(self.bounds) + 1), 0.0]
        entry[0][bisect.bisect_left(self.bounds, value)] += 1
        entry[1] += value

    def family(self, name: str, text: str, labels: list[str]) -> HistogramMetricFamily:
        """The family, from copies taken at once (the service's thread goes on recording meanwhile)."""
        values = {key: (list(counts), total) for key, (counts, total) in dict(self.values).items()}
        family = HistogramMetricFamily(name, text, labels=labels)
        bounds = [*map(floatToGoString, self.bounds), "+Inf"]
        for key, (counts, total) in sorted(values.items()):
            family.add_metric(list(key), list(zip(bounds, itertools.accumulate(counts))), total)
        return family


class _Records:
    """What a service recorded so far, and its export as metric families (a prometheus_client collector): the
    request families for every role, then the role's own."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.requests: dict[tuple, int] = {}
        self.request_seconds = _Histogram(REQUEST_BUCKETS)
        self.work = _Histogram(SECONDS_BUCKETS)
        self.steps = _Histogram(STEP_BUCKETS, keys=((),))
        self.samples = 0
        self.items: dict[tuple, int] = {}
        self.bytes: dict[tuple, int] = {}
        self.gauges = {"links_open": 0, "activation_bytes": 0, "registered_shards": 0}
        self.deploys = 0

    def collect(self):
        yield _counter("shardtrain_requests", "Requests answered, by method and status code (OK included)",
                       self.requests, ["method", "code"])
        yield self.request_seconds.family("shardtrain_request_seconds", "Seconds from a request's arrival to its "
                                          "answer (for a stream, to its end), by method", ["method"])
        yield from self._shard() if self.role == "shard" else self._coordinator()

    def _shard(self):
        yield self.work.family("shardtrain_work_seconds", "Stage work by kind (forward, backward, backward_input, "
                               "backward_weight, step, ...): the count is how many ran", ["work"])
        yield self.steps.family("shardtrain_step_seconds", "Optimizer steps applied here, each timed from its first "
                                "training forward on this stage to the step applied", [])
        yield CounterMetricFamily("shardtrain_samples", "Samples (rows of the stage's input) of the training "
                                  "forwards whose optimizer step was applied here", value=self.samples)
        yield _counter("shardtrain_link_items", "Link items by direction, item kind and path", self.items)
        yield _counter("shardtrain_tensor_bytes", "Tensor bytes of Link items as they travelled (compressed, if so), "
                       "by direction, item kind and path (grpc, socket, shared_memory, storage)", self.bytes)
        for name, text in (("links_open", "Links open at this end"),
                           ("activation_bytes", "Bytes autograd holds for the micro-batches in flight")):
            yield GaugeMetricFamily(f"shardtrain_{name}", text, value=self.gauges[name])

    def _coordinator(self):
        yield CounterMetricFamily("shardtrain_deploys", "Models deployed (a refused deploy counts among the "
                                  "requests, method Deploy, with its code)", value=self.deploys)
        yield GaugeMetricFamily("shardtrain_registered_shards", "Shards registered with the coordinator",
                                value=self.gauges["registered_shards"])


def _counter(name: str, text: str, values: dict[tuple, int], labels: list[str] = MOVED_LABELS) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=labels)
    for key, value in sorted(dict(values).items()):
        family.add_metric(list(key), value)
    return family


class _Build:
    """shardtrain_build_info: what this process runs, as labels of a gauge that is always 1."""

    def __init__(self, role: str):
        self.labels = {"version": shardtrain.__version__, "torch": _version("torch"), "grpcio": _version("grpcio"),
                       "python": platform.python_version(), "role": role}

    def collect(self):
        family = GaugeMetricFamily("shardtrain_build_info", "The versions this service runs, and its role",
                                   labels=list(self.labels))
        family.add_metric(list(self.labels.values()), 1)
        yield family


def _version(package: str) -> str:
    """An installed package's version, read from its metadata (the coordinator and probes never import torch)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


_on: _Records | None = None


def serve(host: str, port: int, role: str, certfile: str = "", keyfile: str = "") -> int:
    """Starts recording and the HTTP endpoint (/metrics) of a service of `role` ("shard" or "coordinator") on
    host:port (0 picks one), over HTTPS with the service's own certificate when it has one; returns the port."""
    global _on
    if role not in ROLES:
        raise ValueError(f"metrics of role {role!r}; roles are {ROLES}")
    records = _Records(role)
    registry = CollectorRegistry(auto_describe=False)
    for collector in (records, _Build(role)):
        registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    server, _ = start_http_server(port, host, registry=registry, certfile=certfile or None, keyfile=keyfile or None)
    _on = records
    log.info("metrics on %s://%s:%d/metrics", "https" if certfile else "http", host, server.server_address[1])
    return server.server_address[1]


def serve_for(settings, role: str) -> dict:
    """Starts the endpoint a service's settings ask for (metrics_port, on the bind host, with its TLS files): what
    the service's ready line adds, {"metrics_port": port}, or {} when they ask for none. Before the service builds
    its servers: they count requests only when metrics are on as they are built (rpc.new_server)."""
    if settings.metrics_port is None:
        return {}
    host = settings.bind.rsplit(":", 1)[0].strip("[]")
    return {"metrics_port": serve(host, settings.metrics_port, role, settings.security.tls_cert,
                                  settings.security.tls_key)}


def enabled() -> bool:
    """Whether metrics are being recorded (worth computing a value only to record it)."""
    return _on is not None


def request(method: str, code: str, seconds: float) -> None:
    """A request to `method` was answered with status `code` after `seconds`."""
    if _on is not None:
        key = (method, code)
        _on.requests[key] = _on.requests.get(key, 0) + 1
        _on.request_seconds.observe((method,), seconds)


_WORK_LABELS: dict[str, str] = {}


def work(name: str, seconds: float) -> None:
    """A piece of stage work (a function's name: `forward`, `Stage`, `_stage_state`) ran for `seconds`; recorded
    under the name in snake_case (`forward`, `stage`, `stage_state`)."""
    if _on is not None:
        label = _WORK_LABELS.get(name)
        if label is None:
            label = _WORK_LABELS[name] = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower().strip("_")
        _on.work.observe((label,), seconds)


def step(seconds: float, samples: int) -> None:
    """An optimizer step was applied here, `seconds` after its first training forward, over `samples` rows."""
    if _on is not None:
        _on.steps.observe((), seconds)
        _on.samples += samples


def moved(direction: str, kind: str, path: str, nbytes: int) -> None:
    """A Link item was sent or received ("sent", "received") on `path`, with `nbytes` of tensor."""
    if _on is not None:
        key = (direction, kind, path)
        _on.items[key] = _on.items.get(key, 0) + 1
        if nbytes:
            _on.bytes[key] = _on.bytes.get(key, 0) + nbytes


def link_opened(change: int) -> None:
    """A Link opened (+1) or closed (-1) at this end."""
    if _on is not None:
        _on.gauges["links_open"] += change


def activation_bytes(value: int) -> None:
    """Bytes autograd now holds for in-flight micro-batches."""
    if _on is not None:
        _on.gauges["activation_bytes"] = value


def registered_shards(count: int) -> None:
    """Shards the coordinator now knows."""
    if _on is not None:
        _on.gauges["registered_shards"] = count


def deployed() -> None:
    """A model was deployed."""
    if _on is not None:
        _on.deploys += 1
