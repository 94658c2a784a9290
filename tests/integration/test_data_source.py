"""Training data the shards read themselves (DataSource): each replica's first and last stage read their share from
S3 (a moto server on this machine) or from local files, and the training equals the same one fed from the client;
a read the shard refuses fails that step only."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import fsspec
import numpy
import pytest
import torch
from torch import nn

from client_sdk import Cluster, DataSource
from shardtrain.checkpoint import write_safetensors
from shardtrain.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from tests.integration.test_metrics import scrape, total
from tests.integration.test_whole_models import gpt, token_batches
from tests.integration.training import largest_difference
from tests.ports import free_port

BUCKET = "shardtrain-data"
ADAM = (torch.optim.Adam, {"lr": 1e-2})


def net() -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 2))


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server, with this process's (and so the shards') AWS_* environment pointing at it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.2)
        with pytest.MonkeyPatch.context() as patch:
            for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                                "AWS_DEFAULT_REGION": "us-east-1",
                                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
                patch.setenv(name, value)
            fs = fsspec.filesystem("s3", skip_instance_cache=True)
            fs.mkdir(BUCKET)
            yield fs
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="module")
def local_root(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def cluster(s3, local_root):
    with Cluster.local(num_shards=4, data_roots=[local_root, f"s3://{BUCKET}/train/"], metrics=True) as cluster:
        yield cluster


def regression_files(directory, sizes, seed=0):
    """safetensors files of x (6 features) and y (2 targets), `sizes` rows each."""
    generator = torch.Generator().manual_seed(seed)
    for index, rows in enumerate(sizes):
        x = torch.rand(rows, 6, generator=generator) * 2 - 1
        write_safetensors(directory / f"part-{index}.safetensors", {"x": x, "y": torch.sin(3 * x[:, :2])})


def test_replicas_read_their_shares_from_s3_and_train_as_if_fed_from_the_client(cluster, s3, tmp_path):
    regression_files(tmp_path, [37, 50, 29])
    for path in sorted(tmp_path.iterdir()):
        s3.put(str(path), f"{BUCKET}/train/{path.name}")
    model = cluster.deploy(net(), optimizer=ADAM, num_stages=2, replicas=2)
    ends = {clients.stages[s].address for clients in model._trainer.replicas for s in range(2)}
    assert len(ends) == 4  # two replicas of two stages: every shard is a first or a last stage
    before = {address: scrape(cluster.metrics_urls[address]) for address in ends}
    history = model.fit(DataSource(f"s3://{BUCKET}/train/", batch_size=20, seed=5), epochs=2, microbatches=3,
                        progress=False)
    trained = model.state_dict()
    after = {address: scrape(cluster.metrics_urls[address]) for address in ends}
    for address in ends:  # every shard read rows from storage, and the client sent them no tensor
        def grew(name, **labels):
            return total(after[address], name, **labels) - total(before[address], name, **labels)
        assert grew("shardtrain_link_items_total", direction="received", kind="data", path="storage") > 0
        assert grew("shardtrain_tensor_bytes_total", direction="received", kind="data", path="storage") > 0
        assert grew("shardtrain_tensor_bytes_total", direction="received", kind="target") == 0
        assert grew("shardtrain_tensor_bytes_total", direction="received", kind="residual") == 0

    fed = cluster.deploy(net(), optimizer=ADAM, num_stages=2, replicas=2)
    again = DataSource(f"s3://{BUCKET}/train/", batch_size=20, seed=5)
    losses = [fed.train_step(*batch.read(), "MSELoss", microbatches=3) for epoch in range(2)
              for batch in again.epoch(epoch)]
    assert len(history.losses) == 12 and history.losses == pytest.approx(losses, rel=1e-5, abs=1e-7)
    assert largest_difference(fed.state_dict(), trained) <= 1e-5
    assert history.losses[-1] < history.losses[0]

    # A file that goes away after the plan: the step fails NOT_FOUND on a shard, and nothing changes.
    model = cluster.deploy(net(), optimizer=ADAM, num_stages=2, replicas=2)
    planned = next(iter(DataSource(f"s3://{BUCKET}/train/", batch_size=100, seed=5)))
    weights = model.state_dict()
    s3.rm(f"{BUCKET}/train/part-1.safetensors")
    with pytest.raises(NotFound, match="no such file"):
        model.train_step(planned)
    assert largest_difference(model.state_dict(), weights) == 0


def test_a_model_of_several_inputs_reads_npy_files_and_computes_its_own_loss(cluster, local_root):
    directory = local_root / "tokens"
    directory.mkdir()
    batches = token_batches(steps=4, batch=10)
    for index, (idx, targets) in enumerate(batches):
        numpy.save(directory / f"idx-{index}.npy", idx.numpy())
        numpy.save(directory / f"targets-{index}.npy", targets.numpy())
    source = DataSource(f"local://{directory}/{{field}}-*.npy", inputs={"idx": "idx", "targets": "targets"},
                        target=None, batch_size=8, seed=1)
    remote = gpt()
    model = cluster.deploy(remote, optimizer=(torch.optim.AdamW, {"lr": 3e-3}), example_inputs=batches[0],
                           num_stages=2)
    history = model.fit(source, epochs=1, loss_output=1, microbatches=2, progress=False)
    trained = model.state_dict()
    fed = cluster.deploy(gpt(), optimizer=(torch.optim.AdamW, {"lr": 3e-3}), example_inputs=batches[0], num_stages=2)
    losses = [fed.train_step(batch.read(), loss_output=1, microbatches=2)
              for batch in DataSource(source.url, {"idx": "idx", "targets": "targets"}, None, batch_size=8,
                                      seed=1).epoch(0)]
    assert history.losses == pytest.approx(losses, rel=1e-5)
    assert largest_difference(fed.state_dict(), trained) <= 1e-5


def test_a_read_the_shard_refuses_fails_that_step_and_training_goes_on(cluster, cluster4, local_root, tmp_path):
    regression_files(local_root, [30])
    regression_files(tmp_path, [30])  # outside every data root
    write_safetensors(local_root / "wide.safetensors", {"x": torch.zeros(8, 7), "y": torch.zeros(8, 2)})
    inside, outside = DataSource(str(local_root / "part-*.safetensors"), batch_size=8), \
        DataSource(str(tmp_path), batch_size=8)
    x, y = next(iter(inside)).read()
    for where in (cluster, cluster4):
        model = where.deploy(net(), optimizer=ADAM, num_stages=2)
        model.train_step(x, y, "MSELoss")
        weights = model.state_dict()
        wide = DataSource(str(local_root / "wide.safetensors"), batch_size=8)
        refusals = [(outside, PermissionDenied, "outside this shard's data roots"),
                    (wide, InvalidArgument, r"expected float32 of shape \[batch, 6\], got float32 of shape \[4, 7\]")
                    ] if where is cluster else [(inside, FailedPrecondition, "start it with --data-root")]
        for source, error, message in refusals:
            with pytest.raises(error, match=message):
                model.train_step(next(iter(source)), microbatches=2)
            assert largest_difference(model.state_dict(), weights) == 0  # the failed step changed nothing
        reference = model.train_step(x, y, "MSELoss")  # the model trains on
        assert reference == reference and largest_difference(model.state_dict(), weights) > 0
