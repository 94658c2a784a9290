"""shardtrain.rpc_streams: a request stream read header first, with a bound on how long it may stay quiet."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shardtrain import wire
from shardtrain.errors import DeadlineExceeded, InvalidArgument
from shardtrain.rpc_streams import RequestReader
from shardtrain.v1 import shard_pb2

HEADER = shard_pb2.LoadStateHeader(deployment_id="d")


async def stream(frames, then_stall: bool = False):
    for frame in frames:
        yield frame
    if then_stall:
        await asyncio.sleep(3600)


def frames_of(tensors: dict) -> list:
    return list(wire.framed(shard_pb2.LoadStateRequest, HEADER, tensors))


def test_a_stream_gives_its_header_then_its_tensors():
    async def read():
        reader = RequestReader(stream(frames_of({"w": torch.arange(6.0)})), idle=1.0)
        return await reader.header(), await reader.tensors()
    header, tensors = asyncio.run(read())
    assert header == HEADER and torch.equal(tensors["w"], torch.arange(6.0))


def test_a_stream_that_goes_quiet_ends_with_deadline_exceeded():
    async def read():
        reader = RequestReader(stream(frames_of({"w": torch.arange(6.0)})[:1], then_stall=True), idle=0.05)
        await reader.header()
        return await reader.tensors()
    with pytest.raises(DeadlineExceeded, match="the stream sent nothing for 0.05 s"):
        asyncio.run(read())


def test_a_stream_that_never_starts_ends_with_deadline_exceeded():
    with pytest.raises(DeadlineExceeded):
        asyncio.run(RequestReader(stream([], then_stall=True), idle=0.05).header())


def test_a_stream_without_a_header_is_invalid():
    with pytest.raises(InvalidArgument, match="must start with a header"):
        asyncio.run(RequestReader(stream([])).header())
