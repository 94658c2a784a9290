"""gRPC channels to a coordinator or shard: message limits, TLS, and the aio channel itself.

Apart from rpc.py so that a process that only asks a question (`shardtrain health`) imports grpc and the
settings, never torch: a container's health probe runs every few seconds.
"""

from __future__ import annotations

import pathlib

import grpc

from shardtrain.settings import Security

# Control messages (a deploy carries every captured graph) can be large; tensors travel in
# chunks far below this, so the limit only bounds what one message may allocate.
MAX_MESSAGE_BYTES = 256 << 20
# HTTP/2 flow control stays at grpc's defaults (BDP probing on): no option measured beat them
# (docs/performance.md).
# A service that restarts (a coordinator, a shard's spare) answers again within a quarter second of serving:
# grpc's own reconnect backoff grows to two minutes while a peer is down, and a call on the waiting channel
# fails at once, so a client heard "unavailable" for seconds after the new process was ready. Trying a
# local or LAN address four times a second while it is down costs nothing worth counting.
RECONNECT_BACKOFF_MS = 250
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
]


def read_pem(path: str) -> bytes:
    """The bytes of a PEM file (a certificate chain, a key or a CA) named by the security settings."""
    return pathlib.Path(path).read_bytes()


def open_channel(address: str, security: Security) -> grpc.aio.Channel:
    """An aio channel to `address`, over TLS when security names a CA."""
    if not security.tls_ca:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = list(CHANNEL_OPTIONS)
    if security.tls_server_name:
        options.append(("grpc.ssl_target_name_override", security.tls_server_name))
    key, chain = (read_pem(security.tls_key), read_pem(security.tls_cert)) if security.tls_cert and security.tls_key \
        else (None, None)  # a client certificate, for servers that ask for one (mutual TLS)
    credentials = grpc.ssl_channel_credentials(root_certificates=read_pem(security.tls_ca), private_key=key,
                                               certificate_chain=chain)
    return grpc.aio.secure_channel(address, credentials, options=options)
