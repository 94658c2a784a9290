"""torch.distributed baselines for the tensor-transport benchmark (bench/transport.py).

Two real processes on 127.0.0.1 (sender rank 0, receiver rank 1) move one float32 tensor of
``nbytes`` bytes per transfer, the way bench/transport.py measures shardtrain's own transport:

* ``gloo send/recv``: sender ``dist.send``; receiver ``dist.recv`` into a fresh ``torch.empty``
  and answers with a 1-element ack; the sender times send → ack received ("delivered and known
  to be delivered").
* ``torch.rpc echo``: the sender times ``rpc.rpc_sync("receiver", echo, args=(t,))`` over
  TensorPipe; ``echo`` returns its argument, so the tensor travels both ways.

Per size: a few untimed warm-ups, then ``repeats`` timed transfers; latency is their median.
The receiver's (callee's) peak extra RSS over the timed transfers, minus the one live
destination tensor, is reported per payload byte.

    python -m bench.transport_baselines     # both baselines at 4 KiB, 1 MiB, 64 MiB, 256 MiB
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import rpc

SENDER, RECEIVER = 0, 1
WORLD_SIZE = 2
RPC_NAMES = ("sender", "receiver")
WARMUP = 3  # untimed transfers per size: connection set-up, allocator and page-cache warm-up
OP_TIMEOUT_S = 120  # one gloo op or one rpc; 256 MiB on a noisy 2-vCPU box takes well under 1 s
GLOBAL_TIMEOUT_S = 900.0  # whole run of one function; the parent kills the children after it
SHUTDOWN_GRACE_S = 15.0  # for destroy_process_group / rpc.shutdown after a good run
FAILURE_GRACE_S = 2.0  # after a failure the peer is usually stuck in a blocking op: don't wait long
POLL_INTERVAL_S = 0.5
DEFAULT_SIZES = (4 << 10, 1 << 20, 64 << 20, 256 << 20)
# Read by OpenMP when torch loads, i.e. before any code of ours runs in a spawned child, so it
# has to be in the child's environment at exec time (see _child_environment).
CHILD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass
class TransferResult:
    """One transport at one payload size."""

    transport: str  # "gloo send/recv", "torch.rpc echo"
    nbytes: int  # payload bytes of one transfer (float32 tensor of nbytes/4 elements)
    latency_s: float  # median seconds per transfer
    gbps: float  # nbytes / latency_s / 1e9
    rss_per_byte: float  # receiver's peak extra RSS minus the destination, per payload byte
    hop_s: float = float("nan")  # median one-way time: start of sending to the tensor complete at the receiver


def default_repeats(nbytes: int) -> int:
    """Timed repeats for a payload size: ~256 MiB moved in all, between 3 and 200 transfers."""
    return max(3, min(200, (256 << 20) // nbytes))


# --- peak RSS of the receiving process ----------------------------------------------------------

def _status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def reset_peak_rss() -> int:
    """Reset this process's VmHWM to its current RSS (if the kernel lets us); return VmRSS."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # "5" resets the peak RSS (VmHWM), Linux >= 4.0
    except OSError:
        # No reset possible: VmHWM then still holds earlier peaks (warm-ups, earlier sizes), so
        # the figure becomes an upper bound. Measured anyway rather than failing the benchmark.
        pass
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """This process's peak RSS (VmHWM) since the last reset, in bytes."""
    return _status_bytes("VmHWM")


def _extra_per_byte(rss_before: int, peak: int, nbytes: int) -> float:
    """Peak RSS growth beyond the one live destination tensor, per payload byte."""
    return (peak - rss_before - nbytes) / nbytes


# --- gloo send/recv -----------------------------------------------------------------------------

def _gloo_send_size(numel: int, repeats: int) -> float:
    """Sender side of one size: median seconds from before send to after the ack."""
    src = torch.ones(numel)  # the sender's source may be reused: only destinations must be fresh
    ack = torch.empty(1)

    def transfer() -> float:
        start = time.perf_counter()
        dist.send(src, RECEIVER)
        dist.recv(ack, RECEIVER)
        return time.perf_counter() - start

    for _ in range(WARMUP):
        transfer()
    dist.recv(ack, RECEIVER)  # the receiver has reset its peak RSS: start timing only now
    return statistics.median([transfer() for _ in range(repeats)])


def _gloo_recv_size(numel: int, repeats: int) -> float:
    """Receiver side of one size: peak extra RSS per byte over the timed transfers."""
    ack = torch.ones(1)

    def transfer() -> None:
        dest = torch.empty(numel)  # fresh, like a pipeline stage receiving a new activation
        dist.recv(dest, SENDER)
        dist.send(ack, SENDER)
        # dest dies on return, so the previous destination is freed before the next is allocated

    for _ in range(WARMUP):
        transfer()
    rss_before = reset_peak_rss()
    dist.send(ack, SENDER)  # "ready": keeps the reset out of the sender's timed loop
    for _ in range(repeats):
        transfer()
    return _extra_per_byte(rss_before, peak_rss(), numel * 4)


def _gloo_body(rank: int, sizes: list[int], repeats: int) -> list[float]:
    """One gloo process: medians (sender) or RSS figures (receiver), one per size."""
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=OP_TIMEOUT_S))
    try:
        side = _gloo_send_size if rank == SENDER else _gloo_recv_size
        return [side(nbytes // 4, repeats) for nbytes in sizes]
    finally:
        dist.destroy_process_group()


# --- torch.rpc echo -----------------------------------------------------------------------------

def echo(tensor: torch.Tensor) -> torch.Tensor:
    """The callee of the echo benchmark: return the argument unchanged."""
    return tensor


def _rpc_size(numel: int, repeats: int) -> tuple[float, float]:
    """Sender side of one size: (median rpc_sync seconds, callee's peak extra RSS per byte)."""
    src = torch.ones(numel)

    def transfer() -> float:
        start = time.perf_counter()
        rpc.rpc_sync(RPC_NAMES[RECEIVER], echo, args=(src,))  # the reply is dropped at once
        return time.perf_counter() - start

    for _ in range(WARMUP):
        transfer()
    # The RSS that matters is the callee's, so it is reset and read there, by rpc.
    rss_before = rpc.rpc_sync(RPC_NAMES[RECEIVER], reset_peak_rss)
    latency = statistics.median([transfer() for _ in range(repeats)])
    peak = rpc.rpc_sync(RPC_NAMES[RECEIVER], peak_rss)
    return latency, _extra_per_byte(rss_before, peak, numel * 4)


def _rpc_body(rank: int, sizes: list[int], repeats: int) -> list[tuple[float, float]] | None:
    """One rpc process: the sender drives every size; the receiver only serves until shutdown."""
    # torch's own init_rpc/shutdown trip this deprecation warning; it is not ours to fix.
    warnings.filterwarnings("ignore", message="You are using a Backend")
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=OP_TIMEOUT_S)
    rpc.init_rpc(RPC_NAMES[rank], rank=rank, world_size=WORLD_SIZE, rpc_backend_options=options)
    graceful = False
    try:
        out = [_rpc_size(nbytes // 4, repeats) for nbytes in sizes] if rank == SENDER else None
        graceful = True
        return out
    finally:
        # Graceful shutdown waits for the peer; after a failure it could wait for a dead one.
        rpc.shutdown(graceful=graceful)


# --- process management -------------------------------------------------------------------------

def _child(body: Callable[[int, list[int], int], object], rank: int, port: int, threads: int,
           sizes: list[int], repeats: int, results: mp.Queue) -> None:
    """Entry point of both processes: run ``body`` and report its result or traceback."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Pin both transports to loopback instead of whatever the hostname resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    try:
        results.put((rank, "ok", body(rank, sizes, repeats)))
    except BaseException:  # noqa: BLE001 - whatever it was, the parent must hear about it
        results.put((rank, "error", traceback.format_exc()))


def _free_port() -> int:
    """A free ephemeral port on 127.0.0.1 (bind port 0, let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    """Put CHILD_ENV into os.environ while children are spawned (they inherit it), then restore."""
    saved = {key: os.environ.get(key) for key in CHILD_ENV}
    os.environ.update(CHILD_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _drain_errors(results: mp.Queue, window_s: float) -> dict[int, str]:
    """Tracebacks the children report within ``window_s`` (a failing peer often reports late)."""
    errors: dict[int, str] = {}
    deadline = time.monotonic() + window_s
    with contextlib.suppress(queue.Empty):
        while (left := deadline - time.monotonic()) > 0:
            rank, status, payload = results.get(timeout=left)
            if status == "error":
                errors[rank] = payload
    return errors


def _failure(label: str, headline: str, errors: dict[int, str]) -> RuntimeError:
    """One RuntimeError carrying every child traceback collected (the root cause may be any)."""
    parts = [f"{label}: {headline}"]
    parts += [f"--- {RPC_NAMES[rank]} (rank {rank}) traceback:\n{text}"
              for rank, text in sorted(errors.items())]
    return RuntimeError("\n".join(parts))


def _await_results(label: str, procs: list[mp.Process], results: mp.Queue,
                   deadline: float) -> dict[int, object]:
    """Each rank's result; RuntimeError on a child's error, death or the deadline."""
    done: dict[int, object] = {}
    while len(done) < len(procs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{label}: no result within {GLOBAL_TIMEOUT_S} s")
        try:
            rank, status, payload = results.get(timeout=POLL_INTERVAL_S)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise _failure(label, f"{dead[0].name} exited with {dead[0].exitcode}",
                               _drain_errors(results, FAILURE_GRACE_S)) from None
            continue
        if status == "error":
            # The first report is often the peer's "connection reset", not the cause: wait
            # briefly for the other rank's traceback too.
            errors = {rank: payload, **_drain_errors(results, FAILURE_GRACE_S)}
            raise _failure(label, "child process failed", errors)
        done[rank] = payload
    return done


def _reap(procs: list[mp.Process], grace_s: float) -> None:
    """Join every process for up to ``grace_s`` in all, then terminate, then kill the rest."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for stop in ("terminate", "kill"):
        for proc in procs:
            if proc.is_alive():
                getattr(proc, stop)()
                proc.join(timeout=5.0)


def _launch(label: str, body: Callable[[int, list[int], int], object], sizes: list[int],
            repeats: int, threads: int) -> dict[int, object]:
    """Run ``body`` in a fresh sender/receiver pair; return each rank's result, never hang."""
    for nbytes in sizes:
        if nbytes <= 0 or nbytes % 4:
            raise ValueError(f"nbytes must be a positive multiple of 4 (float32), got {nbytes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (_free_port(), threads, list(sizes), repeats, results)
    procs = [ctx.Process(target=_child, args=(body, rank, *args), name=RPC_NAMES[rank],
                         daemon=True)  # daemon: also gone if the parent itself dies
             for rank in range(WORLD_SIZE)]
    grace = FAILURE_GRACE_S
    try:
        with _child_environment():
            for proc in procs:
                proc.start()
        out = _await_results(label, procs, results, time.monotonic() + GLOBAL_TIMEOUT_S)
        grace = SHUTDOWN_GRACE_S
        return out
    finally:
        _reap(procs, grace)
        results.close()
        results.join_thread()


def _result(transport: str, nbytes: int, latency_s: float, rss_per_byte: float) -> TransferResult:
    """A TransferResult, with the throughput derived from the median latency."""
    return TransferResult(transport, nbytes, latency_s, nbytes / latency_s / 1e9, rss_per_byte)


def run_gloo(sizes: list[int], repeats: int, threads: int = 1) -> list[TransferResult]:
    """gloo send/recv + 1-element ack between two fresh processes, one result per size."""
    out = _launch("gloo send/recv", _gloo_body, sizes, repeats, threads)
    return [_result("gloo send/recv", nbytes, latency, rss)
            for nbytes, latency, rss in zip(sizes, out[SENDER], out[RECEIVER])]


def run_torch_rpc(sizes: list[int], repeats: int, threads: int = 1) -> list[TransferResult]:
    """torch.rpc (TensorPipe) echo between two fresh processes, one result per size."""
    out = _launch("torch.rpc echo", _rpc_body, sizes, repeats, threads)
    return [_result("torch.rpc echo", nbytes, latency, rss)
            for nbytes, (latency, rss) in zip(sizes, out[SENDER])]


# --- script -------------------------------------------------------------------------------------

def format_size(nbytes: int) -> str:
    """4096 -> '4 KiB', 1 << 20 -> '1 MiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def format_table(rows: list[tuple[TransferResult, int]]) -> str:
    """A small text table of (result, repeats) rows."""
    header = (f"{'transport':<16} {'size':>8} {'repeats':>7} {'median ms':>11} {'GB/s':>7} "
              f"{'rss/byte':>9}")
    lines = [header]
    for res, repeats in rows:
        lines.append(f"{res.transport:<16} {format_size(res.nbytes):>8} {repeats:>7} "
                     f"{res.latency_s * 1e3:>11.3f} {res.gbps:>7.3f} {res.rss_per_byte:>9.3f}")
    return "\n".join(lines)


def main() -> None:
    """Run both baselines at the lead's four sizes (fresh processes per size) and print a table."""
    start = time.perf_counter()
    rows = []
    for run in (run_gloo, run_torch_rpc):
        for nbytes in DEFAULT_SIZES:
            repeats = default_repeats(nbytes)
            rows.extend((res, repeats) for res in run([nbytes], repeats))
    print(format_table(rows))
    print(f"wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
