"""Models nobody on this project wrote, deployed as their library documents calling them: transformers' GPT-2 (its
head tied to its embedding), Llama, BERT, ResNet and ViT, built from small configs with random weights, cut block
by block over every shard, and trained equal to one process."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

STEPS = 5
TOLERANCE = 1e-5


def gpt2():
    config = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), text_batches


def llama():
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config), text_batches


def bert():
    config = transformers.BertConfig(vocab_size=61, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config), label_batches


def resnet():
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 16, 32],
                                       depths=[1, 1, 1, 1], layer_type="basic", num_labels=5)
    return transformers.ResNetForImageClassification(config), image_batches(32)


def vit():
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=4,
                                    num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(config), image_batches(16)


def text_batches(steps: int, rows: int = 4, length: int = 12) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, 61, (rows, length), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return batches


def label_batches(steps: int, rows: int = 4, length: int = 12) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 61, (rows, length), generator=generator),
             "attention_mask": torch.ones(rows, length, dtype=torch.int64),
             "labels": torch.randint(0, 3, (rows,), generator=generator)} for _ in range(steps)]


def image_batches(size: int):
    def batches(steps: int, rows: int = 4) -> list[dict]:
        generator = torch.Generator().manual_seed(1)
        return [{"pixel_values": torch.randn(rows, 3, size, size, generator=generator),
                 "labels": torch.randint(0, 5, (rows,), generator=generator)} for _ in range(steps)]
    return batches


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "resnet": resnet, "vit": vit}


def build(name: str):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, batches = MODELS[name]()
    return model, batches(STEPS)


ADAMW = (torch.optim.AdamW, {"lr": 1e-3})
# Micro-batches sum gradients in another order than one full batch. Adam scales a gradient that is zero but for
# rounding (an attention key's bias: softmax ignores a shift of every key) up to a full step, so pipelined steps are
# compared under SGD, which keeps rounding at the size of rounding.
SGD = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


def deploy(cluster, model, batches, optimizer=ADAMW, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own notes on configs, frozen Python reads
        return cluster.deploy(model, optimizer=optimizer, example_kwargs=batches[0], **options)


def largest_difference(remote: dict, local: dict) -> tuple[float, str]:
    """The largest difference between two state dicts of the same keys, and its key."""
    assert set(remote) == set(local)
    return max(((remote[key] - local[key]).abs().max().item(), key) for key in local)


def train_in_the_loop(model, batches, optimizer) -> list[float]:
    """The losses of a loop of model(**batch).loss, backward, optimizer.step() and zero_grad(); a deployed model
    is its own optimizer."""
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_locally(model, batches, optimizer=ADAMW):
    return train_in_the_loop(model, batches, optimizer[0](model.parameters(), **optimizer[1]))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_library_model_is_cut_block_by_block_over_every_shard_and_trains_in_the_loop_as_one_process(cluster4,
                                                                                                      name):
    local, batches = build(name)
    remote = deploy(cluster4, copy.deepcopy(local), batches)
    assert len({p.shard_address for p in remote.placements}) == 4  # every shard holds blocks
    losses = train_in_the_loop(remote, batches, remote)
    expected = train_locally(local, batches)
    assert losses == pytest.approx(expected, abs=TOLERANCE)
    assert largest_difference(remote.state_dict(), local.state_dict()) < (TOLERANCE, "")


# torch.distributed.pipelining's spellings ("1F1B", "ZBH1") among this project's
@pytest.mark.parametrize("name, schedule", [("gpt2", "1f1b"), ("gpt2", "zb-h1"), ("llama", "ZBH1"),
                                            ("bert", "1F1B"), ("vit", "zb-h1")])  # both schedules, every model
def test_a_library_model_trains_with_a_pipelined_schedule_as_one_process(cluster4, name, schedule):
    local, batches = build(name)
    # balanced by parameter counts: the loop's test above covers the default, measured on the shards
    remote = deploy(cluster4, copy.deepcopy(local), batches, optimizer=SGD, balance="parameters")
    losses = [remote.train_step(batch, loss_output="loss", microbatches=2, schedule=schedule) for batch in batches]
    expected = train_locally(local, batches, optimizer=SGD)
    assert losses == pytest.approx(expected, abs=TOLERANCE)
    assert largest_difference(remote.state_dict(), local.state_dict()) < (TOLERANCE, "")


def test_gpt2_on_two_replicas_trains_with_train_step_as_one_process(cluster4):
    local, batches = build("gpt2")
    remote = deploy(cluster4, copy.deepcopy(local), batches, optimizer=SGD, replicas=2, balance="parameters")
    assert len({p.shard_address for p in remote.placements}) == 2  # 2 stages per replica, 4 shards
    losses = [remote.train_step(batch, loss_output="loss", microbatches=2, schedule="1f1b") for batch in batches]
    assert losses == pytest.approx(train_locally(local, batches, optimizer=SGD), abs=TOLERANCE)
    state = remote.state_dict()
    assert largest_difference(state, local.state_dict()) < (TOLERANCE, "")
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # still one tensor


def test_gpt2_splits_where_its_blocks_start_and_evaluates_a_shorter_sequence_as_one_process(cluster4):
    local, batches = build("gpt2")
    sequence = torch.export.Dim("sequence", max=16)
    dims = {"input_ids": {1: sequence}, "attention_mask": {1: sequence}, "labels": {1: sequence}}
    remote = deploy(cluster4, copy.deepcopy(local), batches, split_points=["transformer.h.1", "transformer.h.2",
                                                                           "transformer.h.3"], dynamic_shapes=dims)
    assert [p.layers[0].split()[0] for p in remote.placements[1:]] == \
        ["transformer.h.1", "transformer.h.2", "transformer.h.3"]
    short = {key: value[:, :5] for key, value in batches[0].items()}
    local.eval()
    remote.eval()
    with torch.no_grad():
        expected, got = local(**short), remote(**short)
    assert got.logits.shape == (4, 5, 61)
    assert (got.logits - expected.logits).abs().max() < TOLERANCE and abs(got.loss - expected.loss) < TOLERANCE


def test_a_cache_the_model_returns_comes_back_as_none_with_one_warning(cluster4):
    local, batches = build("gpt2")
    assert local.config.use_cache  # the default: GPT-2 returns a DynamicCache
    with pytest.warns(UserWarning, match=r"returns cache \(DynamicCache\).*use_cache=False"):
        remote = cluster4.deploy(copy.deepcopy(local), example_kwargs=batches[0], num_stages=4)
    output = remote(**batches[0])
    assert output.past_key_values is None and output.logits.shape == (4, 12, 61)
    remote.zero_grad()


class TwoParts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.second(self.first(x))


def test_a_default_deploy_that_leaves_shards_idle_says_so(cluster4):
    with pytest.warns(UserWarning, match="uses 2 of 4 shards and leaves 2 idle: the model has 2 parts"):
        cluster4.deploy(TwoParts(), example_input=torch.randn(4, 3))
