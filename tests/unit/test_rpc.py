"""shardtrain.rpc: translating a failed call into a shardtrain error, the error boundary and the token check."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest

from shardtrain import auth, errors, rpc
from shardtrain.errors import ERRORS
from shardtrain.auth import RoleInterceptor
from shardtrain.rpc import boundary, translate
from shardtrain.settings import Security


def rpc_error(code: grpc.StatusCode, details: str | None) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, initial_metadata=grpc.aio.Metadata(), trailing_metadata=grpc.aio.Metadata(),
                                details=details)


# translate(): a failed call to a peer -> shardtrain exception.

@pytest.mark.parametrize("cls", [cls for cls in ERRORS if cls.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED")],
                         ids=lambda cls: cls.__name__)
def test_translate_maps_each_code_to_its_class_and_keeps_the_details(cls):
    error = translate(rpc_error(grpc.StatusCode[cls.code], "stage 1: expected float32"), "shard 1")
    assert type(error) is cls
    assert str(error) == "stage 1: expected float32"
    assert error.from_peer is True


def test_translate_unavailable_names_the_peer():
    error = translate(rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"), "shard 2")
    assert type(error) is errors.Unavailable
    assert str(error) == "shard 2 is unavailable: failed to connect to all addresses"
    assert error.from_peer is True


def test_translate_deadline_from_the_transport_names_the_peer():
    error = translate(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "coordinator")
    assert type(error) is errors.DeadlineExceeded
    assert str(error) == "coordinator did not answer before the deadline: Deadline Exceeded"


@pytest.mark.parametrize("details", ["shard 1 (stage 0): residual 'res_1' did not arrive within 5 s",
                                     "coordinator: deploy did not finish"])
def test_translate_deadline_raised_by_a_service_keeps_its_own_message(details):
    error = translate(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, details), "shard 2")
    assert type(error) is errors.DeadlineExceeded
    assert str(error) == details


@pytest.mark.parametrize("code", [grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED])
def test_translate_codes_without_a_class_become_internal_error(code):
    error = translate(rpc_error(code, "Method not found!"), "shard 0")
    assert type(error) is errors.InternalError
    assert str(error) == "Method not found!"
    assert error.from_peer is True


def test_translate_without_details_still_names_an_unavailable_peer():
    assert str(translate(rpc_error(grpc.StatusCode.UNAVAILABLE, None), "shard 3")) == "shard 3 is unavailable: "


# boundary(): exceptions in a servicer method become status codes, with the server named once.

class Aborted(Exception):
    """What a real context.abort raises to end the call."""


class FakeContext:
    """Records what the boundary aborts with."""

    def __init__(self):
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise Aborted

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"


class FakeServicer:
    location = "shard 0 (stage 1)"

    def __init__(self, error: Exception | None):
        self.error = error

    @boundary
    async def Unary(self, request, context):
        if self.error:
            raise self.error
        return f"answer to {request}"

    @boundary
    async def Streaming(self, request, context):
        yield 1
        if self.error:
            raise self.error
        yield 2


def call_unary(error: Exception | None):
    context = FakeContext()

    async def run():
        try:
            return await FakeServicer(error).Unary("ping", context)
        except Aborted:
            return None
    return asyncio.run(run()), context.aborted


def call_streaming(error: Exception | None):
    context, received = FakeContext(), []

    async def run():
        try:
            async for item in FakeServicer(error).Streaming("ping", context):
                received.append(item)
        except Aborted:
            pass
    asyncio.run(run())
    return received, context.aborted


def test_boundary_returns_the_answer_when_nothing_fails():
    assert call_unary(None) == ("answer to ping", None)


def test_boundary_maps_a_shardtrain_error_to_its_code_and_names_the_server():
    _, aborted = call_unary(errors.NotFound("no step 7"))
    assert aborted == (grpc.StatusCode.NOT_FOUND, "shard 0 (stage 1): no step 7")


def test_boundary_does_not_rename_an_error_that_came_from_a_peer():
    error = errors.Unavailable("shard 2 is unavailable: connection refused")
    error.from_peer = True
    _, aborted = call_unary(error)
    assert aborted == (grpc.StatusCode.UNAVAILABLE, "shard 2 is unavailable: connection refused")


def test_boundary_turns_an_unexpected_exception_into_internal_with_its_type():
    _, aborted = call_unary(KeyError("weight"))
    assert aborted == (grpc.StatusCode.INTERNAL, "shard 0 (stage 1): unexpected KeyError: 'weight'")


def test_boundary_on_a_stream_keeps_what_was_sent_and_then_aborts():
    received, aborted = call_streaming(errors.DataLoss("tensor 'x': stream ended"))
    assert received == [1]
    assert aborted == (grpc.StatusCode.DATA_LOSS, "shard 0 (stage 1): tensor 'x': stream ended")


def test_boundary_on_a_stream_passes_every_item_when_nothing_fails():
    assert call_streaming(None) == ([1, 2], None)


# RoleInterceptor: calls without a known bearer token, or whose role may not call the method, get a handler
# that refuses them.

@dataclass
class CallDetails:
    method: str
    invocation_metadata: tuple


async def served(request, context):
    return "served"


def intercept(metadata: tuple, method: str = "/shardtrain.v1.ShardService/Forward",
              security: Security = Security(token="s3cret")):
    handler = grpc.unary_unary_rpc_method_handler(served)

    async def continuation(details):
        return handler

    details = CallDetails(method, metadata)
    return asyncio.run(RoleInterceptor(security).intercept_service(continuation, details))


def run_handler(handler):
    context = FakeContext()

    async def run():
        try:
            return await handler.unary_unary("request", context)
        except Aborted:
            return None
    return asyncio.run(run()), context.aborted


def test_interceptor_lets_the_right_token_through():
    assert run_handler(intercept((("authorization", "Bearer s3cret"),))) == ("served", None)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),),
                                      (("x-token", "Bearer s3cret"),)])
def test_interceptor_refuses_a_missing_or_wrong_token_naming_the_method(metadata):
    answer, aborted = run_handler(intercept(metadata))
    assert answer is None
    code, message = aborted
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "/shardtrain.v1.ShardService/Forward" in message and "authorization: Bearer <token>" in message


ROLES = Security(token="client-t", shard_token="shard-t", reader_token="reader-t")


@pytest.mark.parametrize("token, method, served_or_code", [
    ("client-t", "CoordinatorService/Deploy", "served"),
    ("client-t", "ShardService/Forward", "served"),
    ("client-t", "CoordinatorService/RegisterShard", grpc.StatusCode.PERMISSION_DENIED),
    ("client-t", "ShardService/LoadStage", grpc.StatusCode.PERMISSION_DENIED),
    ("shard-t", "CoordinatorService/RegisterShard", "served"),
    ("shard-t", "ShardService/LoadStage", "served"),
    ("shard-t", "ShardService/Forward", "served"),
    ("shard-t", "CoordinatorService/Deploy", grpc.StatusCode.PERMISSION_DENIED),
    ("shard-t", "ShardService/LoadState", grpc.StatusCode.PERMISSION_DENIED),
    ("reader-t", "ShardService/ReadState", "served"),
    ("reader-t", "CoordinatorService/ListShards", "served"),
    ("reader-t", "ShardService/Forward", grpc.StatusCode.PERMISSION_DENIED),
    ("reader-t", "ShardService/LoadState", grpc.StatusCode.PERMISSION_DENIED),
    ("reader-t", "ShardService/Link", grpc.StatusCode.PERMISSION_DENIED),
    ("nobody", "ShardService/ReadState", grpc.StatusCode.UNAUTHENTICATED),
])
def test_each_role_calls_only_its_methods(token, method, served_or_code):
    answer, aborted = run_handler(intercept((("authorization", f"Bearer {token}"),), f"/shardtrain.v1.{method}",
                                            ROLES))
    assert (answer if aborted is None else aborted[0]) == served_or_code


def test_a_refusal_names_the_method_and_the_role_it_takes():
    _, (code, message) = run_handler(intercept((("authorization", "Bearer client-t"),),
                                               "/shardtrain.v1.ShardService/LoadStage", ROLES))
    assert "ShardService/LoadStage: the client token may not call this; it takes the shard role" in message


def test_one_token_gives_every_role_and_a_role_token_takes_its_role_away_from_it():
    assert auth.roles_of("Bearer t", Security(token="t")) == {"client", "shard", "reader"}
    assert auth.roles_of("Bearer t", Security(token="t", shard_token="s")) == {"client", "reader"}
    assert auth.roles_of("Bearer s", Security(token="t", shard_token="s")) == {"shard"}
    assert auth.roles_of("Bearer x", Security(token="t", shard_token="s")) == frozenset()


def test_every_method_of_both_services_has_its_roles_written_down():
    methods = {f"{service.name}/{method.name}" for service in (rpc.SHARD_SERVICE, rpc.COORDINATOR_SERVICE)
               for method in service.methods}
    assert methods | {"ServerReflection/ServerReflectionInfo"} == set(auth.ALLOWED)


def test_a_process_presents_its_roles_token_or_the_client_token():
    assert Security(token="t", shard_token="s", role="shard").metadata == (("authorization", "Bearer s"),)
    assert Security(token="t", role="shard").metadata == (("authorization", "Bearer t"),)
    assert Security(token="t", shard_token="s").metadata == (("authorization", "Bearer t"),)


def bind_without_listening(address: str, security: Security) -> None:
    async def attempt() -> None:
        server = grpc.aio.server()
        try:
            rpc.bind(server, address, security)
        finally:
            await server.stop(None)
    asyncio.run(attempt())


def test_a_server_without_a_token_refuses_a_non_loopback_address_unless_allowed():
    with pytest.raises(errors.FailedPrecondition, match="refusing to serve 0.0.0.0:0 without a token"):
        bind_without_listening("0.0.0.0:0", Security())
    bind_without_listening("0.0.0.0:0", Security(allow_unauthenticated=True))
    bind_without_listening("0.0.0.0:0", Security(token="t"))


def test_tls_without_a_token_refuses_to_start_even_on_loopback():
    with pytest.raises(errors.FailedPrecondition, match="TLS without a token authenticates nobody"):
        bind_without_listening("127.0.0.1:0", Security(tls_cert="/no/cert.pem", tls_key="/no/key.pem"))
