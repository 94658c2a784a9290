"""Process lifetime for services that a client started: they end when that client ends."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """On Linux, asks for SIGTERM when the parent dies; exits now if it already has (0: do nothing).

    Set by the service itself rather than in a pre-exec hook: a pre-exec hook forces a plain fork,
    and grpc's fork handlers can crash the child before it execs (grpc/grpc#43055).
    """
    if not parent_pid:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
