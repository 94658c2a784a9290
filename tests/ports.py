"""A free TCP port on 127.0.0.1, for a server a test starts that cannot take port 0 and report it back."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS's pick for a probe, released at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
