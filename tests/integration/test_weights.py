"""Weights read where they lie: a transformers Llama built on the meta device, deployed over 4 shards with its weights
in a sharded checkpoint that save_pretrained wrote (several files and an index), on a local disk and on S3 (a moto
server); each shard reads only its own stage's bytes, and training equals one process loaded from the same files."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from shardtrain.checkpoint import read_safetensors, write_safetensors
from shardtrain.errors import InvalidArgument, PermissionDenied
from tests.integration.test_data_source import BUCKET, s3  # noqa: F401,F811 - the moto server fixture
from tests.integration.test_library_models import ADAMW, STEPS, TOLERANCE, largest_difference, llama, text_batches, \
    train_in_the_loop
from tests.integration.test_metrics import scrape, total

transformers = pytest.importorskip("transformers")
PREFIX = f"s3://{BUCKET}/weights/"


@pytest.fixture(scope="module")
def saved(tmp_path_factory, s3):  # noqa: F811
    """A Llama saved as a sharded checkpoint, locally and on S3, and the model it was saved from."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = llama()
    root = tmp_path_factory.mktemp("weights")
    model.save_pretrained(root / "llama", max_shard_size="20KB")
    s3.put(str(root / "llama"), f"{PREFIX}llama", recursive=True)
    return root, model


@pytest.fixture(scope="module")
def cluster(saved):
    from client_sdk import Cluster
    with Cluster.local(num_shards=4, data_roots=[str(saved[0]), PREFIX], metrics=True) as cluster:
        yield cluster


def on_meta(model):
    with torch.device("meta"):
        return type(model)(model.config)


def deploy(cluster, model, batches, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cluster.deploy(model, optimizer=ADAMW, example_kwargs=batches[0], balance="parameters", **options)


def read_bytes(cluster) -> dict[str, float]:
    return {address: total(scrape(url), "shardtrain_tensor_bytes_total", direction="received", kind="weights",
                           path="storage") for address, url in cluster.metrics_urls.items()}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_model_on_meta_trains_from_a_sharded_checkpoint_each_shard_reading_its_own_stage(cluster, saved, where):
    root, model = saved
    files = os.listdir(root / "llama")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 4
    source = str(root / "llama") if where == "local" else f"{PREFIX}llama"
    batches = text_batches(STEPS)
    before = read_bytes(cluster)
    remote = deploy(cluster, on_meta(model), batches, weights=source)
    after = read_bytes(cluster)
    assert len(remote.placements) == 4
    checkpoint = model.state_dict()
    for placement in remote.placements:  # every tensor of its stage once, and nothing else
        own = sum(checkpoint[key].nbytes for key in placement.state_keys if key in checkpoint)
        assert after[placement.shard_address] - before[placement.shard_address] == own, placement

    local = transformers.LlamaForCausalLM.from_pretrained(root / "llama")
    losses = train_in_the_loop(remote, batches, remote)
    expected = train_in_the_loop(local, batches, ADAMW[0](local.parameters(), **ADAMW[1]))
    assert max(abs(a - b) for a, b in zip(losses, expected)) < TOLERANCE
    difference, key = largest_difference(remote.state_dict(), local.state_dict())
    assert difference < TOLERANCE, key


def test_a_tied_head_is_read_from_the_embedding_the_checkpoint_keeps(cluster, saved):
    """save_pretrained stores GPT-2's head once, as the embedding: the head's stage reads it under that name."""
    root, _ = saved
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    gpt2 = transformers.GPT2LMHeadModel(config)
    gpt2.save_pretrained(root / "gpt2")
    assert "lm_head.weight" not in read_safetensors(root / "gpt2" / "model.safetensors")
    remote = deploy(cluster, on_meta(gpt2), text_batches(1), weights=root / "gpt2" / "model.safetensors")
    assert "lm_head.weight" in remote.placements[-1].state_keys
    difference, key = largest_difference(remote.state_dict(), gpt2.state_dict())
    assert difference == 0, key


def test_weights_that_do_not_fit_are_refused_naming_the_tensor_and_change_nothing(cluster, saved, tmp_path):
    root, model = saved
    batches = text_batches(1)
    remote = deploy(cluster, on_meta(model), batches, weights=root / "llama")
    wider = transformers.LlamaConfig(**{**model.config.to_dict(), "intermediate_size": 96})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaForCausalLM(wider).save_pretrained(root / "wider", max_shard_size="20KB")
    with pytest.raises(InvalidArgument, match=r"mlp\.\w+_proj\.weight.*torch.float32 of shape \[(96, 32|32, 96)\].*"
                                              r"stage holds a torch.float32 of shape \[(64, 32|32, 64)\]"):
        remote.load_weights(root / "wider")
    state = {key: value for key, value in model.state_dict().items() if key != "lm_head.weight"}
    write_safetensors(root / "headless.safetensors", state)
    with pytest.raises(InvalidArgument, match=r"no tensor 'lm_head\.weight'"):
        remote.load_weights(root / "headless.safetensors")
    write_safetensors(tmp_path / "model.safetensors", model.state_dict())
    with pytest.raises(PermissionDenied, match="outside this shard's data roots"):
        remote.load_weights(tmp_path)
    difference, key = largest_difference(remote.state_dict(), model.state_dict())
    assert difference == 0, key

    remote(**batches[0]).loss.backward()  # a checkpoint of this project's loads as weights too
    remote.step()
    trained = remote.state_dict()
    remote.save_checkpoint(tmp_path / "run", on_shards=False)
    remote.load_weights(root / "llama")
    assert largest_difference(remote.state_dict(), model.state_dict())[0] == 0
    remote.load_weights(tmp_path / "run")
    difference, key = largest_difference(remote.state_dict(), trained)
    assert difference == 0, key
