"""docker/docker-compose.yml, checked by a real compose parser and run as processes on this machine.

There is no Docker engine here, so the services run as the file describes them, without containers: each
service's entrypoint and command (the image's ENTRYPOINT from docker/Dockerfile when it sets none), its
environment, its volumes (a named volume becomes a directory of tmp_path), its health check, and its
`depends_on` conditions, in order. The one thing changed is the network: every service runs on 127.0.0.1 at a
free port of its own, so `coordinator:50051`, `shard-1:50052` and `0.0.0.0:50052` become 127.0.0.1 addresses,
and so does each service's `--metrics-port`, where docker/prometheus.yml's targets are scraped.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
import yaml
from torch import nn

from client_sdk import Cluster
from client_sdk.processes import Service
from shardtrain import errors
from shardtrain.settings import security_from_env
from tests.integration.training import largest_difference, regression_batches, train_locally, train_remotely
from tests.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker" / "docker-compose.yml"
PROMETHEUS_FILE = ROOT / "docker" / "prometheus.yml"
PROMTOOL = shutil.which("promtool")
# docker-compose 1.29 (Debian's apt package) validates against the compose schema and resolves anchors, merge
# keys and variables without a Docker daemon; .ci/run installs it.
DOCKER_COMPOSE = shutil.which("docker-compose")
needs_parser = pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose is not installed "
                                  "(apt-get install docker-compose; .ci/run installs it)")
# How this machine runs the executables the file names: the image's console script and its Python.
EXECUTABLES = {"shardtrain": [sys.executable, "-m", "shardtrain.cli"], "python": [sys.executable]}
HOST_ALIASES = ("0.0.0.0", "127.0.0.1", "localhost")  # a service's own addresses, inside its container


def compose_config(path: pathlib.Path) -> subprocess.CompletedProcess:
    """`docker-compose -f PATH config`: the file validated and resolved, as YAML on stdout."""
    return subprocess.run([DOCKER_COMPOSE, "-f", str(path), "config"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PWD": str(ROOT)})


@needs_parser
def test_the_parser_accepts_the_file_and_rejects_broken_copies(tmp_path):
    done = compose_config(COMPOSE_FILE)
    assert done.returncode == 0, done.stderr
    text = COMPOSE_FILE.read_text()
    broken = {"unknown-key": (text.replace('restart: "no"\n', 'restart: "no"\n    colour: blue\n', 1), "'colour'"),
              "bad-condition": (text.replace("condition: service_healthy", "condition: service_happy", 1),
                                '"service_happy"'),
              "undefined-dependency": (text.replace("      shard-0:\n", "      shard-9:\n", 1), "'shard-9'")}
    for name, (copy, complaint) in broken.items():
        assert copy != text, f"{name}: the edit no longer applies to the file"
        path = tmp_path / f"{name}.yml"
        path.write_text(copy)
        done = compose_config(path)
        assert done.returncode != 0 and complaint in done.stderr, f"{name}: {done.returncode}, {done.stderr}"


class ComposeHere:
    """The resolved compose file's services as processes on this machine, started in `depends_on` order."""

    def __init__(self, config: dict, tmp_path: pathlib.Path):
        self.services = config["services"]
        self.volumes = {name: tmp_path / "volumes" / name for name in config.get("volumes", {})}
        self.log_dir = tmp_path / "logs"
        self.log_dir.mkdir()
        self.ports: dict[tuple[str, int], int] = {}
        self.running: dict[str, Service] = {}
        self.entrypoint = image_entrypoint(config)

    def address(self, service: str, port: int) -> str:
        """Where `service`'s container port `port` is reached here: a free port of 127.0.0.1, fixed once picked."""
        if (service, port) not in self.ports:
            self.ports[service, port] = free_port()
        return f"127.0.0.1:{self.ports[service, port]}"

    def mapped(self, service: str, text: str) -> str:
        """`text` as seen from here: volume paths become their directories, service addresses 127.0.0.1 ones."""
        for volume in self.services[service].get("volumes", []):
            source, target = volume.split(":")[:2]
            host = str(self.volumes.get(source, source))
            text = re.sub(rf"(?<![\w./-]){re.escape(target)}(?![\w.-])", lambda _: host, text)

        def to_here(match: re.Match) -> str:
            host, port = match.group(1), int(match.group(2))
            if host in HOST_ALIASES:
                return self.address(service, port)
            return self.address(host, port) if host in self.services else match.group(0)

        return re.sub(r"(?<![\w.-])([\w.-]+):(\d+)\b", to_here, text)

    def argv(self, service: str, words: list[str]) -> list[str]:
        """The command line that runs `words` (a service's entrypoint and command) here; a --metrics-port, a port
        of the service's own, becomes its free port here."""
        words = [self.mapped(service, word) for word in words]
        words = [self.address(service, int(word)).rpartition(":")[2] if flag == "--metrics-port" else word
                 for flag, word in zip(["", *words], words)]
        return [*EXECUTABLES.get(words[0], words[:1]), *words[1:]]

    def environment(self, service: str) -> dict[str, str]:
        """The service's `environment`, mapped to this machine."""
        return {name: self.mapped(service, str(value))
                for name, value in self.services[service].get("environment", {}).items()}

    def command(self, service: str) -> list[str]:
        """The service's entrypoint (its own, else its image's) and command, as a command line here."""
        spec = self.services[service]
        entrypoint = spec["entrypoint"] if "entrypoint" in spec else self.entrypoint(spec)
        return self.argv(service, [*entrypoint, *spec.get("command", [])])

    def one_shot(self, service: str) -> bool:
        """Whether a dependent waits for `service` to complete: it runs to its end before they start."""
        return any(dependency.get("condition") == "service_completed_successfully"
                   for spec in self.services.values() for name, dependency in spec.get("depends_on", {}).items()
                   if name == service)

    def up(self) -> None:
        """Starts every service outside a profile, as `docker compose up` does, each once its dependencies
        meet their conditions; then waits until every service with a health check is healthy."""
        for volume in self.volumes.values():
            volume.mkdir(parents=True)
        for service in start_order(self.services):
            for dependency, spec in self.services[service].get("depends_on", {}).items():
                if spec.get("condition") == "service_healthy":
                    self.wait_healthy(dependency)
            self.start(service)
        for service in self.running:
            if "healthcheck" in self.services[service]:
                self.wait_healthy(service)

    def start(self, service: str) -> None:
        """Runs a one-shot service to its end; starts any other as a Python process that `down` stops."""
        spec = self.services[service]
        cwd = self.mapped(service, spec.get("working_dir", str(ROOT)))
        if self.one_shot(service):
            done = subprocess.run(self.command(service), cwd=cwd, env={**os.environ, **self.environment(service)},
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{service} exited with {done.returncode}: {done.stderr[-2000:]}"
            return
        argv = self.command(service)
        assert argv[0] == sys.executable, f"{service}: only Python services run here, not {argv}"
        self.running[service] = Service(service, argv[1:], self.log_dir, self.environment(service))

    def wait_healthy(self, service: str) -> None:
        """Runs the service's health check until it passes, as compose does during start_period (but every half
        second, not every `interval`), with the service's environment, as inside its container."""
        check = self.services[service]["healthcheck"]
        assert check["test"][0] == "CMD", f"{service}: a CMD health check runs without a shell: {check['test']}"
        argv, env = self.argv(service, check["test"][1:]), {**os.environ, **self.environment(service)}
        deadline, reason = time.monotonic() + seconds(check.get("start_period", "60s")), ""
        while True:
            assert self.running[service].process.poll() is None, f"{service} ended: {self.running[service].log_tail()}"
            try:
                probe = subprocess.run(argv, env=env, capture_output=True, text=True,
                                       timeout=seconds(check.get("timeout", "30s")))
                if probe.returncode == 0:
                    return
                reason = probe.stderr
            except subprocess.TimeoutExpired:
                reason = "the check timed out"
            assert time.monotonic() < deadline, f"{service} not healthy: {reason}\n{self.running[service].log_tail()}"
            time.sleep(0.5)

    def run(self, service: str) -> subprocess.CompletedProcess:
        """`docker compose run --rm SERVICE`: its command to its end, with its environment and working directory."""
        spec = self.services[service]
        return subprocess.run(self.command(service), cwd=self.mapped(service, spec.get("working_dir", str(ROOT))),
                              env={**os.environ, **self.environment(service)}, capture_output=True, text=True,
                              timeout=120)

    def down(self) -> None:
        """SIGTERM, then SIGKILL, for every running service, dependents first."""
        for service in reversed(list(self.running)):
            self.running.pop(service).stop()


def image_entrypoint(config: dict):
    """A function giving a service's image ENTRYPOINT: read from the Dockerfile its `build` names."""
    def entrypoint(spec: dict) -> list[str]:
        build = spec.get("build")
        if build is None:
            return []
        dockerfile = pathlib.Path(build["context"]) / build.get("dockerfile", "Dockerfile")
        lines = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", dockerfile.read_text(), re.MULTILINE)
        return json.loads(lines[-1]) if lines else []
    return entrypoint


def start_order(services: dict) -> list[str]:
    """Services outside every profile, each after everything it depends on."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name not in order:
            for dependency in services[name].get("depends_on", {}):
                visit(dependency)
            order.append(name)

    for name, spec in services.items():
        if not spec.get("profiles"):
            visit(name)
    return order


def seconds(duration: str) -> float:
    """Seconds in a compose duration: "6s", "1m", "1m30s"."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert parts and "".join(a + b for a, b in parts) == duration, f"{duration!r} is not a duration"
    return sum(float(value) * units[unit] for value, unit in parts)


@needs_parser
def test_the_services_train_through_tls_and_the_token_as_the_file_says(tmp_path):
    done = compose_config(COMPOSE_FILE)
    assert done.returncode == 0, done.stderr
    compose = ComposeHere(yaml.safe_load(done.stdout), tmp_path)
    try:
        compose.up()
        assert set(compose.running) == {"coordinator", "shard-0", "shard-1", "shard-2"}
        client_env = compose.environment("client")
        security = security_from_env(client_env)
        assert security.token and security.tls_ca and security.tls_server_name == "coordinator"
        coordinator = compose.address("coordinator", 50051)
        shards = [compose.address(f"shard-{i}", 50052) for i in range(3)]
        with Cluster.connect(coordinator, security) as cluster:
            wait_for(lambda: sorted(shard.address for shard in cluster.shards()) == sorted(shards), "3 shards")
            listed = compose.run("client")  # the client service's own command: it lists the shards
            assert listed.returncode == 0 and all(shard in listed.stdout for shard in shards), listed.stderr
            trains_like_one_process(cluster)
            prometheus_scrapes_every_service(compose)
        with pytest.raises(errors.Unauthenticated):
            Cluster.connect(coordinator, security_from_env({k: v for k, v in client_env.items() if "TOKEN" not in k}))
    finally:
        compose.down()


def trains_like_one_process(cluster) -> None:
    """A small MLP over the three shards: the loss falls, and the weights end as in one process."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = (torch.optim.SGD, {"lr": 0.1})
    batches = regression_batches(steps=1, batch=16, features=4, outputs=2) * 6  # one batch: its loss must fall
    expected = train_locally(net, batches, optimizer)
    model = cluster.deploy(net, optimizer=optimizer, num_stages=3)
    losses = train_remotely(model, batches)
    assert losses[-1] < losses[0], losses
    assert largest_difference(model.state_dict(), expected) < 1e-5


def prometheus_scrapes_every_service(compose: ComposeHere) -> None:
    """docker/prometheus.yml's targets are every running service's metrics port, each answering over HTTPS with a
    certificate the compose CA signed; and promtool (where installed) accepts the configuration."""
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    (job,) = config["scrape_configs"]
    targets = [target for group in job["static_configs"] for target in group["targets"]]
    served = {f"{service}:{port}" for service in compose.running
              for flag, port in zip(compose.services[service]["command"], compose.services[service]["command"][1:])
              if flag == "--metrics-port"}
    assert sorted(targets) == sorted(served), f"prometheus.yml scrapes {targets}; the services serve {served}"
    ca_file = compose.mapped("prometheus", job["tls_config"]["ca_file"])
    context = ssl.create_default_context(cafile=ca_file)
    for target in targets:
        service, port = target.split(":")
        url = f"{job['scheme']}://{compose.address(service, int(port))}{job.get('metrics_path', '/metrics')}"
        with urllib.request.urlopen(url, context=context, timeout=10) as answer:
            text = answer.read().decode()
        role = "coordinator" if service == "coordinator" else "shard"
        assert re.search(rf'^shardtrain_build_info{{.*role="{role}".*}} 1\.0$', text, re.MULTILINE), target
    if PROMTOOL is not None:  # its file checks need the CA where the configuration says: a copy that says here
        copy = compose.log_dir / "prometheus.yml"
        copy.write_text(PROMETHEUS_FILE.read_text().replace(job["tls_config"]["ca_file"], ca_file))
        done = subprocess.run([PROMTOOL, "check", "config", str(copy)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    """Polls `condition` until it holds; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.2)
