"""Models deployed whole (not an nn.Sequential): captured once with torch.export, cut between submodules, and trained
as one process trains them: a GPT with its head tied to its embedding, a ResNet-shaped CNN with BatchNorm, a model
whose cuts carry token ids and a boolean mask."""

from __future__ import annotations

import copy
import secrets
import statistics
import time

import pytest
import torch
from torch import nn

from examples.gpt import GPT, GPTConfig, generate, loss_of
from client_sdk import Cluster
from client_sdk.processes import LocalServices
from shardtrain.errors import InvalidArgument, ResourceExhausted
from shardtrain.settings import Security, security_env
from tests.integration.training import largest_difference, regression_batches, train_side_by_side

CONFIG = GPTConfig(vocab_size=13, block_size=12, n_layer=4, n_head=2, n_embd=16)
SEQUENCE = {"idx": {1: torch.export.Dim("seq", max=CONFIG.block_size)}}


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def token_batches(steps: int, batch: int = 8, length: int = CONFIG.block_size):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CONFIG.vocab_size, (batch, length), generator=generator),
             torch.randint(0, CONFIG.vocab_size, (batch, length), generator=generator)) for _ in range(steps)]


class SequenceLoss(nn.Module):
    """Cross entropy over every position, for train_step (its loss runs on the last stage)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_of(logits, targets)


def test_a_gpt_computing_its_loss_trains_as_one_process_with_tied_weights_groups_a_schedule_and_clipping(cluster4):
    local, batches = gpt(), token_batches(steps=20)
    remote = copy.deepcopy(local)
    model = cluster4.deploy(remote, optimizer=remote.configure_optimizers(0.1, 3e-3), example_inputs=batches[0],
                            num_stages=3)
    assert [p.stage for p in model.placements] == [0, 1, 2]
    assert {p.cost_unit for p in model.placements} == {"us of forward and backward"}  # balanced by measured time
    optimizer = local.configure_optimizers(0.1, 3e-3)
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=len(batches)) for o in (model.optimizer,
                                                                                           optimizer)]
    for x, y in batches:
        logits, loss = model(x, targets=y)
        assert logits.shape == (len(x), CONFIG.block_size, CONFIG.vocab_size) and loss.dim() == 0
        loss.backward()
        remote_norm = model.clip_grad_norm_(1.0)
        model.optimizer.step()
        model.optimizer.zero_grad()
        local(x, y)[1].backward()
        local_norm = torch.nn.utils.clip_grad_norm_(local.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        for schedule in schedules:
            schedule.step()
        assert remote_norm.item() == pytest.approx(local_norm.item(), rel=1e-5)
    state = model.state_dict()
    assert set(state) == set(local.state_dict())
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert largest_difference(state, local.state_dict()) < 1e-5


@pytest.mark.parametrize("pipeline_schedule", ["1f1b", "zb-h1"])
def test_a_gpt_computing_its_loss_trains_with_train_step_as_one_process(cluster4, pipeline_schedule):
    local, batches = gpt(), token_batches(steps=8)
    remote = copy.deepcopy(local)
    model = cluster4.deploy(remote, optimizer=remote.configure_optimizers(0.1, 3e-3), example_inputs=batches[0],
                            num_stages=3)
    optimizer = local.configure_optimizers(0.1, 3e-3)
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=len(batches)) for o in (model.optimizer,
                                                                                           optimizer)]
    for x, y in batches:
        remote_loss = model.train_step((x, y), loss_output=1, microbatches=4, schedule=pipeline_schedule,
                                       clip_grad_norm=1.0)
        local_loss = local(x, y)[1]
        local_loss.backward()
        local_norm = torch.nn.utils.clip_grad_norm_(local.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        for schedule in schedules:
            schedule.step()
        assert remote_loss == pytest.approx(local_loss.item(), rel=1e-5)
        assert model.grad_norm().item() == pytest.approx(local_norm.item(), rel=1e-5)
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-5
    with pytest.raises(InvalidArgument, match="with loss_output the model computes its loss itself"):
        model.train_step(batches[0], batches[0][1], loss_output=1)
    with pytest.raises(InvalidArgument, match=r"the model returns a tuple of 2: it has no output 'loss'"):
        model.train_step(batches[0], loss_output="loss")
    with pytest.raises(InvalidArgument, match=r"needs the target y of loss_fn, or loss_output="):
        model.train_step(batches[0])


@pytest.mark.parametrize("pipeline_schedule", ["gpipe", "zb-h1"])
def test_a_gpt_trains_with_train_step_on_two_replicas_and_a_loss_of_its_logits(cluster4, pipeline_schedule):
    local, batches = gpt(), token_batches(steps=4)
    remote = copy.deepcopy(local)
    model = cluster4.deploy(remote, optimizer=(torch.optim.AdamW, {"lr": 3e-3}), example_input=batches[0][0],
                            num_stages=2, replicas=2)
    optimizer = torch.optim.AdamW(local.parameters(), lr=3e-3)
    for x, y in batches:
        remote_loss = model.train_step(x, y, loss_fn=SequenceLoss(), microbatches=2, schedule=pipeline_schedule)
        local_loss = loss_of(local(x)[0], y)
        local_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert remote_loss == pytest.approx(local_loss.item(), rel=1e-5)
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-5
    with pytest.raises(InvalidArgument, match=r"output 1 was the constant None when the model was deployed"):
        model.train_step(batches[0][0], loss_output=1)


def test_a_gpt_generates_from_prompts_shorter_than_its_example_and_splits_where_named(cluster4):
    local = gpt()
    model = cluster4.deploy(copy.deepcopy(local), example_input=token_batches(1)[0][0], dynamic_shapes=SEQUENCE,
                            split_points=["transformer.h.1", "transformer.h.3"])
    assert {p.cost_unit for p in model.placements} == {"parameters"}
    starts = [placement.layers[0] for placement in model.placements]
    assert [start.split(" ")[0] for start in starts] == ["transformer.wte", "transformer.h.1", "transformer.h.3"]
    model.eval()
    local.eval()
    for prompt in (torch.tensor([[3]]), torch.tensor([[1, 2, 3], [4, 5, 6]])):
        remote_text = generate(model, prompt, 14, CONFIG.block_size, generator=torch.Generator().manual_seed(2))
        local_text = generate(local, prompt, 14, CONFIG.block_size, generator=torch.Generator().manual_seed(2))
        assert torch.equal(remote_text, local_text)
    too_long = torch.zeros(1, CONFIG.block_size + 1, dtype=torch.long)
    with pytest.raises(AssertionError, match="Cannot forward sequence of length 13"):
        local(too_long)
    with pytest.raises(InvalidArgument, match=r"argument 'idx' has size 13 in dim 1; the deployed model takes at most "
                                              "12 there"):
        model(too_long)
    with pytest.raises(InvalidArgument, match="split point 'transformer.h.9'.*transformer.wte"):
        cluster4.deploy(copy.deepcopy(local), example_input=token_batches(1)[0][0], split_points=["transformer.h.9"])
    with pytest.raises(InvalidArgument, match=r"balance must be one of \['time', 'parameters'\], got 'speed'"):
        cluster4.deploy(copy.deepcopy(local), example_input=token_batches(1)[0][0], balance="speed")


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convolutions with BatchNorm, and a projected shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.downsample = None if stride == 1 and inputs == outputs else nn.Sequential(
            nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + identity)


class SmallResNet(nn.Module):
    """ResNet-18's shape (stem, four stages of two basic blocks, pooling, classifier), narrow."""

    def __init__(self, width: int = 4, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        widths = [width, width, 2 * width, 2 * width]
        self.layer1, self.layer2, self.layer3, self.layer4 = (
            nn.Sequential(BasicBlock(w_in, w_out, 1 if i == 0 else 2), BasicBlock(w_out, w_out, 1))
            for i, (w_in, w_out) in enumerate(zip([width, *widths[:-1]], widths)))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def test_a_resnet_with_batchnorm_in_training_mode_trains_as_one_process(cluster4):
    torch.manual_seed(0)
    local = SmallResNet()
    remote = copy.deepcopy(local)
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 3, 16, 16, generator=generator), torch.randint(0, 5, (8,), generator=generator))
               for _ in range(4)]
    model = cluster4.deploy(remote, optimizer=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
                            example_input=batches[0][0], num_stages=4)
    units = [name for placement in model.placements for name in placement.layers]
    assert any(name.startswith("layer2.1 ") for name in units)  # a Sequential's blocks are cut one by one
    optimizer = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
    train_side_by_side(model, local, optimizer, batches, nn.functional.cross_entropy)
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-5  # running statistics included
    model.eval()
    local.eval()
    assert (model(batches[0][0]) - local(batches[0][0])).abs().max().item() < 1e-5


class MaskedTokens(nn.Module):
    """Token ids and a padding mask made at the start and read at the end: cuts carry int64 and bool tensors."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.body = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.scale = nn.Embedding(10, 1)
        self.head = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = tokens != 0
        x = self.embed(tokens)
        for layer in self.body:
            x = layer(x) + x
        x = x * self.scale(tokens)
        pooled = (x * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return self.head(pooled)


def test_cuts_carry_token_ids_and_masks_to_the_stages_that_read_them(cluster4):
    torch.manual_seed(0)
    local = MaskedTokens()
    remote = copy.deepcopy(local)
    generator = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, 10, (5, 7), generator=generator), torch.randn(5, 2, generator=generator))
               for _ in range(4)]
    model = cluster4.deploy(remote, optimizer=(torch.optim.Adam, {"lr": 1e-2}), example_input=batches[0][0],
                            split_points=["body.1", "scale"])
    train_side_by_side(model, local, torch.optim.Adam(local.parameters(), lr=1e-2), batches, nn.functional.mse_loss)
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-5


class Encoder(nn.Module):
    """Token ids and an attention mask in, a dict of per-token logits and a pooled summary out."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.classify = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.tanh(layer(x)) * attention_mask.unsqueeze(-1)
        pooled = x.sum(1) / attention_mask.sum(1, keepdim=True).clamp(min=1)
        return {"logits": self.classify(x), "pooled": pooled, "mask": attention_mask > 0}


def test_a_model_of_several_inputs_returning_a_dict_trains_as_one_process(cluster4):
    torch.manual_seed(0)
    local = Encoder()
    remote = copy.deepcopy(local)
    generator = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 10, (4, 6), generator=generator),
                (torch.rand(4, 6, generator=generator) > 0.3).float()) for _ in range(3)]
    model = cluster4.deploy(remote, optimizer=(torch.optim.Adam, {"lr": 1e-2}), example_inputs=batches[0],
                            split_points=["layers.1", "layers.2"])
    optimizer = torch.optim.Adam(local.parameters(), lr=1e-2)

    def loss_of_outputs(outputs: dict) -> torch.Tensor:
        return outputs["logits"].square().mean() + outputs["pooled"].abs().mean()
    for tokens, mask in batches:
        outputs = model(tokens, attention_mask=mask)
        assert outputs.keys() == {"logits", "pooled", "mask"} and outputs["mask"].dtype == torch.bool
        loss_of_outputs(outputs).backward()
        model.step()
        model.zero_grad()
        loss_of_outputs(local(tokens, attention_mask=mask)).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-5
    with torch.no_grad():
        remote_outputs, local_outputs = model(*batches[0]), local(*batches[0])
    assert all(torch.allclose(remote_outputs[key], local_outputs[key], atol=1e-6) for key in local_outputs)
    # train_step takes the inputs as keywords (or a tuple); its loss reads the first output, the logits.
    tokens, mask = batches[1]
    target = torch.randn(4, 6, 3, generator=generator)
    remote_loss = model.train_step({"tokens": tokens, "attention_mask": mask}, target, "MSELoss", microbatches=2)
    local_loss = torch.nn.functional.mse_loss(local(tokens, attention_mask=mask)["logits"], target)
    local_loss.backward()
    optimizer.step()
    assert remote_loss == pytest.approx(local_loss.item(), rel=1e-5)
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-5
    with pytest.raises(InvalidArgument, match=r"the model's forward\(tokens.*missing a required argument: "
                                              "'attention_mask'"):
        model.train_step((tokens,), target)
    with pytest.raises(InvalidArgument, match=r"same batch dimension \(dim 0\), got the first input \[4, 6\], "
                                              r"attention_mask \[3, 6\]"):
        model.train_step((tokens, mask[:3]), target)


class SharedScale(nn.Module):
    """A parameter read first and last (on two stages) and a non-persistent mask (not in the state dict)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((4,), 0.5))
        self.first, self.middle, self.last = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0, 1.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.middle(self.first(x * self.scale))
        return self.last(x) * self.scale * self.mask


def test_a_weight_read_on_two_stages_stays_one_and_a_non_persistent_buffer_reaches_its_stage(cluster4):
    torch.manual_seed(0)
    local = SharedScale()
    remote = copy.deepcopy(local)
    batches = regression_batches(steps=4, batch=6, features=4, outputs=4)
    model = cluster4.deploy(remote, optimizer=(torch.optim.SGD, {"lr": 0.1}), example_input=batches[0][0],
                            num_stages=3)
    assert [len(placement.layers) for placement in model.placements] == [1, 1, 1]
    train_side_by_side(model, local, torch.optim.SGD(local.parameters(), lr=0.1), batches, nn.functional.mse_loss)
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-6  # no "mask", as locally
    model.load_state_dict(local.state_dict())  # without the mask, as the local state dict has it


class LSTMLanguageModel(nn.Module):
    """An LSTM (a tuple of outputs and states) between an embedding and a head, reading a float attribute."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 12)
        self.temperature = 0.5

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(idx))
        return self.head(out) / self.temperature


def test_an_lstm_language_model_trains_as_one_process_and_its_frozen_python_value_is_named(cluster4):
    torch.manual_seed(0)
    local = LSTMLanguageModel()
    remote = copy.deepcopy(local)
    generator = torch.Generator().manual_seed(6)
    batches = [(torch.randint(0, 12, (4, 7), generator=generator), torch.randint(0, 12, (4, 7), generator=generator))
               for _ in range(3)]
    with pytest.warns(UserWarning, match=r"LSTMLanguageModel.temperature = 0.5; changing them later does not reach"):
        model = cluster4.deploy(remote, optimizer=(torch.optim.SGD, {"lr": 0.5}), example_input=batches[0][0],
                                num_stages=3)
    assert [placement.layers[0].split(" ")[0] for placement in model.placements] == ["embed", "lstm", "head"]

    def sequence_loss(logits, targets):
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    train_side_by_side(model, local, torch.optim.SGD(local.parameters(), lr=0.5), batches, sequence_loss)
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-5


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.linear(x)
        return x


class ListInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, pair):
        return self.linear(pair[0] + pair[1])


@pytest.mark.parametrize("net, expected", [
    (DataDependent(), r"DataDependent cannot be captured .* at .*test_whole_models.py:\d+ \(`if x.sum\(\) > 0:`\): "
                      r"its forward takes a path that depends on the values in a tensor"),
    (ListInput(), "the model's inputs must be tensors, each its own argument; the example gives 'pair' a list"),
])
def test_a_model_that_cannot_be_deployed_whole_is_refused_with_the_reason(cluster4, net, expected):
    example = [torch.randn(3, 4), torch.randn(3, 4)] if isinstance(net, ListInput) else torch.randn(3, 4)
    with pytest.raises(InvalidArgument, match=expected):
        cluster4.deploy(net, example_inputs=(example,))
    with pytest.raises(InvalidArgument, match="captured whole, from an example: pass example_input"):
        cluster4.deploy(ListInput())


def test_shards_register_their_memory_and_a_model_that_cannot_fit_is_refused_with_the_numbers(monkeypatch):
    monkeypatch.setenv("SHARDTRAIN_MEMORY", "1M")  # each local shard says a stage may use 1 MiB
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64))
    with Cluster.local(num_shards=3) as cluster:
        assert {shard.memory_bytes for shard in cluster.shards()} == {2**20}
        # Adam: each weight with its gradient and two moments, 16 bytes a parameter; the middle Linear (65,792
        # parameters, 1.0 MiB with its state) fits no shard
        with pytest.raises(ResourceExhausted, match=r"the model needs 1.509 MiB in all .* its largest layer 1.004 "
                                                    r"MiB\) and the 3 shards have 1 MiB, 1 MiB, 1 MiB"):
            cluster.deploy(net, optimizer=(torch.optim.Adam, {"lr": 1e-3}))
        model = cluster.deploy(net, optimizer=(torch.optim.SGD, {"lr": 1e-3}))  # 12 bytes a parameter: it fits
        assert model(torch.randn(4, 64)).shape == (4, 64)


class AuxiliaryLoss(nn.Module):
    """Returns an output and a loss computed on its first part."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor):
        hidden = self.first(x)
        auxiliary = hidden.square().mean()  # computed in the first unit, so on the first stage
        return self.second(hidden), auxiliary


def test_a_loss_computed_on_the_first_stage_trains_through_the_last_as_one_process(cluster4):
    torch.manual_seed(0)
    local = AuxiliaryLoss()
    model = cluster4.deploy(copy.deepcopy(local), optimizer=(torch.optim.SGD, {"lr": 0.1}),
                            example_input=torch.randn(4, 3), num_stages=2)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(6, 3)
        remote_loss = model.train_step(x, loss_output=1, microbatches=3)
        local_loss = local(x)[1]
        local_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert remote_loss == pytest.approx(local_loss.item(), rel=1e-5)
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-6


def test_stages_balanced_by_time_give_a_faster_shard_more_layers_as_its_own_measurements_say():
    """Two shards on this host, one computing on two cores and one on one: each measures every layer itself (one
    after the other, so neither slows the other), and the faster one takes more of eight equal layers."""
    speedup = second_thread_speedup()
    if speedup < 1.6:
        pytest.skip(f"a second thread makes this host's matrix products only {speedup:.2f}x as fast now (shared "
                    "or busy cores), too little to tell a faster shard from a slower one")
    security = Security(token=secrets.token_urlsafe(16))
    services = LocalServices(0, env=security_env(security))
    services.add_shard(["--threads", "2"])
    services.add_shard(["--threads", "1"])
    with Cluster(services.coordinator_address, security=security, services=services) as cluster:
        cluster.wait_for_shards(2)
        torch.manual_seed(0)
        net = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8)))  # large enough for two cores to pay
        model = cluster.deploy(net, example_input=torch.randn(512, 1024), balance="time")
        fast, slow = model.placements
        assert {fast.cost_unit, slow.cost_unit} == {"us of forward and backward"}
        if fast.end_layer - fast.first_layer < 5 and (speedup := second_thread_speedup()) < 1.6:
            pytest.skip(f"the host got busy while the shards measured: a second thread now gives {speedup:.2f}x "
                        f"(two-thread shard {fast.layer_costs} us, one-thread shard {slow.layer_costs} us)")
        assert len(fast.layer_costs) == fast.end_layer - fast.first_layer >= 5
        assert statistics.median(fast.layer_costs) < statistics.median(slow.layer_costs)
        assert fast.cost == sum(fast.layer_costs) and slow.cost == sum(slow.layer_costs)
        x = torch.randn(4, 1024)
        assert torch.allclose(model(x), net(x), atol=1e-5)
        model = cluster.deploy(net, example_input=x)  # a Sequential: by parameters unless asked
        assert [(p.first_layer, p.end_layer, p.cost_unit) for p in model.placements] == [(0, 4, "parameters"),
                                                                                         (4, 8, "parameters")]


def second_thread_speedup() -> float:
    """How much faster this host multiplies the test's matrices on two threads than on one, now."""
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    threads, times = torch.get_num_threads(), {}
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            runs = []
            for _ in range(7):
                start = time.perf_counter()
                a @ b
                runs.append(time.perf_counter() - start)
            times[count] = statistics.median(runs)
    finally:
        torch.set_num_threads(threads)
    return times[1] / times[2]
