"""Separate hosts on one machine: each shard in a network namespace of its own, with its own /dev/shm.

    with SeparateHosts(3) as hosts:
        cluster = Cluster.local(num_shards=3, hosts=hosts)

The namespaces hang off a bridge in the caller's namespace (10.213.N.1/24, N from the process id), where
the coordinator and the SDK run; shard i gets 10.213.N.(i + 2). Each shard also gets a private mount of
/dev/shm, so no shard can prove it shares a host with another (no shared-memory segment, and so no
Unix socket, passes between them): every Link takes the path between hosts (a TCP socket on the veth
pair, or gRPC) over real, distinct addresses, not loopback. /tmp stays shared: the interpreter and
the checkout may live there. Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), `ip` and `unshare`; `unavailable()` says
why not, for tests to skip with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

_MOUNTS = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class SeparateHosts:
    """`count` shard hosts on a bridge (see the module's docstring); a `hosts=` for Cluster.local."""

    def __init__(self, count: int):
        self.count = count
        tag = os.getpid() % 100_000
        self._subnet = f"10.213.{os.getpid() % 250}"
        self._bridge = f"stb{tag}"
        self._veths = [(f"st{tag}h{i}", f"st{tag}n{i}") for i in range(count)]
        self.namespaces = [f"shardtrain-{os.getpid()}-{i}" for i in range(count)]
        self.coordinator_host = f"{self._subnet}.1"

    def shard_host(self, index: int) -> str:
        """The address shard `index` binds and advertises."""
        return f"{self._subnet}.{index + 2}"

    def prefix(self, index: int) -> list[str]:
        """The command that runs a program as shard `index`'s host: its namespace and its own /dev/shm."""
        return ["ip", "netns", "exec", self.namespaces[index], "unshare", "--mount", "--propagation", "private",
                "sh", "-c", _MOUNTS, "sh"]

    def __enter__(self) -> SeparateHosts:
        try:
            _ip("link", "add", self._bridge, "type", "bridge")
            _ip("addr", "add", f"{self.coordinator_host}/24", "dev", self._bridge)
            _ip("link", "set", self._bridge, "up")
            for index, (outside, inside) in enumerate(self._veths):
                namespace = self.namespaces[index]
                _ip("netns", "add", namespace)
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", outside, "master", self._bridge)
                _ip("link", "set", outside, "up")
                _ip("link", "set", inside, "netns", namespace)
                _ip("-n", namespace, "addr", "add", f"{self.shard_host(index)}/24", "dev", inside)
                _ip("-n", namespace, "link", "set", inside, "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Removes the namespaces (their ends of the veth pairs go with them), then the bridge."""
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        for outside, _ in self._veths:
            subprocess.run(["ip", "link", "del", outside], capture_output=True)
        subprocess.run(["ip", "link", "del", self._bridge], capture_output=True)


def unavailable() -> str:
    """Why SeparateHosts cannot be made here ("" when it can): tried once with one host."""
    if os.name != "posix" or os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"network namespaces need {', '.join(missing)}"
    try:
        with SeparateHosts(1) as hosts:
            subprocess.run([*hosts.prefix(0), sys.executable, "-c", "import torch"], check=True,
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        return f"network namespaces cannot be made here: {detail.strip()[:200]}"
    return ""
