"""Prometheus metrics of one service process: the work its stage ran, the tensors it moved and by which path,
the requests it refused, its open links. Off (every record call returns at once) unless `serve` started them.

Records go into plain dicts on the service's own thread, and become metric families only when scraped: the
prometheus_client objects take a lock and look their labels up on every update, several microseconds each,
which a Link item or a small layer's forward would pay many times a step.
"""

from __future__ import annotations

import bisect
import logging

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

log = logging.getLogger("shardtrain.metrics")

# From a small layer's forward (under a millisecond) to a large stage's optimizer step (seconds).
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MOVED_LABELS = ["direction", "kind", "path"]


class _Records:
    """What a service recorded so far, and its export as metric families (a prometheus_client collector)."""

    def __init__(self) -> None:
        self.work: dict[str, list] = {}  # work -> [count per bucket (the last: over every bound), sum of seconds]
        self.items: dict[tuple, int] = {}
        self.bytes: dict[tuple, int] = {}
        self.failed: dict[tuple, int] = {}
        self.gauges = {"links_open": 0, "activation_bytes": 0, "registered_shards": 0}
        self.deploys = 0

    def collect(self):
        """The metric families, from copies taken at once (the service's thread goes on recording meanwhile)."""
        work = {name: (list(counts), total) for name, (counts, total) in dict(self.work).items()}
        histogram = HistogramMetricFamily("shardtrain_work_seconds", "Stage work by kind (forward, backward, "
                                          "backward_input, backward_weight, step, ...): the count is how many ran",
                                          labels=["work"])
        for name, (counts, total) in sorted(work.items()):
            cumulative, running = [], 0
            for bound, count in zip([*map(str, SECONDS_BUCKETS), "+Inf"], counts):
                running += count
                cumulative.append((bound, running))
            histogram.add_metric([name], cumulative, total)
        yield histogram
        yield _counter("shardtrain_link_items", "Link items by direction, item kind and path", self.items)
        yield _counter("shardtrain_tensor_bytes", "Tensor bytes of Link items as they travelled (compressed, if so), "
                       "by direction, item kind and path (grpc, socket, shared_memory)", self.bytes)
        yield _counter("shardtrain_requests_failed", "Requests answered with an error, by method and status code",
                       self.failed, ["method", "code"])
        yield CounterMetricFamily("shardtrain_deploys", "Models deployed (a refused deploy counts among the failed "
                                  "requests, method Deploy)", value=self.deploys)
        for name, text in (("links_open", "Links open at this end"),
                           ("activation_bytes", "Bytes autograd holds for the micro-batches in flight"),
                           ("registered_shards", "Shards registered with the coordinator")):
            yield GaugeMetricFamily(f"shardtrain_{name}", text, value=self.gauges[name])


def _counter(name: str, text: str, values: dict[tuple, int], labels: list[str] = MOVED_LABELS) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=labels)
    for key, value in sorted(dict(values).items()):
        family.add_metric(list(key), value)
    return family


_on: _Records | None = None


def serve(host: str, port: int, certfile: str = "", keyfile: str = "") -> int:
    """Starts recording and the HTTP endpoint (/metrics) on host:port (0 picks one), over HTTPS with the
    service's own certificate when it has one; returns the port."""
    global _on
    records = _Records()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(records)
    server, _ = start_http_server(port, host, registry=registry, certfile=certfile or None, keyfile=keyfile or None)
    _on = records
    log.info("metrics on %s://%s:%d/metrics", "https" if certfile else "http", host, server.server_address[1])
    return server.server_address[1]


def serve_for(settings) -> dict:
    """Starts the endpoint a service's settings ask for (metrics_port, on the bind host, with its TLS files): what
    the service's ready line adds, {"metrics_port": port}, or {} when they ask for none."""
    if settings.metrics_port is None:
        return {}
    host = settings.bind.rsplit(":", 1)[0].strip("[]")
    return {"metrics_port": serve(host, settings.metrics_port, settings.security.tls_cert, settings.security.tls_key)}


def enabled() -> bool:
    """Whether metrics are being recorded (worth computing a value only to record it)."""
    return _on is not None


def work(name: str, seconds: float) -> None:
    """A piece of stage work ran for `seconds`."""
    if _on is not None:
        entry = _on.work.get(name)
        if entry is None:
            entry = _on.work[name] = [[0] * (len(SECONDS_BUCKETS) + 1), 0.0]
        entry[0][bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1
        entry[1] += seconds


def moved(direction: str, kind: str, path: str, nbytes: int) -> None:
    """A Link item was sent or received ("sent", "received") on `path`, with `nbytes` of tensor."""
    if _on is not None:
        key = (direction, kind, path)
        _on.items[key] = _on.items.get(key, 0) + 1
        if nbytes:
            _on.bytes[key] = _on.bytes.get(key, 0) + nbytes


def failed(method: str, code: str) -> None:
    """A request was answered with status `code`."""
    if _on is not None:
        _on.failed[(method, code)] = _on.failed.get((method, code), 0) + 1


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
