"""Shared fixtures: local clusters as real processes, and a check that no test leaves a process behind."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest

from client_sdk import Cluster


def child_processes() -> list[int]:
    """Live (non-zombie) processes whose parent is this test process."""
    children = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    """Fails the session if any shard, coordinator or helper process outlives the tests."""
    yield
    leftovers = child_processes()
    assert not leftovers, f"processes left running after the tests: {leftovers}"


@pytest.fixture(scope="session")
def cluster4():
    """A coordinator and four shards shared by the tests that only deploy and train."""
    with Cluster.local(num_shards=4) as cluster:
        yield cluster


@pytest.fixture
def own_cluster(request):
    """A fresh cluster for a test that breaks things (kills a shard, ...); its logs go with it.

    Two shards, or as many as the test asks with `@pytest.mark.parametrize("own_cluster", [n], indirect=True)`.
    """
    cluster = Cluster.local(num_shards=getattr(request, "param", 2))
    logs = cluster._services.log_dir
    yield cluster
    cluster.close()
    shutil.rmtree(logs, ignore_errors=True)  # kept by close() when a shard had died: here on purpose
