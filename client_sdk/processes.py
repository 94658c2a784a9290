"""Local coordinator and shard processes for Cluster.local: started, awaited, and always reaped."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from shardtrain import carrier, shm
from shardtrain.errors import Unavailable

log = logging.getLogger("shardtrain.local")

# Local shards share this host's cores and take turns computing. OpenMP threads that spin while
# idle (the default) steal the cores a busy neighbour needs (docs/performance.md).
_OPENMP = {"OMP_WAIT_POLICY": "PASSIVE"}


def reap(process: subprocess.Popen, grace: float) -> None:
    """Waits up to `grace` seconds for a process asked to end; SIGKILLs it after that. Always reaps it."""
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for a child service, which exits when this process does."""
    return {**os.environ, **_OPENMP, "SHARDTRAIN_PARENT_PID": str(os.getpid()), **extra}


class Service:
    """One child process that prints a JSON 'ready' line on stdout once it serves."""

    def __init__(self, name: str, argv: list[str], log_dir: pathlib.Path, env: dict[str, str],
                 prefix: Sequence[str] = (), stdin: int = subprocess.DEVNULL):
        self.name = name
        self.address = ""  # set from the ready line: where others reach it (a shard's --advertise, if given)
        self.port = 0      # the port it listens on, from the same line
        self.metrics_url = ""  # its Prometheus endpoint, if it serves one (--metrics-port)
        self._scheme = "https" if env.get("SHARDTRAIN_TLS_CERT") else "http"
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        # A session of its own: Ctrl-C in a terminal and a notebook's interrupt signal the caller's whole process
        # group, and must interrupt the call, not stop the services that hold the trained weights. The service
        # still ends with this process (SHARDTRAIN_PARENT_PID) or at close().
        self.process = subprocess.Popen([*prefix, sys.executable, *argv], stdout=subprocess.PIPE, stderr=self._log,
                                        stdin=stdin, env=_child_env(env), start_new_session=True)

    def tell(self, line: str) -> None:
        """Writes `line` to the service's standard input and closes it (a shard's `--coordinator -`); a service
        that already exited is left for wait_ready to report."""
        try:
            self.process.stdin.write(line.encode() + b"\n")
            self.process.stdin.close()
        except BrokenPipeError:
            pass

    def wait_ready(self, timeout: float) -> dict:
        """The ready line's fields; Unavailable (with the log's tail) if the process dies or stays silent."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise Unavailable(f"{self.name} exited with code {self.process.returncode}: {self.log_tail()}")
            readable, _, _ = select.select([self.process.stdout], [], [], 0.1)
            if readable:
                line = self.process.stdout.readline()
                if line.startswith(b"{"):
                    ready = json.loads(line)
                    self.address = ready.get("address", f"127.0.0.1:{ready.get('port')}")
                    self.port = int(ready.get("port", 0))
                    if "metrics_port" in ready:
                        host = self.address.rsplit(":", 1)[0]
                        self.metrics_url = f"{self._scheme}://{host}:{ready['metrics_port']}/metrics"
                    return ready
        raise Unavailable(f"{self.name} did not become ready within {timeout:g} s: {self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        """The end of the service's log, for error messages."""
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:]) or "(no output)"

    def ask_to_stop(self) -> None:
        """SIGTERM, not waiting for it to end (stop() does)."""
        if self.process.poll() is None:
            self.process.terminate()

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; always reaps."""
        if self.process.poll() is None:
            self.process.terminate()
            reap(self.process, grace)
        self.process.stdout.close()
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        self._log.close()


class Loopback:
    """Every service on 127.0.0.1: the local cluster's hosts unless told otherwise."""

    coordinator_host = "127.0.0.1"

    def shard_host(self, index: int) -> str:
        return "127.0.0.1"

    def prefix(self, index: int) -> list[str]:
        return []


class LocalServices:
    """A coordinator and `num_shards` shards as processes on this machine, on ports the OS picks.

    The services end when this process ends, however it ends (Linux's parent-death signal; the
    "parent" is the thread that started them, so start them from a thread that outlives them).
    """

    def __init__(self, num_shards: int, device: str = "cpu", env: dict[str, str] | None = None,
                 startup_timeout: float = 120.0, shard_flags: Sequence[str] = (), hosts=None, metrics: bool = False):
        """`env` adds variables for the services (SHARDTRAIN_AUTH_TOKEN and the like); secrets stay off argv.
        `shard_flags` go to every `shardtrain shard` (say ["--flush-denormal", "on"]). `hosts` says where each
        service runs: its `coordinator_host`, `shard_host(i)` (the addresses they bind) and `prefix(i)` (the
        command shard i runs under); Loopback by default, bench.namespaces.SeparateHosts for hosts of their own.
        `metrics`: every service serves Prometheus metrics on a port the OS picks (`metrics_urls`)."""
        self.log_dir = pathlib.Path(tempfile.mkdtemp(prefix="shardtrain-"))
        self.services: list[Service] = []
        self._hosts = hosts or Loopback()
        self._env = dict(env or {})
        if metrics:
            self._env["SHARDTRAIN_METRICS_PORT"] = "0"
        # Local shards share this host's cores: each computes on its share of them, not on all of them at once.
        self._env.setdefault("SHARDTRAIN_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, num_shards))))
        try:
            host = self._hosts.coordinator_host
            # The shards start with the coordinator, not after it, and learn its address on standard input once it
            # serves: their start-up (importing torch, mostly) and its own overlap.
            coordinator = self._start("coordinator", ["-m", "coordinator", "--bind", f"{host}:0"])
            shards = [self._start_shard(i, device, shard_flags, from_stdin=True) for i in range(num_shards)]
            self.coordinator_address = f"{host}:{coordinator.wait_ready(startup_timeout)['port']}"
            for shard in shards:
                shard.tell(self.coordinator_address)
            self.shard_addresses = [shard.wait_ready(startup_timeout)["address"] for shard in shards]
        except BaseException:
            self.stop()
            raise

    def add_shard(self, flags: Sequence[str] = (), device: str = "cpu", timeout: float = 120.0) -> Service:
        """Starts one more shard with its own `flags` and returns it once it serves. It registers after every
        shard before it, and the coordinator places stages in registration order."""
        shard = self._start_shard(len(self.shard_addresses), device, flags)
        self.shard_addresses.append(shard.wait_ready(timeout)["address"])
        return shard

    def _start_shard(self, index: int, device: str, flags: Sequence[str], from_stdin: bool = False) -> Service:
        """Starts shard `index` (not waiting for it to serve), registering with this coordinator; `from_stdin`: with
        `--coordinator -`, for tell() to give it the address once the coordinator serves."""
        coordinator = "-" if from_stdin else self.coordinator_address
        return self._start(f"shard-{index}", ["-m", "shard_service", "--coordinator", coordinator,
                                              "--bind", f"{self._hosts.shard_host(index)}:0", "--device", device,
                                              *flags], self._hosts.prefix(index),
                           subprocess.PIPE if from_stdin else subprocess.DEVNULL)

    def _start(self, name: str, argv: list[str], prefix: Sequence[str] = (),
               stdin: int = subprocess.DEVNULL) -> Service:
        service = Service(name, argv, self.log_dir, self._env, prefix, stdin)
        self.services.append(service)
        return service

    def stop(self) -> None:
        """Stops every process (shards first), then removes the shared segments and sockets they left behind.

        The services' logs go too, unless one of them had ended before it was stopped: then they stay
        for whoever debugs it, and the log says where.
        """
        ended = [service.name for service in self.services if service.process.poll() is not None]
        for service in self.services:  # every shard at once: each takes a moment to shut down gracefully
            if service.name != "coordinator":
                service.ask_to_stop()
        for service in reversed(self.services):  # the coordinator, first started, last
            service.stop()
        self.services.clear()
        shm.sweep()
        carrier.sweep()
        if ended:
            log.warning("%s ended before the cluster was stopped; logs kept in %s", ", ".join(ended), self.log_dir)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    @property
    def metrics_urls(self) -> dict[str, str]:
        """The services' Prometheus endpoints by the services' addresses, the coordinator's first."""
        return {service.address: service.metrics_url for service in self.services if service.metrics_url}

    @property
    def pids(self) -> list[int]:
        """Process ids of the running services."""
        return [service.process.pid for service in self.services]

