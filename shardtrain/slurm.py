"""Where a shard started by SLURM's srun serves: its coordinator, address and device, from SLURM's environment.

The coordinator runs on the first node of the job's allocation (docker/slurm/shardtrain.sbatch starts it
there); each node runs one shard per GPU, told apart by SLURM_LOCALID. Pure functions of the variables, so
no scontrol is needed and the tests need no SLURM.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

NODELIST_VARIABLES = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")  # the allocation's nodes; the second is the old name


class SlurmEnvironmentError(ValueError):
    """A SLURM variable a shard needs is missing or malformed; the message names it."""


@dataclass(frozen=True)
class ShardPlace:
    """Where one shard of a SLURM job serves, and whom it registers with."""

    coordinator: str  # host:port of the coordinator, on the allocation's first node
    bind: str         # host:port this shard listens on (every interface: peers are on other nodes)
    advertise: str    # host:port peers and clients reach it at (port 0: the port it binds)
    device: str       # cuda:N for its GPU, or cpu
    metrics_port: int | None = None  # its Prometheus endpoint's port (0: a free one), or None for none


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list as host names, in order: "node[01-03,07],gpu5" -> node01 node02 node03
    node07 gpu5. Several bracket groups in one name give every combination ("r[1-2]n[1-2]")."""
    hosts = [host for name in _split_names(hostlist) for host in _expand_name(name)]
    if not hosts:
        raise ValueError(f"{hostlist!r} names no host")
    return hosts


def _split_names(hostlist: str) -> list[str]:
    """Splits at the commas outside brackets."""
    names, depth, start = [], 0, 0
    for index, char in enumerate(hostlist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"{hostlist!r}: unbalanced or nested brackets at character {index}")
        if char == "," and depth == 0:
            names.append(hostlist[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"{hostlist!r}: a '[' is never closed")
    names.append(hostlist[start:])
    return [name.strip() for name in names if name.strip()]


def _expand_name(name: str) -> list[str]:
    """One name with any number of [ranges] groups, as every host it stands for."""
    parts = re.split(r"\[([^\]]*)\]", name)  # literal, ranges, literal, ranges, ..., literal
    choices = [[part] if index % 2 == 0 else _expand_ranges(part, name) for index, part in enumerate(parts)]
    return ["".join(combination) for combination in itertools.product(*choices)]


def _expand_ranges(ranges: str, name: str) -> list[str]:
    """"01-03,7" -> 01 02 03 7: a range keeps the zero padding of its first number."""
    numbers = []
    for item in ranges.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if match is None:
            raise ValueError(f"{name!r}: {item!r} is not a number or a range like 01-04")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"{name!r}: the range {item!r} ends before it starts")
        numbers += [str(number).zfill(len(low)) for number in range(int(low), int(high) + 1)]
    return numbers


def device_for(local_id: int, cuda_devices: int) -> str:
    """The device of the shard that is task `local_id` on its node, seeing `cuda_devices` GPUs: cpu without one;
    cuda:0 when srun bound one GPU to the task; cuda:LOCALID when the task sees all of the node's GPUs."""
    if cuda_devices == 0:
        return "cpu"
    if cuda_devices == 1:
        return "cuda:0"
    if local_id >= cuda_devices:
        raise SlurmEnvironmentError(f"SLURM_LOCALID={local_id} but this task sees only {cuda_devices} GPUs: "
                                    f"start at most one shard per GPU on a node")
    return f"cuda:{local_id}"


def shard_place(env: Mapping[str, str], coordinator_port: int, port: int, cuda_devices: int,
                ports_per_shard: int = 1, metrics_port: int | None = None) -> ShardPlace:
    """Where the shard that is this srun task serves: the coordinator at the allocation's first node and
    `coordinator_port`; this node's name (SLURMD_NODENAME) and port `port` + SLURM_LOCALID * `ports_per_shard`
    (port 0: a free port each); the GPU of its local id; metrics at `metrics_port` + SLURM_LOCALID (one endpoint
    per process, whatever its stages; 0: a free port each; None: none)."""
    nodelist_name = next((name for name in NODELIST_VARIABLES if env.get(name)), None)
    if nodelist_name is None:
        raise SlurmEnvironmentError("SLURM_JOB_NODELIST is not set: start the shard with srun inside a SLURM job")
    try:
        first_node = expand_hostlist(env[nodelist_name])[0]
    except ValueError as error:
        raise SlurmEnvironmentError(f"{nodelist_name} is not a SLURM host list: {error}") from None
    local_id = _count(env, "SLURM_LOCALID")
    node = env.get("SLURMD_NODENAME", "").strip()
    if not node:
        raise SlurmEnvironmentError("SLURMD_NODENAME is not set: start the shard with srun inside a SLURM job")
    own_port = port + local_id * ports_per_shard if port else 0
    if own_port + ports_per_shard - 1 > 65535:
        raise SlurmEnvironmentError(f"SLURM_LOCALID={local_id} puts this shard at port {own_port}, past 65535: "
                                    f"give a lower --port")
    own_metrics = metrics_port + local_id if metrics_port else metrics_port
    if own_metrics is not None and own_metrics > 65535:
        raise SlurmEnvironmentError(f"SLURM_LOCALID={local_id} puts this shard's metrics at port {own_metrics}, "
                                    f"past 65535: give a lower --metrics-port")
    return ShardPlace(coordinator=f"{first_node}:{coordinator_port}", bind=f"0.0.0.0:{own_port}",
                      advertise=f"{node}:{own_port}", device=device_for(local_id, cuda_devices),
                      metrics_port=own_metrics)


def _count(env: Mapping[str, str], name: str) -> int:
    """A variable holding a count (0, 1, ...); the error names it and what it holds."""
    text = env.get(name)
    if text is None:
        raise SlurmEnvironmentError(f"{name} is not set: start the shard with srun inside a SLURM job")
    if not text.strip().isdigit():
        raise SlurmEnvironmentError(f"{name}={text!r} is not a count (0, 1, ...)")
    return int(text)
