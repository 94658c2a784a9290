"""A LoadStage request checked before the shard changes anything: ids, stage and replica numbers, addresses."""

from __future__ import annotations

import re

from shardtrain import precision, recompute_modes
from shardtrain.addresses import is_host_port
from shardtrain.errors import InvalidArgument
from shardtrain.residuals import CLIENT
from shardtrain.schedule import MAX_STAGES

MAX_REPLICAS = 1024
MAX_SHARDS = 4096  # in plan.shard_addresses: no coordinator registers more
_DEPLOYMENT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_RESIDUAL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,127}")


def check_load(request) -> None:
    """InvalidArgument naming the first field of a LoadStageRequest that no coordinator would send."""
    if not _DEPLOYMENT_ID.fullmatch(request.deployment_id):
        raise InvalidArgument(f"deployment_id {request.deployment_id[:80]!r} must be 1-64 letters, digits, _ or -")
    recompute_modes.check(request.recompute)
    precision.check(request.precision)
    plan = request.plan
    _check_range("plan.num_stages", plan.num_stages, 1, MAX_STAGES)
    _check_range("plan.stage", plan.stage, 0, plan.num_stages - 1)
    _check_range("plan.num_replicas", plan.num_replicas, 0, MAX_REPLICAS)  # 0, as left unset: one
    _check_range("plan.replica", plan.replica, 0, max(plan.num_replicas, 1) - 1)
    _check_address("plan.previous_address", plan.previous_address, required=False)
    _check_address("plan.next_address", plan.next_address, required=False)
    if plan.replica > 0:
        _check_address("plan.rendezvous", plan.rendezvous, required=True)
    if len(plan.shard_addresses) > MAX_SHARDS:
        raise InvalidArgument(f"plan.shard_addresses names {len(plan.shard_addresses)} shards; at most {MAX_SHARDS}")
    for address in plan.shard_addresses:
        _check_address("an address of plan.shard_addresses", address, required=True)
    first, last = plan.stage == 0, plan.stage == plan.num_stages - 1
    for source in plan.incoming_residuals:  # the first stage's may come from the SDK (CLIENT, no address)
        _check_residual(source.name)
        _check_range(f"producer_stage of residual {source.name!r}", source.producer_stage,
                     CLIENT if first else 0, plan.stage - 1)
        _check_address(f"producer_address of residual {source.name!r}", source.producer_address,
                       required=source.producer_stage != CLIENT)
    for sink in plan.outgoing_residuals:  # the last stage's may go to the SDK
        _check_residual(sink.name)
        for consumer, address in zip(sink.consumer_stages, sink.consumer_addresses, strict=False):
            to_client = last and consumer == CLIENT
            if not to_client:
                _check_range(f"a consumer stage of residual {sink.name!r}", consumer, plan.stage + 1,
                             plan.num_stages - 1)
            _check_address(f"a consumer address of residual {sink.name!r}", address, required=not to_client)


def _check_range(what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidArgument(f"{what} is {value}; expected an integer in [{low}, {high}]")


def _check_address(what: str, address: str, required: bool) -> None:
    if (address or required) and not is_host_port(address):
        raise InvalidArgument(f"{what} {address[:80]!r} is not host:port")


def _check_residual(name: str) -> None:
    if not _RESIDUAL_NAME.fullmatch(name):
        raise InvalidArgument(f"residual name {name[:80]!r} must be an identifier of at most 128 characters")
