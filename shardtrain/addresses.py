"""What an address is: host:port a peer can be dialled at, and whether a bind address is this host's alone."""

from __future__ import annotations

import re

# host:port, the host a name, an IPv4 address or a bracketed IPv6 one.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9_.-]{1,253}):(\d{1,5})")


def is_host_port(address: str) -> bool:
    """True for `host:port` with a port in 1-65535: what a shard registers as, and what a stage plan names."""
    match = _HOST_PORT.fullmatch(address)
    return match is not None and 0 < int(match.group(2)) < 65536


def is_loopback(address: str) -> bool:
    """True when a bind address (host:port, [v6]:port or unix:path) is reachable from this host only."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")
