"""A shard's connections to other shards: who its peers are and how tensors reach each.

It decides per peer whether tensors go through shared memory (a peer that proved it shares this host)
and in which wire encoding (the deployment's choice per tensor kind). It calls only the shards of its current
deployment, as the coordinator named them in the stage's plan: every call carries this shard's own token, so an
address a caller picked (a snapshot's source) must be one of them.
"""

from __future__ import annotations

import asyncio

from shard_service.snapshots import Snapshot
from shardtrain import auth, optim, shm, wire
from shardtrain.errors import PermissionDenied
from shardtrain.rpc import SHARD_SERVICE, Peer
from shardtrain.rpc_streams import RequestReader
from shardtrain.settings import ShardSettings
from shardtrain.v1 import shard_pb2, tensor_pb2


class Peers:
    """Peers by address for one shard, with the current deployment's wire encodings and secret."""

    def __init__(self, settings: ShardSettings):
        self.settings = settings
        self.encodings = tensor_pb2.WireEncodings()  # exact until a deployment asks otherwise
        self.segments = shm.SegmentPool() if settings.shared_memory and shm.available() else None
        self._peers: dict[str, Peer] = {}
        self._secret = ""  # the deployment's, carried by the calls and links this shard makes for it
        self._members: frozenset[str] = frozenset()  # the deployment's shards: the only addresses this one calls

    def check_member(self, address: str) -> None:
        """PermissionDenied unless `address` is a shard of the current deployment."""
        if address not in self._members:
            named = ", ".join(sorted(self._members)[:8]) or "none: it holds no deployment"
            raise PermissionDenied(f"{address[:80]!r} is not a shard of this shard's deployment ({named}); it calls "
                                   "no other address, since its calls carry its own token")

    def peer(self, address: str) -> Peer:
        """The Peer at `address`, a shard of the deployment, opened on first use."""
        self.check_member(address)
        if address not in self._peers:
            peer = Peer(f"shard at {address}", address, SHARD_SERVICE, self.settings.security,
                        self.settings.timeouts.rpc)
            peer.metadata = auth.with_deployment(peer.metadata, self._secret)
            self._peers[address] = peer
        return self._peers[address]

    def options(self, same_host: bool, kind: str) -> wire.SendOptions:
        """How to send a tensor of `kind` ("activations", "gradients", "residuals"; "exact" for what must arrive
        bit for bit: a tied weight's gradient) to a peer."""
        segments = self.segments if same_host else None
        encoding = tensor_pb2.ENCODING_NONE if kind == "exact" else getattr(self.encodings, kind)
        return wire.SendOptions(self.settings.chunk_bytes, encoding, segments, self.settings.checksums)

    async def adopt(self, plan: shard_pb2.StagePlan, encodings: tensor_pb2.WireEncodings, secret: str) -> None:
        """Takes a new stage's plan and its deployment's secret; learns which of the peers it sends to share this
        host."""
        self._secret = secret
        neighbours = {plan.previous_address, plan.next_address,
                      *(r.producer_address for r in plan.incoming_residuals),
                      *(a for r in plan.outgoing_residuals for a in r.consumer_addresses)} - {""}
        self._members = frozenset({*plan.shard_addresses, *neighbours,
                                   *(a for tie in plan.tied for a in tie.addresses)})
        for peer in self._peers.values():
            peer.metadata = auth.with_deployment(peer.metadata, secret)
        if self.segments is not None:
            await asyncio.gather(*(self.peer(address).probe() for address in neighbours))
        self.encodings = encodings

    async def read_snapshot(self, address: str, name: str, secret: str) -> Snapshot:
        """Snapshot `name` of the shard at `address`, a shard of the deployment (weights, then optimizer state, each
        chunk checked), on a channel of its own: the call carries the secret of the deployment that took it, not
        the current one's."""
        self.check_member(address)
        peer = Peer(f"shard at {address}", address, SHARD_SERVICE, self.settings.security, self.settings.timeouts.rpc)
        peer.metadata = auth.with_deployment(peer.metadata, secret)
        request = shard_pb2.ReadStateRequest(snapshot=name)
        try:
            weights = await wire.collect(peer.stream("ReadState", request))
            reader = RequestReader(peer.stream("ReadOptimizerState", request))
            header = await reader.header()
            state = optim.KeyedState.parse(header.layout, await reader.tensors())
        finally:
            await peer.close()
        return Snapshot(header.deployment_id, secret, header.snapshot_stage, tuple(header.snapshot_layer_indexes),
                        header.snapshot_optimizer_step, weights, state)

    async def close(self) -> None:
        """Closes every channel and unlinks this shard's shared segments."""
        for peer in self._peers.values():
            await peer.close()
        if self.segments is not None:
            self.segments.close()
