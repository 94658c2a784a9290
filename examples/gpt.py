"""A small character-level GPT, written as the well-known minimal GPT implementations write it, trained on 3 local
shards from a plain PyTorch loop, then asked to write.

    python examples/gpt.py [--steps 300]

The model is handed to deploy whole: captured once with torch.export, with its targets, so that the loss is
computed inside it on the last stage, and cut between its blocks. For sampling it is deployed again as it is
called without targets, the sequence length free up to the block size. The LM head stays tied to the token
embedding across stages, AdamW has two parameter groups (weight decay on matrices only), a cosine schedule drives
the rate on every stage, and gradients are clipped to norm 1.0 over all stages. The text is five of Shakespeare's
sonnets (public domain).
"""

from __future__ import annotations

import argparse
import math
import pathlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from client_sdk import Cluster

TEXT = pathlib.Path(__file__).parent / "data" / "sonnets.txt"


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits of the next token at every position of `idx` (batch, time), and their loss against `targets`
        (None without targets)."""
        t = idx.size(1)
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only " \
                                            f"{self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, None if targets is None else loss_of(logits, targets)

    def configure_optimizers(self, weight_decay: float, learning_rate: float) -> torch.optim.AdamW:
        """AdamW with weight decay on the matrices (weights and embeddings) only."""
        parameters = dict(self.named_parameters())
        decay = [p for p in parameters.values() if p.dim() >= 2]
        no_decay = [p for p in parameters.values() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate, betas=(0.9, 0.95))


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def generate(model, idx: torch.Tensor, new_tokens: int, block_size: int, temperature: float = 0.8,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Extends `idx` by sampling one token at a time; `model` is the local GPT or its deployment."""
    for _ in range(new_tokens):
        logits, _ = model(idx[:, -block_size:])
        logits = logits[:, -1, :] / temperature
        next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
        idx = torch.cat((idx, next_token), dim=1)
    return idx


def batches(data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator):
    """Endless (input, next-token target) batches of random windows of the text."""
    while True:
        starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([data[s:s + block_size] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts])
        yield x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    text = TEXT.read_text()
    characters = sorted(set(text))
    encode = {c: i for i, c in enumerate(characters)}
    data = torch.tensor([encode[c] for c in text], dtype=torch.long)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=len(characters))
    gpt = GPT(config)
    generator = torch.Generator().manual_seed(0)
    stream = batches(data, config.block_size, batch_size=16, generator=generator)
    with Cluster.local(num_shards=3) as cluster:
        # Captured with targets, so the loss is computed on the last stage, inside the model.
        model = cluster.deploy(gpt, optimizer=gpt.configure_optimizers(weight_decay=0.1, learning_rate=3e-3),
                               example_inputs=next(stream))
        print(model)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(model.optimizer, T_max=args.steps, eta_min=3e-4)
        for step in range(args.steps):
            x, y = next(stream)
            _, loss = model(x, y)
            loss.backward()
            model.clip_grad_norm_(1.0)
            model.optimizer.step()
            model.optimizer.zero_grad()
            schedule.step()
            if step % 50 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.3f}  lr {schedule.get_last_lr()[0]:.2e}")
        # Sampling takes prompts of any length without targets: the trained model, deployed as it is called then.
        gpt.load_state_dict(model.state_dict())
        writer = cluster.deploy(gpt.eval(), example_input=x,
                                dynamic_shapes={"idx": {1: torch.export.Dim("seq", max=config.block_size)}})
        prompt = torch.tensor([[encode[c] for c in "Shall I "]])
        sample = generate(writer, prompt, 120, config.block_size, generator=torch.Generator().manual_seed(1))
        print("".join(characters[i] for i in sample[0].tolist()))


if __name__ == "__main__":
    main()
