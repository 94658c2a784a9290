"""bench.peer's model, batches and one-process reference: a small GPT, cut into stages by hand for every side."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BLOCKS = 8


@dataclass(frozen=True)
class Config:
    """The model's shape and the training every side runs: the same for shardtrain, torch and the reference."""

    vocab: int = 256
    width: int = 128
    heads: int = 4
    seq: int = 32
    batch: int = 32
    microbatches: int = 8
    lr: float = 0.1
    warmup: int = 2
    steps: int = 10

    @property
    def total_steps(self) -> int:
        """Steps of one turn, warm-up included."""
        return self.warmup + self.steps


class Embed(nn.Module):
    """Token and learned position embeddings."""

    def __init__(self, config: Config):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.width)
        self.positions = nn.Parameter(torch.randn(config.seq, config.width) * 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions[: idx.shape[1]]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, config: Config):
        super().__init__()
        self.heads = config.heads
        self.norm1, self.norm2 = nn.LayerNorm(config.width), nn.LayerNorm(config.width)
        self.qkv, self.proj = nn.Linear(config.width, 3 * config.width), nn.Linear(config.width, config.width)
        self.up, self.down = nn.Linear(config.width, 4 * config.width), nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Head(nn.Module):
    """The final LayerNorm and the projection onto the vocabulary."""

    def __init__(self, config: Config):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(config.width), nn.Linear(config.width, config.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build(config: Config) -> nn.Sequential:
    """The GPT as 10 layers (embedding, 8 blocks, head), from seed 0: every side starts from these weights."""
    torch.manual_seed(0)
    return nn.Sequential(Embed(config), *[Block(config) for _ in range(BLOCKS)], Head(config))


def layers_per_stage(stages: int) -> list[int]:
    """How many of the 10 layers each of `stages` stages takes: the blocks evenly, the embedding with the first
    stage's and the head with the last's (4 stages: 3, 2, 2, 3; 8: 2, 1, ..., 1, 2)."""
    if BLOCKS % stages:
        raise ValueError(f"{BLOCKS} blocks do not split evenly into {stages} stages")
    counts = [BLOCKS // stages] * stages
    counts[0] += 1
    counts[-1] += 1
    return counts


def pieces(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    """The model cut into `stages` consecutive stage modules, as layers_per_stage says (sharing its parameters)."""
    layers, cut = list(model), []
    for count in layers_per_stage(stages):
        cut.append(nn.Sequential(*layers[:count]))
        layers = layers[count:]
    return cut


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the vocabulary, the mean over every token of the (micro-)batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(config: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, next tokens) for each of the run's steps, the same on every side."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(config.total_steps):
        tokens = torch.randint(0, config.vocab, (config.batch, config.seq + 1), generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def reference_losses(config: Config, pieces_per_step: int) -> list[float]:
    """Each step's loss in one process: the batch in `pieces_per_step` equal micro-batches, their gradients
    accumulated (each loss weighed 1 / pieces), then one SGD step; what every distributed side must reproduce."""
    model = build(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    losses = []
    for x, y in batches(config):
        total = 0.0
        for xs, ys in zip(x.chunk(pieces_per_step), y.chunk(pieces_per_step)):
            loss = lm_loss(model(xs), ys) / pieces_per_step
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def timed_run(step: Callable[[torch.Tensor, torch.Tensor], float | None], data: list, warmup: int,
              cpu_seconds: Callable[[], float], settle: Callable[[], None] = lambda: None) -> dict:
    """Runs `step` on every batch of `data`: {"times": seconds from each timed step's end to the next's, the first
    from when the warm-up steps settled; "cpu": `cpu_seconds()` spent from then until the last step settled;
    "losses": what each step returned}. Both sides time a step so, from the end of one to the end of the next:
    shardtrain's train_step returns with the loss while its backwards go on, and overlaps the next step."""
    losses, ends, cpu = [], [time.perf_counter()], cpu_seconds()
    for index, (x, y) in enumerate(data):
        if index == warmup:
            settle()
            ends, cpu = [time.perf_counter()], cpu_seconds()
        losses.append(step(x, y))
        ends.append(time.perf_counter())
    settle()
    return {"times": [b - a for a, b in zip(ends, ends[1:])], "cpu": cpu_seconds() - cpu, "losses": losses}
