"""Benchmark: what a deploy costs against torch.export of the same model plus sending its weights once.

    python -m bench.deploy [--layers 12] [--width 768] [--shards 4] [--rounds 2]

A Hugging Face GPT-2 of GPT-2 small's shape (12 blocks, 768 wide, its 50,257-token vocabulary; random weights, no
download) is deployed over local shards, balanced by measured time, as its documentation calls it (input_ids,
attention_mask, labels). Baselines in the same run: a plain `torch.export.export` of the model on the same example,
and `model.load_state_dict` of its weights into the deployment (every weight sent once). Printed: the median of
each over the rounds, the deploy's phases (model.deploy_seconds), and the ratio deploy / (export + weights). Each
round's deploy is printed too: the first runs on fresh shards, later ones on shards that built its programs before.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402

from client_sdk import Cluster  # noqa: E402


def model_and_example(layers: int, width: int, vocabulary: int):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), n_positions=128,
                                     vocab_size=vocabulary, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, vocabulary, (2, 32))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocabulary", type=int, default=50257)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model, example = model_and_example(args.layers, args.width, args.vocabulary)
    parameters = sum(p.numel() for p in model.parameters())
    exports, sends, deploys, phases = [], [], [], []
    with Cluster.local(num_shards=args.shards) as cluster, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(args.rounds):
            start = time.perf_counter()
            torch.export.export(copy.deepcopy(model), (), example)
            exports.append(time.perf_counter() - start)
            start = time.perf_counter()
            remote = cluster.deploy(model, optimizer=(torch.optim.AdamW, {"lr": 1e-4}), example_kwargs=example)
            deploys.append(time.perf_counter() - start)
            phases.append(remote.deploy_seconds)
            start = time.perf_counter()
            remote.load_state_dict(model.state_dict())
            sends.append(time.perf_counter() - start)
    export, send, deploy = (statistics.median(v) for v in (exports, sends, deploys))
    print(f"GPT-2 {args.layers} blocks x {args.width} ({parameters / 1e6:.0f}M parameters) on {args.shards} shards, "
          f"median of {args.rounds}")
    print(f"  torch.export.export          {export:7.2f} s")
    print(f"  load_state_dict (weights)    {send:7.2f} s")
    print(f"  deploy                       {deploy:7.2f} s  (rounds: {', '.join(f'{d:.2f}' for d in deploys)} s)")
    for phase in phases[0]:
        print(f"    {phase:<26} {statistics.median(p[phase] for p in phases):7.2f} s")
    print(f"  deploy / (export + weights)  {deploy / (export + send):7.2f}x")


if __name__ == "__main__":
    main()
