"""The replicas' rendezvous store has no password: what they publish there sits under keys only the
deployment's shards can name."""

from __future__ import annotations

import datetime
import hashlib
import socket

import pytest
import torch
import torch.distributed as dist

from shard_service.replicas import GradientAverager


def test_the_replicas_publish_under_keys_named_after_the_deployment_secret():
    layer = torch.nn.Linear(4, 2)
    averager = GradientAverager(0, 1, "", "127.0.0.1", list(layer.parameters()), timeout=30.0, secret="s3cret")
    try:
        assert averager.connect() == "gloo"
        host, port = averager.hosted.rsplit(":", 1)
        stranger = dist.TCPStore(host, int(port), 1, False, datetime.timedelta(seconds=10))
        assert not stranger.check(["device/0"])  # what a caller without the secret would look for
        prefix = hashlib.sha256(b"shardtrain s3cret").hexdigest()
        assert dist.PrefixStore(prefix, stranger).check(["device/0"])  # there, for the deployment's own shards
    finally:
        averager.close()


def test_the_rendezvous_store_listens_on_the_replicas_own_address_only():
    layer = torch.nn.Linear(4, 2)
    averager = GradientAverager(0, 1, "", "127.0.0.1", list(layer.parameters()), timeout=30.0, secret="s3cret")
    try:
        port = int(averager.hosted.rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
        # Every 127/8 address reaches this host's loopback: a store listening on every interface would answer here.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=10).close()
        assert averager.connect() == "gloo"
    finally:
        averager.close()
