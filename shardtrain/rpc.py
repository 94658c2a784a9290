"""The gRPC edge every component shares: servers, peers and the error boundary (channels.py opens channels,
auth.py checks tokens)."""

from __future__ import annotations

import functools
import hmac
import inspect
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from google.protobuf import message_factory

from shardtrain import addresses, auth, codec, enums, errors, logs, metrics, shm, wire
from shardtrain.channels import CHANNEL_OPTIONS, open_channel, read_pem
from shardtrain.request_metrics import RequestMetrics
from shardtrain.settings import Security
from shardtrain.v1 import coordinator_pb2, shard_pb2

SHARD_SERVICE = shard_pb2.DESCRIPTOR.services_by_name["ShardService"]
COORDINATOR_SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]

log = logging.getLogger("shardtrain.rpc")


def tls_server_context(security: Security) -> ssl.SSLContext | None:
    """TLS for a Link's TCP socket on this server: the certificate its gRPC port presents; None without TLS."""
    if not security.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_client_auth:  # openers prove themselves as on the gRPC port
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=security.tls_ca)
    return context


def tls_client_context(security: Security) -> ssl.SSLContext | None:
    """TLS for the Link sockets this process opens: the roots its gRPC channels trust, and its certificate for
    servers that ask for one; None without TLS."""
    if not security.tls_ca:
        return None
    context = ssl.create_default_context(cafile=security.tls_ca)
    if security.tls_cert and security.tls_key:
        context.load_cert_chain(security.tls_cert, security.tls_key)
    return context


def new_server(security: Security) -> grpc.aio.Server:
    """An aio server that counts and times every request when metrics are on (request_metrics.py), and checks
    callers' tokens and roles when a token is configured (auth.py)."""
    interceptors = [RequestMetrics()] if metrics.enabled() else []
    if security.token:
        interceptors.append(auth.RoleInterceptor(security))
    return grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)


def bind(server: grpc.aio.Server, address: str, security: Security) -> int:
    """Binds the server (TLS when security names a certificate) and returns the port it got.

    Without a token a server listens on loopback only, and never over TLS (which proves the server to its
    callers, not the callers to it), unless security says allow_unauthenticated.
    """
    if bool(security.tls_cert) != bool(security.tls_key):
        raise errors.InvalidArgument("TLS needs both --tls-cert and --tls-key")
    if security.tls_client_auth and not (security.tls_cert and security.tls_ca):
        raise errors.InvalidArgument("--tls-client-auth needs --tls-cert, --tls-key and --tls-ca (the CA that signs "
                                     "the callers' certificates)")
    if not security.token and not security.allow_unauthenticated and not security.tls_client_auth:
        if security.tls_cert:
            raise errors.FailedPrecondition(
                "TLS without a token authenticates nobody: give every service and client the same token "
                "(--auth-token-file or SHARDTRAIN_AUTH_TOKEN), or pass --allow-unauthenticated")
        if not addresses.is_loopback(address):
            raise errors.FailedPrecondition(
                f"refusing to serve {address} without a token: anyone who reaches the port could load programs "
                "and read weights; give every service and client the same token (--auth-token-file or "
                "SHARDTRAIN_AUTH_TOKEN), bind 127.0.0.1, or pass --allow-unauthenticated")
    if not security.tls_cert:
        port = server.add_insecure_port(address)
    else:
        pair = [(read_pem(security.tls_key), read_pem(security.tls_cert))]
        credentials = grpc.ssl_server_credentials(pair, root_certificates=read_pem(security.tls_ca)
                                                  if security.tls_client_auth else None,
                                                  require_client_auth=security.tls_client_auth)
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise errors.Unavailable(f"could not bind {address}")
    return port


def _coders(descriptor) -> tuple[Callable, Callable]:
    """(serialize, deserialize) of a message type: Frames for tensor-carrying types, plain protobuf otherwise."""
    message_type = message_factory.GetMessageClass(descriptor)
    if codec.carries_chunks(message_type):
        coder = codec.Codec(message_type)
        return coder.serialize, coder.deserialize
    return message_type.SerializeToString, message_type.FromString


_CLIENT_KINDS = {(False, False): "unary_unary", (False, True): "unary_stream",
                 (True, False): "stream_unary", (True, True): "stream_stream"}


class Stub:
    """A client stub of a service, built from its descriptor, whose tensor-carrying messages travel as Frames."""

    def __init__(self, channel: grpc.aio.Channel, service):
        for method in service.methods:
            serialize, _ = _coders(method.input_type)
            _, deserialize = _coders(method.output_type)
            make = getattr(channel, _CLIENT_KINDS[method.client_streaming, method.server_streaming])
            setattr(self, method.name, make(f"/{service.full_name}/{method.name}", request_serializer=serialize,
                                            response_deserializer=deserialize))


def add_service(server: grpc.aio.Server, servicer: Any, service) -> None:
    """Serves the methods of `service` that `servicer` has (others are UNIMPLEMENTED), with Stub's coders.

    A request that does not parse is answered INVALID_ARGUMENT, as a bad value would be (grpc's own
    answer to a deserializer that raises is INTERNAL, as if the server were at fault).
    """
    handlers = {}
    for method in (m for m in service.methods if hasattr(servicer, m.name)):
        _, deserialize = _coders(method.input_type)
        serialize, _ = _coders(method.output_type)
        kind = _CLIENT_KINDS[method.client_streaming, method.server_streaming]
        handler = _refusing_undecodable(getattr(servicer, method.name), method)
        handlers[method.name] = getattr(grpc, f"{kind}_rpc_method_handler")(
            handler, request_deserializer=_tolerant(deserialize, servicer, method.input_type.full_name),
            response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class Undecodable:
    """What a request that did not parse becomes, so that its handler can refuse it with the right code."""

    def __init__(self, reason: str):
        self.reason = reason


def _tolerant(deserialize: Callable, servicer: Any, type_name: str) -> Callable:
    """`deserialize`, returning Undecodable for bytes that do not parse and for an enum value its enum lacks."""
    def parse(raw: bytes) -> Any:
        where = getattr(servicer, "location", "server")
        try:
            request = deserialize(raw)
        except Exception as error:  # noqa: BLE001 - protobuf and the codec raise several types for bad bytes
            return Undecodable(f"{where}: a request of {len(raw)} bytes is not a valid {type_name} "
                               f"({type(error).__name__})")
        try:
            enums.check(request.message if isinstance(request, codec.Frame) else request)
        except errors.InvalidArgument as error:
            return Undecodable(f"{where}: {error}")
        return request
    return parse


def _refusing_undecodable(handler: Callable, method) -> Callable:
    """`handler`, answering INVALID_ARGUMENT for an undecodable request (a streamed one ends the stream so)."""
    if method.client_streaming and inspect.isasyncgenfunction(handler):
        async def responding(requests, context):
            async for response in handler(_decodable(requests), context):
                yield response
        return responding
    if method.client_streaming:  # a unary answer, or responses written with context.write
        async def client_stream(requests, context):
            return await handler(_decodable(requests), context)
        return client_stream
    if method.server_streaming:
        async def streaming(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            async for response in handler(request, context):
                yield response
        return streaming

    async def unary(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await handler(request, context)
    return unary


async def _decodable(requests: AsyncIterator) -> AsyncIterator:
    async for request in requests:
        if isinstance(request, Undecodable):
            raise errors.InvalidArgument(request.reason)
        yield request


def status_message(error: Exception, where: str) -> tuple[grpc.StatusCode, str]:
    """The status code of an exception and its message, naming `where` unless the message already names a place.

    The message is fit to leave the server (errors.public_message): a layer's error can carry torch's traceback.
    """
    if isinstance(error, errors.ShardtrainError):
        return grpc.StatusCode[error.code], errors.located_message(error, where)
    log.exception("unexpected error in %s", where)
    return grpc.StatusCode.INTERNAL, errors.located_message(error, where)


def boundary(method: Callable) -> Callable:
    """Maps exceptions raised by a servicer method to status codes; `self.location` names the server."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def streaming(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except Exception as error:  # noqa: BLE001 - this is the one boundary
                await context.abort(*_refusal(error, self.location, method.__name__, context, request))
        return streaming

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as error:  # noqa: BLE001 - this is the one boundary
            await context.abort(*_refusal(error, self.location, method.__name__, context, request))
    return unary


def _refusal(error: Exception, where: str, method: str, context, request) -> tuple[grpc.StatusCode, str]:
    """status_message, logged once with the method, the caller and the deployment the request names: an info line
    for a request the caller got wrong, a warning for a failure here or further on."""
    code, message = status_message(error, where)
    level = logging.INFO if code.name in CALLER_ERRORS else logging.WARNING
    log.log(level, "%s %s from %s: %s %s", "refused" if level == logging.INFO else "failed", method,
            context.peer(), code.name, message,
            extra=logs.fields(method=method, code=code.name, peer=context.peer(), **_deployment_of(request)))
    return code, message


def _deployment_of(request) -> dict:
    """{"deployment": id} when a request names one (its deployment_id, or its key's); {} for a stream of them."""
    message = request.message if isinstance(request, codec.Frame) else request
    for holder in (message, getattr(message, "key", None)):
        deployment = getattr(holder, "deployment_id", "")
        if deployment and isinstance(deployment, str):
            return {"deployment": deployment}
    return {}


# Codes that say the request was wrong, not the server or its peers.
CALLER_ERRORS = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS", "OUT_OF_RANGE",
                           "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "DATA_LOSS"})


def translate(error: grpc.aio.AioRpcError, peer: str) -> errors.ShardtrainError:
    """The shardtrain exception for a failed call to `peer`, marked as coming from that peer."""
    code = error.code().name
    details = error.details() or ""
    if code == "UNAVAILABLE":
        message = f"{peer} is unavailable: {details}"
    elif code == "DEADLINE_EXCEEDED" and not details.startswith(("shard", "coordinator")):
        message = f"{peer} did not answer before the deadline: {details}"
    else:
        message = details
    translated = errors.error_for_code(code, message)
    translated.from_peer = True
    return translated


class Peer:
    """One remote service: its channel, a stub, the token and the deadline, with errors translated."""

    def __init__(self, name: str, address: str, service, security: Security, timeout: float):
        self.name = name
        self.address = address
        self.channel = open_channel(address, security)
        self.stub = Stub(self.channel, service)
        self.metadata = security.metadata
        self.tls_server_name = security.tls_server_name
        self._security = security
        self._timeout = timeout
        self.same_host = False  # proved by probe(): this process and the peer can open each other's segments

    @functools.cached_property
    def tls(self) -> ssl.SSLContext | None:
        """TLS for a Link's TCP socket to this peer, as for its channel: made when a link first asks (most peers,
        a deploy's probes among them, never open one)."""
        return tls_client_context(self._security)

    async def probe(self) -> bool:
        """Finds out (once) whether the peer shares this host's /dev/shm and user; False when in doubt."""
        if self.same_host or not shm.available():
            return self.same_host
        try:
            path, token = shm.write_probe()
        except OSError as error:
            log.warning("%s: no room in shared memory for a probe (%s); tensors go by stream", self.name,
                        error.strerror)
            return False
        try:
            response = await self.call("ProbeSharedMemory", shard_pb2.ProbeSharedMemoryRequest(path=path))
        except errors.ShardtrainError as error:
            log.info("%s: no shared-memory path (%s); tensors go by stream", self.name, error)
            return False
        finally:
            shm.remove(path)
        self.same_host = hmac.compare_digest(response.token, token) and response.uid == os.getuid()
        return self.same_host

    async def call(self, method: str, request: Any, timeout: float | None = None,
                   metadata: tuple[tuple[str, str], ...] | None = None) -> Any:
        """A unary-response call (the request may be an async iterator for client streaming), with the peer's
        metadata or `metadata`."""
        try:
            return await getattr(self.stub, method)(request, timeout=timeout or self._timeout,
                                                     metadata=self.metadata if metadata is None else metadata)
        except grpc.aio.AioRpcError as error:
            raise translate(error, self.name) from None

    async def stream(self, method: str, request: Any, timeout: float | None = None) -> AsyncIterator[Any]:
        """A server-streaming call, yielding its messages."""
        call = getattr(self.stub, method)(request, timeout=timeout or self._timeout, metadata=self.metadata)
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as error:
            raise translate(error, self.name) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        """Closes the channel."""
        await self.channel.close()


FETCH_ATTEMPTS = 4  # a FetchTensor stream that breaks is resumed this many times, each after some progress


async def fetch_tensor(peer: Peer, key, name: str) -> Any:
    """One saved tensor of a step from a shard (FetchTensor), resumed where it broke if the stream fails."""
    reader = wire.TensorStreamReader()
    for attempt in range(FETCH_ATTEMPTS):
        offset = reader.resume_offset
        request = shard_pb2.FetchTensorRequest(key=key, name=name, offset=offset, shared_memory=peer.same_host)
        try:
            tensors = await wire.collect(peer.stream("FetchTensor", request), reader)
            break
        except errors.Unavailable:
            if attempt + 1 == FETCH_ATTEMPTS or reader.resume_offset == offset:
                raise  # nothing arrived this time: the peer is gone, not the stream interrupted
            log.warning("fetch of %r from %s broke at byte %d; resuming", name, peer.name, reader.resume_offset)
    if name not in tensors:
        raise errors.InvalidArgument(f"{peer.name} sent {sorted(tensors)} instead of {name!r}")
    return tensors[name]
