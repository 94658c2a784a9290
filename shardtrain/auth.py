"""Who a caller is, by the token it presents, and what each role may call.

Three roles: a *client* deploys and trains (the SDK), a *shard* registers and carries the stages' own traffic
(the shards, and the coordinator when it loads stages), a *reader* may only read (shards, state, descriptions).
A deployment with one token gives every role to its holders; separate shard and reader tokens take those roles
away from the client token, so that a client cannot pose as a shard, and a reader cannot train or deploy.
"""

from __future__ import annotations

import hmac
import logging
import secrets

import grpc

from shardtrain import logs
from shardtrain.errors import PermissionDenied
from shardtrain.settings import Security

log = logging.getLogger("shardtrain.auth")

CLIENT, SHARD, READER = "client", "shard", "reader"
_READING = frozenset({CLIENT, SHARD, READER})
_TRAINING = frozenset({CLIENT, SHARD})
# Which roles may call each method; a method left out is refused to every role.
ALLOWED: dict[str, frozenset[str]] = {
    "CoordinatorService/RegisterShard": frozenset({SHARD}),
    "CoordinatorService/ListShards": _READING,
    "CoordinatorService/Deploy": frozenset({CLIENT}),
    "CoordinatorService/PlanSchedule": frozenset({CLIENT}),
    "CoordinatorService/DescribeDeployment": _READING,
    "ShardService/LoadStage": frozenset({SHARD}),
    "ShardService/ProfileLayers": frozenset({SHARD}),
    "ShardService/LoadState": frozenset({CLIENT}),
    "ShardService/LoadOptimizerState": frozenset({CLIENT}),
    "ShardService/ReadState": _READING,
    "ShardService/ReadOptimizerState": _READING,
    "ShardService/Forward": _TRAINING,
    "ShardService/Backward": _TRAINING,
    "ShardService/AccumulateGradient": _TRAINING,
    "ShardService/FetchTensor": _READING,
    "ShardService/Step": _TRAINING,
    "ShardService/GradientNorm": _TRAINING,
    "ShardService/Describe": _READING,
    "ShardService/ProbeSharedMemory": _READING,
    "ShardService/Snapshot": frozenset({CLIENT}),
    "ShardService/RestoreStage": frozenset({CLIENT}),
    "ShardService/DropSnapshot": frozenset({CLIENT}),
    "ShardService/CopySnapshot": frozenset({CLIENT}),
    "ShardService/SaveCheckpoint": frozenset({CLIENT}),
    "ShardService/LoadCheckpoint": frozenset({CLIENT}),
    "ShardService/LoadWeights": frozenset({CLIENT}),
    "ShardService/Link": _TRAINING,  # and the link's own role must be the caller's (ShardServicer.Link checks)
    "ServerReflection/ServerReflectionInfo": _READING,  # the contract, as protos/ has it
}


# Open to callers without a token: a health probe learns only whether the server serves.
OPEN = frozenset({"Health/Check", "Health/Watch"})


DEPLOYMENT_METADATA = "shardtrain-deployment"  # the metadata key of a deployment's secret


def new_deployment_secret() -> str:
    return secrets.token_urlsafe(32)


def check_deployment(context: grpc.aio.ServicerContext, secret: str, what: str) -> None:
    """PermissionDenied unless the call carries the deployment's secret (a deployment without one takes any)."""
    if not secret:
        return
    presented = dict(context.invocation_metadata() or ()).get(DEPLOYMENT_METADATA, "")
    if not hmac.compare_digest(presented.encode(), secret.encode()):
        raise PermissionDenied(f"{what} belongs to the client that deployed it: the call must carry its secret as "
                               f"the {DEPLOYMENT_METADATA!r} metadata (DeployResponse.deployment_secret)")


def with_deployment(metadata: tuple[tuple[str, str], ...], secret: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that also carries a deployment's secret."""
    kept = tuple(entry for entry in metadata if entry[0] != DEPLOYMENT_METADATA)
    return kept + ((DEPLOYMENT_METADATA, secret),) if secret else kept


CONTROL_METADATA = "shardtrain-control"  # the metadata key of the secret a shard registered with its coordinator


def check_control(context: grpc.aio.ServicerContext, key: str, method: str) -> None:
    """PermissionDenied unless the call carries `key`, the secret this shard registered with its coordinator:
    whoever holds a token that grants the shard role (every role, with one token) is not thereby the coordinator."""
    presented = dict(context.invocation_metadata() or ()).get(CONTROL_METADATA, "")
    if not hmac.compare_digest(presented.encode(), key.encode()):
        raise PermissionDenied(f"{method} comes only from the coordinator this shard registered with (it presents "
                               f"the shard's key as the {CONTROL_METADATA!r} metadata); deploy through the "
                               "coordinator instead")


def with_control(metadata: tuple[tuple[str, str], ...], key: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that also carries a shard's control key."""
    return tuple(entry for entry in metadata if entry[0] != CONTROL_METADATA) + ((CONTROL_METADATA, key),)


def roles_of(presented: str, security: Security) -> frozenset[str]:
    """The roles the `authorization` metadata `presented` grants (empty: none), compared in constant time."""
    granted: set[str] = set()
    for role, token in ((CLIENT, security.token), (SHARD, security.shard_token), (READER, security.reader_token)):
        if token and hmac.compare_digest(presented.encode(), f"Bearer {token}".encode()):
            granted.add(role)
    if CLIENT in granted:  # the client token holds every role no token of its own takes away
        granted |= {role for role, token in ((SHARD, security.shard_token), (READER, security.reader_token))
                    if not token}
    return frozenset(granted)


def caller_roles(context: grpc.aio.ServicerContext, security: Security) -> frozenset[str]:
    """The roles of the caller of the current call (every role on a server without tokens)."""
    if not security.token:
        return frozenset({CLIENT, SHARD, READER})
    return roles_of(dict(context.invocation_metadata() or ()).get("authorization", ""), security)


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call without a known token (UNAUTHENTICATED), and one whose roles may not call its method
    (PERMISSION_DENIED)."""

    def __init__(self, security: Security):
        self._security = security

    async def intercept_service(self, continuation, details):
        method = details.method.rsplit(".", 1)[-1]  # "/shardtrain.v1.ShardService/Forward" -> "ShardService/Forward"
        if method in OPEN:
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get("authorization", "")
        roles = roles_of(presented, self._security)
        if not roles:
            log.info("refused %s: UNAUTHENTICATED (%s token)", details.method, "a wrong" if presented else "no",
                     extra=logs.fields(method=details.method.rpartition("/")[2], code="UNAUTHENTICATED"))
            return _refusing(await continuation(details), grpc.StatusCode.UNAUTHENTICATED,
                             f"{details.method}: missing or wrong auth token (expected metadata "
                             "'authorization: Bearer <token>')")
        allowed = ALLOWED.get(method, frozenset())
        if not roles & allowed:
            log.info("refused %s: PERMISSION_DENIED (the %s role)", details.method, " or ".join(sorted(roles)),
                     extra=logs.fields(method=details.method.rpartition("/")[2], code="PERMISSION_DENIED"))
            return _refusing(await continuation(details), grpc.StatusCode.PERMISSION_DENIED,
                             f"{details.method}: the {' or '.join(sorted(roles))} token may not call this; it takes "
                             f"the {' or '.join(sorted(allowed)) or 'no'} role")
        return await continuation(details)


def _refusing(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode,
              message: str) -> grpc.RpcMethodHandler | None:
    """A handler of the same kind as `handler` that answers every call with `code` and `message`."""
    async def refuse(_request, context):
        await context.abort(code, message)

    async def refuse_stream(_request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return None
    if handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream)
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    make = grpc.stream_unary_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    return make(refuse)
