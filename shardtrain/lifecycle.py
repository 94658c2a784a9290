"""Process set-up for services: they end when the client that started them ends, and keep their memory warm."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import signal

_PR_SET_PDEATHSIG = 1
_parent_pid = 0  # the process whose death sends this one SIGTERM (die_with_parent), for stop_reason


def die_with_parent(parent_pid: int) -> None:
    """On Linux, asks for SIGTERM when the parent dies; exits now if it already has (0: do nothing).

    Set by the service itself rather than in a pre-exec hook: a pre-exec hook forces a plain fork,
    and grpc's fork handlers can crash the child before it execs (grpc/grpc#43055).
    """
    global _parent_pid
    if not parent_pid:
        return
    _parent_pid = parent_pid
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(limit: int = 1 << 30) -> bool:
    """Tells glibc malloc to reuse freed blocks up to `limit` bytes instead of returning them to the OS.

    By default, blocks past a (dynamic) threshold are mmap'd fresh and unmapped on free, so every
    new activation, received chunk and gRPC buffer is paid for again in page faults: on this 2-core
    machine a first touch of fresh memory runs at about 2.7 GB/s, a reused block at 13 GB/s.
    `python -m bench.transport --sizes 64M`, 64 MiB over gRPC: 122 ms with glibc's defaults, 77 ms
    with both thresholds raised (one run each; the mmap threshold alone did not help: freed heap
    blocks were still trimmed). The price: a shard's resident memory stays at its high-water mark.
    Returns False where there is no glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    trim = min(2 * limit, 2**31 - 1)  # mallopt takes a C int
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, min(limit, 2**31 - 1)) and libc.mallopt(_M_TRIM_THRESHOLD, trim))


def freeze_imported_objects() -> None:
    """Moves every Python object alive now (torch's modules, classes and functions, which live as long as the
    process) out of the garbage collector's reach. A full collection walks every tracked object while it holds
    the interpreter: with these in it, one stalls health checks (docs/performance.md, "Health under load")."""
    gc.collect()  # what is garbage already is freed, not kept for good
    gc.freeze()


def stop_on_sigterm() -> None:
    """In a service's main task: SIGTERM (docker stop, systemd, Kubernetes, a parent that died) cancels that
    task, so the service reports NOT_SERVING, ends its calls and exits 0. As PID 1 in a container a process
    has no default action for SIGTERM at all: without this, `docker stop` waits and then kills."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)


def stop_reason(raised: BaseException | None) -> str:
    """Why a service's main task ended, for the one line it logs as it exits: the signal (SIGTERM cancels the task,
    Ctrl-C interrupts it), its parent's death, or the error it raised."""
    if isinstance(raised, KeyboardInterrupt):
        return "interrupted (SIGINT)"
    if isinstance(raised, asyncio.CancelledError):
        parent_gone = _parent_pid and os.getppid() != _parent_pid
        return "SIGTERM (its parent process ended)" if parent_gone else "SIGTERM"
    if raised is None:
        return "its server ended"
    return f"{type(raised).__name__}: {raised}"
